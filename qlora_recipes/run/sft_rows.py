"""TRL 1.16 SFTTrainer's dataset preparation for rows we already tokenized (data/tokens.py), done on whole
Arrow columns: the labels (-100 where a mask that applies is 0), truncation to max_length and the rows left
with no trained token dropped, in one pass of array arithmetic. TRL does the same as three row-by-row
`Dataset.map` passes inside the trainer's construction (in the run's training time, every run: rows held in
memory are never cached), which on the sample data cost more than the first training steps. The result is
what TRL's passes give, row for row; the trainer then skips its own (`skip_prepare_dataset`). Packing, a
dataset shuffle, and rows not tokenized by us keep TRL's own preparation."""

from __future__ import annotations

from typing import Any

MASKS = ("completion_mask", "assistant_masks")  # the order TRL applies them in


def for_trainer(objective: str, args: Any, train: Any, eval_ds: Any) -> tuple[Any, Any]:
    """(train, eval) for the objective's trainer: SFT rows prepared here where they can be, with `args` told
    to skip TRL's own preparation; anything else as it is."""
    given = [d for d in (train, eval_ds) if d is not None]
    if objective != "sft" or not applies(args, given):
        return train, eval_ds
    only, keep_end = completion_only(args, train), args.truncation_mode == "keep_end"
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    train = prepare(train, args.max_length, keep_end, only)
    return train, None if eval_ds is None else prepare(eval_ds, args.max_length, keep_end, only)


def applies(args: Any, datasets: list) -> bool:
    """Whether the rows can be prepared here: SFT rows with our token columns, truncated, not packed or shuffled."""
    from datasets import Dataset

    return (
        not args.packing
        and not args.shuffle_dataset
        and args.max_length is not None
        and args.truncation_mode in ("keep_start", "keep_end")
        and not (args.dataset_kwargs or {}).get("skip_prepare_dataset")
        and all(
            isinstance(d, Dataset) and "input_ids" in d.column_names and "labels" not in d.column_names
            for d in datasets
        )
    )


def completion_only(args: Any, train: Any) -> bool:
    """SFTTrainer's choice: `completion_only_loss` as set, else whether the rows are prompt/completion."""
    if args.completion_only_loss is not None:
        return bool(args.completion_only_loss)
    return "prompt" in train.column_names and "completion" in train.column_names


def prepare(ds: Any, max_length: int, keep_end: bool, completion_only_loss: bool) -> Any:
    """`ds` as TRL's label, truncation and drop passes leave it: `labels` added, the mask columns gone,
    `input_ids` and `labels` cut to `max_length` (keep_end: their last tokens), rows without a trained
    token removed."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset

    table = ds.with_format("arrow")[:]  # the rows in the dataset's order (an eval split is an index view)
    masks = [c for c in MASKS if c in table.column_names and (c != "completion_mask" or completion_only_loss)]
    ids = table["input_ids"].combine_chunks()
    starts, lengths = ids.offsets.to_numpy()[:-1], ids.value_lengths().to_numpy()
    row = np.repeat(np.arange(len(ids)), lengths)
    pos = np.arange(len(row)) - np.repeat(starts - starts[0] if len(starts) else starts, lengths)
    values = ids.flatten().to_numpy()
    trained = np.ones(len(values), dtype=bool)
    for name in masks:  # a mask's rows are as long as their input_ids (tokens.py makes them together)
        trained &= table[name].combine_chunks().flatten().to_numpy() == 1
    labels = np.where(trained, values, -100)
    kept = pos >= (lengths - max_length)[row] if keep_end else pos < max_length
    has_loss = np.bincount(row[kept & trained], minlength=len(ids)) > 0
    keep = kept & has_loss[row]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(row[keep], minlength=len(ids))[has_loss])])
    rows = table.drop_columns(masks).filter(pa.array(has_loss))
    lists = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray  # int32 offsets hold 2**31 tokens
    list_of = lambda vals, typ: lists.from_arrays(pa.array(offsets), pa.array(vals, typ))  # noqa: E731
    rows = rows.set_column(
        rows.column_names.index("input_ids"), "input_ids", list_of(values[keep], ids.type.value_type)
    )
    return Dataset(rows.append_column("labels", list_of(labels[keep], pa.int64())))
