"""The SFT rows we tokenized are prepared for the trainer in one vectorized pass (run/sft_rows.py) instead
of TRL 1.16's three row-by-row passes in the trainer's construction: the result is TRL's, row for row,
for every mask, truncation side and row order, and TRL's own preparation is then skipped."""

from types import SimpleNamespace

import pytest
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from qlora_recipes.run import sft_rows

MAX = 6


def _rows(masks: tuple[str, ...]) -> Dataset:
    """Rows shorter than, as long as and longer than MAX; one whose trained tokens all lie past MAX."""
    lengths_and_starts = [(3, 1), (6, 2), (9, 4), (10, 8), (4, 0), (12, 11), (7, 7)]
    rows = []
    for i, (n, start) in enumerate(lengths_and_starts):
        row = {
            "prompt": f"p{i}",
            "completion": f"c{i}",
            "input_ids": [100 * i + k for k in range(n)],
            "trained_from": start,
        }
        for name in masks:
            row[name] = [0] * start + [1] * (n - start)
        if "assistant_masks" in masks and n > 5:
            row["assistant_masks"][-1] = 0  # a turn's last token outside the generation span
        rows.append(row)
    return Dataset.from_list(rows)


def _trl(ds: Dataset, args: SFTConfig, only: bool) -> Dataset:
    return SFTTrainer._prepare_dataset(SimpleNamespace(completion_only_loss=only), ds, None, args, False, None, "train")


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize(
    "masks,only",
    [(("completion_mask",), True), (("completion_mask",), False), (("assistant_masks",), None), ((), False)],
)
def test_prepared_rows_equal_trls(masks, only, mode):
    args = SFTConfig(
        output_dir="unused",
        max_length=MAX,
        truncation_mode=mode,
        completion_only_loss=only,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    ds = _rows(masks)
    view = ds.shuffle(seed=1).select(range(1, len(ds)))  # an index view, as an eval split is
    for rows in (ds, view):
        expected = _trl(rows, args, sft_rows.completion_only(args, rows))
        train, none = sft_rows.for_trainer("sft", args, rows, None)
        assert none is None and args.dataset_kwargs == {"skip_prepare_dataset": True}
        assert train.column_names == expected.column_names and train.to_list() == expected.to_list()
        if only or masks == ("assistant_masks",):  # a mask applies: the rows with no trained token went
            assert len(train) < len(rows)
        args.dataset_kwargs = None


def test_packed_or_untokenized_rows_keep_trls_preparation():
    packed = SFTConfig(output_dir="unused", max_length=MAX, packing=True, report_to=[], use_cpu=True, bf16=False)
    ds = _rows(("completion_mask",))
    assert sft_rows.for_trainer("sft", packed, ds, None) == (ds, None) and not packed.dataset_kwargs
    plain = SFTConfig(output_dir="unused", max_length=MAX, report_to=[], use_cpu=True, bf16=False)
    text = Dataset.from_list([{"text": "a b c"}])
    assert sft_rows.for_trainer("sft", plain, text, None) == (text, None) and not plain.dataset_kwargs
    assert sft_rows.for_trainer("dpo", plain, ds, None) == (ds, None)
