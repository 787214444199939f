"""`load_splits`: read `data.path` (and `data.eval_path`), convert every row to the columns TRL's
`SFTTrainer` takes as they are, hold out a seeded eval split, set the chat template chat data trains with,
tokenize each split once as TRL would (tokens.py: TRL then trains on those ids without tokenizing again),
count from those tokens, and say in one line what was found.

Rows longer than `trainer.seq_len` tokens: with `data.too_long=truncate` (the default) TRL keeps their
first seq_len tokens, and the counts say how many examples that touches (and how many TRL then drops for
having no trained token left); with `data.too_long=drop` they are removed here, as grpo's prompt rows
always are (TRL's GRPOTrainer samples from a prompt whole, so one cut short would ask something else,
and one kept whole would outgrow the plan). Train and eval alike; the
counts go into the run's metrics.json (`data`), and a run where nothing would be left to train on stops
before it starts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from datasets import Dataset

from ..config.objectives import OBJECTIVES
from ..config.schema import DataConfig, ObjectiveConfig
from ..errors import UserError
from .chat import resolve_template, use_chat_template
from .formats import check_format_name, check_objective_data, convert, detect, trains_as, unpair
from .pairs import check_identical
from .readers import BATCH_ROWS, read_source
from .tokens import SCRATCH, quiet_datasets, token_figures, tokenization_for, tokenize_split

log = logging.getLogger(__name__)

TOO_LONG = ("truncate", "drop")


def load_splits(
    data: DataConfig,
    tokenizer: Any,
    seq_len: Any,
    seed: int,
    objective: ObjectiveConfig | None = None,
    positions: int | None = None,
) -> tuple[Dataset, Dataset | None, dict]:
    """Load `data.path` (and `data.eval_path`), validate every row and return `(train, eval_or_None, stats)`.
    `seq_len`: tokens, or (trainer.seq_len=auto, with a tokenizer) a function of the train rows' token
    lengths and their source that returns it (stats["seq_len"]); `positions`: the model's (_longer_hint).

    The datasets have the columns TRL's trainer reads: `prompt`+`completion` (alpaca and prompt_completion;
    strings, or message lists for a conversational prompt_completion), `messages` (messages and ShareGPT),
    or `text`; with a tokenizer also TRL's token columns, `input_ids` and `completion_mask` or
    `assistant_masks` (tokens.py), so TRL does not tokenize them again (DPO's and KTO's rows keep their
    text). Without `eval_path`, a seeded `eval_fraction` of the rows is held out (None when 0). For chat
    data the tokenizer gets the chat template it trains with (`data.chat_template`), as the one saved will.

    stats: `format` (what TRL trains: ShareGPT is `messages`), `detected` (the rows' own format),
    `format_from` (`detected` or `data.format`), `conversational`, `source`, `eval_source`, `rows`
    ({train, eval}, after dropping), `seq_len`, `too_long`, `over_seq_len` ({train, eval}: examples
    longer than seq_len tokens), `truncated` (of those, kept and cut to seq_len by TRL),
    `dropped_by_truncation` (of those, examples TRL 1.16 removes for having no trained token in the
    first seq_len; 0 under packing), `dropped_too_long` (removed here under `too_long=drop`), `max_tokens`
    ({train, eval}, before dropping), `chat_template` (which one, for chat data), `metric` and
    `prompt_format` (how generation wraps a plain prompt the way this data's prompts look),
    `identical_pairs` ({train, eval}: preference pairs whose chosen is their rejected, pairs.py; None for
    other rows). The token figures are None when `tokenizer` is None.
    """
    quiet_datasets()  # before the first read: datasets' bars would drown ours and the trainer's
    configured = check_format_name(data.format)
    eval_fraction = _eval_fraction(data.eval_fraction)
    too_long = _too_long(data.too_long)
    if not callable(seq_len) and (not isinstance(seq_len, int) or seq_len < 1):
        raise UserError(f"trainer.seq_len: {seq_len!r} must be a positive number of tokens")

    detected, train, conversational, source = _load(data.path, data.split or "train", "data.path", configured)
    fmt = trains_as(detected)
    name = objective.name if objective is not None else "sft"
    check_objective_data(fmt, OBJECTIVES[name].data, name, source)  # pairs for dpo, SFT rows for sft
    train, eval_ds, eval_source = _eval_split(data, train, (configured, fmt, conversational), source, seed)
    identical = _identical(fmt, train, eval_ds, source, eval_source)
    train, eval_ds, fmt = _as_read(train, eval_ds, fmt, OBJECTIVES[name].data, seed)

    chat = fmt == "messages" or conversational
    stats: dict[str, Any] = {
        "format": fmt,
        "detected": detected,
        "format_from": "detected" if configured == "auto" else "data.format",
        "conversational": chat,
        "source": source,
        "eval_source": eval_source,
        "rows": {"train": len(train), "eval": len(eval_ds) if eval_ds is not None else 0},
        "seq_len": seq_len,
        "too_long": too_long,
        "over_seq_len": None,
        "truncated": None,
        "dropped_by_truncation": None,
        "dropped_too_long": None,
        "max_tokens": None,
        "chat_template": None,
        "metric": _metric_name(data.metric, eval_ds is not None),
        "prompt_format": None,
        "identical_pairs": identical,
    }
    option = data.chat_template
    if tokenizer is not None:
        if chat:
            stats["chat_template"] = use_chat_template(tokenizer, option, source)
        elif resolve_template(option)[0] is not None:
            log.info("data.chat_template is set but %s holds %s rows, not chat: it is not used", source, detected)
        splits = {"train": train} if eval_ds is None else {"train": train, "eval": eval_ds}
        limits = (positions, _completion_room(objective)) if positions else None
        kept = _add_token_stats(stats, splits, conversational, tokenizer, data, limits)
        train, eval_ds = kept["train"], kept.get("eval")
        stats["rows"] = {"train": len(train), "eval": len(eval_ds) if eval_ds is not None else 0}
    stats["prompt_format"] = prompt_format(train, fmt, conversational)
    log.info(_summary_line(stats, eval_fraction if data.eval_path in (None, "") else None))
    return train, eval_ds, stats


def _identical(fmt: str, train: Dataset, eval_ds: Dataset | None, source: str, eval_source: str | None):
    """Preference pairs whose chosen is their rejected, per split (pairs.py); None for other rows."""
    if fmt != "preference":
        return None
    return check_identical({"train": train, "eval": eval_ds}, {"train": source, "eval": eval_source})


def _eval_split(data: DataConfig, train: Dataset, kind: tuple, source: str, seed: int) -> tuple:
    """(train, eval or None, eval source): `data.eval_path`'s rows (`kind`: the configured format, the
    format and whether it is chat, which they must share), else a held-out `data.eval_fraction`."""
    eval_fraction = _eval_fraction(data.eval_fraction)
    if data.eval_path not in (None, ""):
        eval_ds, eval_source = _eval_file(data.eval_path, data.split or "train", *kind)
        if eval_fraction:
            log.info("data.eval_path is set, so data.eval_fraction=%s is not used", eval_fraction)
        return train, eval_ds, eval_source
    if eval_fraction > 0:
        return _hold_out(train, eval_fraction, source, seed, data.eval_max_rows)
    return train, None, None


def _completion_room(objective: ObjectiveConfig | None) -> int:
    """Positions objective=grpo keeps for a sampled completion after its prompt (0 for the others)."""
    if objective is None or objective.name != "grpo":
        return 0
    return int(objective.max_completion_length or 0)


def _longer_hint(stats: dict[str, Any], limits: tuple[int, int] | None) -> str:
    """How to keep rows longer than seq_len: raise trainer.seq_len while the model has positions for it;
    once seq_len (plus grpo's sampled completion) fills them, give the model more with model.rope_scaling.
    `limits`: (the model's positions, the completion's share of them), None when unknown."""
    seq_len = stats["seq_len"]
    if limits is None or seq_len + limits[1] < limits[0]:
        return "raise trainer.seq_len"
    taken = f"trainer.seq_len={seq_len}" + (f" + objective.max_completion_length={limits[1]}" if limits[1] else "")
    return (
        f"set model.rope_scaling={{rope_type:linear,factor:F}} for F times the model's positions ({taken} "
        f"already fill its {limits[0]:,})"
    )


def _as_read(train: Dataset, eval_ds: Dataset | None, fmt: str, kind: str, seed: int) -> tuple:
    """The rows as the objective reads them: for kto (`unpaired`) preference pairs become two rows each,
    a desirable and an undesirable one (formats.unpair); every other case as loaded."""
    if kind != "unpaired" or fmt != "preference":
        return train, eval_ds, fmt
    return unpair(train, seed), None if eval_ds is None else unpair(eval_ds, seed), "unpaired"


def _eval_fraction(value: Any) -> float:
    """`data.eval_fraction` checked (None reads as 0)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UserError(
            f"data.eval_fraction: {value!r} is not a fraction in [0, 1); "
            "use e.g. 0.1, or 0 with data.eval_path for a separate eval file"
        )
    return value


def _too_long(value: Any) -> str:
    if value not in TOO_LONG:
        raise UserError(f"data.too_long={value!r} is not an option; use truncate or drop")
    return value


def _metric_name(metric: Any, has_eval: bool) -> str:
    if not has_eval:
        return "none (no eval split)"
    return "eval loss + exact match" if metric == "exact_match" else "eval loss"


def _load(spec: Any, split: str, field: str, fmt: str) -> tuple[str, Dataset, bool, str]:
    rows, source = read_source(spec, split, field)
    detected = detect(rows) if fmt == "auto" else fmt
    dataset, conversational = convert(rows, detected)
    return detected, dataset, conversational, source


def _eval_file(eval_path: Any, split: str, configured: str, fmt: str, conversational: bool) -> tuple[Dataset, str]:
    """The eval set from `data.eval_path`, which must train as the train data does (ShareGPT and messages
    files mix: both are chat messages)."""
    eval_detected, eval_ds, eval_conv, eval_source = _load(eval_path, split, "data.eval_path", configured)
    eval_fmt = trains_as(eval_detected)
    if eval_fmt != fmt or eval_conv != conversational:
        kind = lambda f, c: f + (" (chat messages)" if c else "")  # noqa: E731
        raise UserError(
            f"data.eval_path: {eval_source} is in format {kind(eval_fmt, eval_conv)} but data.path is "
            f"{kind(fmt, conversational)}; give both files the same fields"
        )
    return eval_ds, eval_source


def _hold_out(
    train: Dataset, eval_fraction: float, source: str, seed: int, max_rows: int | None = None
) -> tuple[Dataset, Dataset, str]:
    """A seeded `eval_fraction` of the train rows as the eval set, at most `max_rows` of them (the
    rest train: a large file's tenth would make the final evaluation take longer than training);
    both keep the file's row order."""
    import numpy as np

    n = len(train)
    n_eval = max(1, int(round(n * eval_fraction)))
    if max_rows is not None and n_eval > max_rows:
        log.info(
            "data: the eval split is capped at data.eval_max_rows=%d rows (data.eval_fraction=%g of %d rows in %s "
            "would hold out %d); the other %d train. Set data.eval_max_rows=N (null: no cap) to change it",
            max_rows,
            eval_fraction,
            n,
            source,
            n_eval,
            n_eval - max_rows,
        )
        n_eval = max_rows
    if n_eval >= n:
        raise UserError(
            f"data.eval_fraction: {eval_fraction} of {n} rows in {source} leaves no rows to train on; "
            "add rows, lower data.eval_fraction, or pass data.eval_path"
        )
    order = np.random.default_rng(seed).permutation(n)
    eval_idx, train_idx = np.sort(order[:n_eval]), np.sort(order[n_eval:])  # not Python ints: one per row
    return train.select(train_idx), train.select(eval_idx), f"{eval_fraction:g} of {source} (seed {seed})"


def _summary_line(stats: dict[str, Any], held_out: float | None) -> str:
    """The one line a run prints about its data: what was detected, what it trains as, the splits."""
    detected = stats["detected"]
    how = "detected from the fields" if stats["format_from"] == "detected" else "data.format"
    if detected == "sharegpt":
        shape = f"sharegpt rows ({how}) -> chat messages"
    elif detected == "alpaca":
        shape = f"alpaca rows ({how}) -> prompt/completion in the Alpaca template"
    elif detected == "prompt":
        shape = f"prompt rows ({how}) for sampled completions" + (", chat" if stats["conversational"] else "")
    elif detected == "preference":
        shape = f"preference pairs ({how})" + (", chat" if stats["conversational"] else "")
        shape += " -> unpaired rows" if stats["format"] == "unpaired" else ""
    elif stats["conversational"]:
        shape = f"{detected} rows ({how}), chat"
    else:
        shape = f"{detected} rows ({how})"
    if stats["chat_template"]:
        shape += f" with the chat template ({stats['chat_template']})"
    rows = stats["rows"]
    if stats["eval_source"] is None:
        evals = "no eval split"
    elif held_out:
        evals = f"{rows['eval']} eval held out (data.eval_fraction={held_out:g})"
    else:
        evals = f"{rows['eval']} eval from {stats['eval_source']}"
    line = f"data: {stats['source']}: {shape}; {rows['train']} train rows, {evals}; metric: {stats['metric']}"
    if any((stats["identical_pairs"] or {}).values()):
        same = stats["identical_pairs"]
        line += f"; {same['train']} train / {same.get('eval', 0)} eval pairs with chosen = rejected (kept)"
    if stats["over_seq_len"] is not None:
        over = stats["over_seq_len"]
        if over["train"] or over["eval"]:
            done = "dropped" if stats["too_long"] == "drop" else "truncated"
            line += (
                f"; over trainer.seq_len={stats['seq_len']}: {over['train']} train / {over['eval']} eval rows {done}"
            )
    return line


# --------------------------------------------------------------------------------------------------
# The prompt format generation reuses (prompts.PromptFormat)
# --------------------------------------------------------------------------------------------------


def prompt_format(train: Dataset, fmt: str, conversational: bool) -> dict[str, Any]:
    """How this data's prompts look, so a plain prompt typed after training can be wrapped the same way:
    `style` chat (with the `system` message every conversation starts with, if one), alpaca, or plain
    with the `prefix` and `suffix` every prompt/completion prompt shares (e.g. `order: ` and `\\n`)."""
    if fmt == "alpaca":
        return {"style": "alpaca"}
    if fmt == "text" or len(train) == 0:
        return {"style": "plain", "prefix": "", "suffix": ""}
    if fmt == "messages" or conversational:
        column = "messages" if fmt == "messages" else "prompt"
        systems = set()
        for batch in train.select_columns([column]).iter(batch_size=BATCH_ROWS):
            systems |= {m[0]["content"] if m and m[0]["role"] == "system" else None for m in batch[column]}
            if len(systems) > 1:
                break
        system = systems.pop() if len(systems) == 1 else None
        return {"style": "chat", "system": system}
    batches = (batch["prompt"] for batch in train.select_columns(["prompt"]).iter(batch_size=BATCH_ROWS))
    prefix, suffix = common_affixes(batches)
    return {"style": "plain", "prefix": prefix, "suffix": suffix}


def common_affixes(prompts: Iterable[str] | Iterable[list[str]]) -> tuple[str, str]:
    """The text every prompt starts with and ends with, cut back to a non-alphanumeric boundary (so a
    shared first letter of the content does not count); nothing from fewer than two prompts. `prompts`
    may come in batches (lists), so a large dataset's column is never held whole."""
    count, shortest, prefix, suffix = 0, None, None, None
    for batch in prompts:
        batch = [batch] if isinstance(batch, str) else batch
        if not batch:
            continue
        count += len(batch)
        low = min(len(p) for p in batch)
        shortest = low if shortest is None else min(shortest, low)
        prefix = os.path.commonprefix(batch + ([prefix] if prefix is not None else []))
        reversed_batch = [p[::-1] for p in batch] + ([suffix[::-1]] if suffix is not None else [])
        suffix = os.path.commonprefix(reversed_batch)[::-1]
    if count < 2:
        return "", ""
    if len(prefix) + len(suffix) > shortest:  # overlapping (a prompt is all template): keep the prefix
        suffix = suffix[len(prefix) + len(suffix) - shortest :]
    while prefix and prefix[-1].isalnum():
        prefix = prefix[:-1]
    while suffix and suffix[0].isalnum():
        suffix = suffix[1:]
    return prefix, suffix


# --------------------------------------------------------------------------------------------------
# Token counts, from the ids TRL trains on (tokens.py tokenizes each split once, as TRL 1.16 would)
# --------------------------------------------------------------------------------------------------


def _add_token_stats(
    stats: dict[str, Any],
    splits: dict[str, Dataset],
    conversational: bool,
    tokenizer: Any,
    data: DataConfig,
    limits: tuple[int, int] | None = None,
) -> dict[str, Dataset]:
    """Tokenize each split for TRL, fill the token figures of `stats`, drop the rows over seq_len under
    `too_long=drop`, and say in the log what TRL will truncate and drop; a UserError when a split would keep
    no trained token at all. `limits`: see _longer_hint. Returns the splits as
    training gets them."""
    fmt, seq_len, too_long = stats["format"], stats["seq_len"], stats["too_long"]
    packing = bool(data.packing)
    how = tokenization_for(tokenizer, fmt, conversational, data, stats["source"])
    tokenized, counts = {}, {}
    for k, ds in splits.items():
        ds = tokenize_split(ds, tokenizer, how, k, _where(stats, k))
        if callable(seq_len):  # trainer.seq_len=auto: from the train rows, the first split
            seq_len = stats["seq_len"] = seq_len(token_figures(ds)[0], stats["source"])
        counts[k] = _count(ds, seq_len)
        # DPOTrainer, KTOTrainer and GRPOTrainer tokenize the text themselves
        scratch = {
            "preference": (*SCRATCH, "input_ids"),
            "unpaired": (*SCRATCH, "input_ids", "completion_mask"),
            "prompt": (*SCRATCH, "input_ids"),
        }.get(fmt, SCRATCH)
        tokenized[k] = ds.remove_columns([c for c in scratch if c in ds.column_names])
        _report_prompt_left_out(k, counts[k])
    keys = ("train", "eval")
    if fmt == "prompt" and too_long == "truncate":  # a prompt cut short would sample something else
        too_long = stats["too_long"] = "drop"
        log.info(
            "prompt rows longer than trainer.seq_len are dropped: TRL's GRPOTrainer samples from every prompt whole"
        )
    stats["over_seq_len"] = {k: counts[k]["over"] if k in counts else 0 for k in keys}
    stats["max_tokens"] = {k: counts[k]["max_tokens"] if k in counts else 0 for k in keys}
    kept = dict(tokenized)
    if too_long == "drop":
        stats["dropped_too_long"] = {k: counts[k]["over"] if k in counts else 0 for k in keys}
        stats["truncated"] = {k: 0 for k in keys}
        stats["dropped_by_truncation"] = {k: 0 for k in keys}
        for k, c in counts.items():
            kept[k] = _drop_long(stats, k, tokenized[k], c, _longer_hint(stats, limits))
        return kept
    stats["dropped_too_long"] = {k: 0 for k in keys}
    stats["dropped_by_truncation"] = {k: (0 if packing or k not in counts else counts[k]["dropped"]) for k in keys}
    stats["truncated"] = {
        k: (counts[k]["over"] - stats["dropped_by_truncation"][k] if k in counts else 0) for k in keys
    }
    for k, c in counts.items():
        _report_truncation(stats, k, c, packing, _longer_hint(stats, limits))
    return kept


def _where(stats: dict[str, Any], k: str) -> str:
    return stats["source"] if k == "train" else stats["eval_source"]


def _drop_long(stats: dict[str, Any], k: str, ds: Dataset, c: dict[str, Any], longer: str) -> Dataset:
    """`ds` without its examples longer than seq_len tokens (data.too_long=drop)."""
    seq_len, n = stats["seq_len"], len(ds)
    if not c["over"]:
        log.info("all %d %s examples fit trainer.seq_len=%d tokens (longest %d)", n, k, seq_len, c["max_tokens"])
        return ds
    if c["over"] == n:
        raise UserError(
            f"trainer.seq_len: all {n} {k} examples of {_where(stats, k)} are longer than {seq_len} tokens "
            f"(shortest {int(c['lengths'].min())}) and data.too_long=drop drops them all; {longer}"
            + (" (prompts are never truncated)" if stats["format"] == "prompt" else " or use data.too_long=truncate")
        )
    log.warning(
        "%d of %d %s examples are longer than trainer.seq_len=%d tokens (longest %d) and are dropped "
        "(data.too_long=%s); %s to keep them",
        c["over"],
        n,
        k,
        seq_len,
        c["max_tokens"],
        "drop" if stats["format"] != "prompt" else "drop: prompts are never truncated",
        longer,
    )
    import numpy as np

    return ds.select(np.flatnonzero(c["lengths"] <= seq_len))


def _report_truncation(stats: dict[str, Any], k: str, c: dict[str, Any], packing: bool, longer: str) -> None:
    """Log how many `k` examples TRL truncates (and drops); a UserError when it would drop them all."""
    fmt, seq_len, n = stats["format"], stats["seq_len"], stats["rows"][k]
    trained = "assistant" if fmt == "messages" else "completion"
    dropped = stats["dropped_by_truncation"][k]
    if dropped == n:
        raise UserError(
            f"trainer.seq_len: at {seq_len} tokens no {k} example keeps a {trained} token after truncation "
            f"({_where(stats, k)}, longest {c['max_tokens']} tokens), "
            f"so there is nothing to train on; {longer}"
        )
    if not c["over"]:
        log.info("all %d %s examples fit trainer.seq_len=%d tokens (longest %d)", n, k, seq_len, c["max_tokens"])
        return
    what = "packed into" if packing else "truncated to"
    msg = (
        f"{c['over']} of {n} {k} examples are longer than trainer.seq_len={seq_len} tokens "
        f"(longest {c['max_tokens']}); TRL keeps their first {seq_len} tokens ({what} max_length)"
    )
    if dropped:
        msg += f"; {dropped} of them have no {trained} token left within {seq_len} tokens and TRL drops them"
    log.warning(msg + f"; {longer} to keep them whole, or data.too_long=drop to leave them out")


def _count(ds: Dataset, seq_len: int) -> dict[str, Any]:
    """Per-split token statistics: each example's length, how many TRL truncates to `seq_len`, how many of
    those it then drops (its first trained token at or past min(length, seq_len)), and the longest."""
    import numpy as np

    lengths, trained_from, left_out = token_figures(ds)
    dropped = int(np.count_nonzero(trained_from >= np.minimum(lengths, seq_len)))
    return {
        "over": int(np.count_nonzero(lengths > seq_len)),
        "dropped": dropped,
        "max_tokens": int(lengths.max()) if len(lengths) else 0,
        "lengths": lengths,
        "prompt_left_out": left_out,
        "rows": len(lengths),
    }


def _report_prompt_left_out(k: str, c: dict[str, Any]) -> None:
    """TRL's warning, once per split: a prompt whose tokens merge with the completion's (or that the chat
    template renders differently alone) has its end trained as completion."""
    if c["prompt_left_out"]:
        log.warning(
            "%d of %d %s examples: the tokenized prompt is not the start of the tokenized prompt+completion "
            "(tokens merge across the boundary, or the chat template renders the prompt differently); as TRL does, "
            "the completion starts where they diverge, so training sees a prompt unlike the one generation sees; "
            "end each prompt on a token boundary (e.g. a newline) to avoid it",
            c["prompt_left_out"],
            c["rows"],
            k,
        )
