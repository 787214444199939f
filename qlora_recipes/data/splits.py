"""`load_splits`: read `data.path` (and `data.eval_path`), convert every row to the columns TRL's
`SFTTrainer` takes as they are, hold out a seeded eval split, and count tokens the way TRL will.

Nothing is dropped here; TRL truncates to `trainer.seq_len` (`max_length`) itself, and the counts say
how many examples that touches (and how many TRL then drops for having no trained token left) so the
log says so, and a run where nothing would be left to train on stops before it starts.
"""

from __future__ import annotations

import logging
from typing import Any

from datasets import Dataset

from ..errors import UserError
from ..units import cfg_get
from .chat import chat_template_for
from .formats import check_format_name, convert, detect
from .readers import read_source

log = logging.getLogger(__name__)


def load_splits(data_cfg: Any, tokenizer: Any, seq_len: int, seed: int) -> tuple[Dataset, Dataset | None, dict]:
    """Load `data_cfg.path` (and `data_cfg.eval_path`), validate every row and return
    `(train, eval_or_None, stats)`.

    The datasets have the columns TRL's SFTTrainer reads: `prompt`+`completion` (alpaca and
    prompt_completion; strings, or message lists for a conversational prompt_completion), `messages`,
    or `text`. Without `eval_path`, a seeded `eval_fraction` of the rows is held out (None when 0).

    stats: `format`, `conversational`, `source`, `eval_source`, `rows` ({train, eval}), `seq_len`,
    `over_seq_len` ({train, eval}: examples longer than seq_len tokens, which TRL truncates),
    `dropped_by_truncation` ({train, eval}: of those, examples with no trained token in the first
    seq_len, which TRL 1.16 removes; 0 under packing) and `max_tokens` ({train, eval}). The token
    figures are None when `tokenizer` is None.
    """
    configured = check_format_name(cfg_get(data_cfg, "format", "auto"))
    split = cfg_get(data_cfg, "split", "train") or "train"
    eval_path = cfg_get(data_cfg, "eval_path")
    eval_fraction = _eval_fraction(cfg_get(data_cfg, "eval_fraction", 0.0))
    if not isinstance(seq_len, int) or seq_len < 1:
        raise UserError(f"trainer.seq_len: {seq_len!r} must be a positive number of tokens")

    fmt, columns, conversational, source = _load(cfg_get(data_cfg, "path"), split, "data.path", configured)
    train = Dataset.from_dict(columns)
    eval_ds = None
    eval_source = None
    if eval_path not in (None, ""):
        eval_ds, eval_source = _eval_file(eval_path, split, configured, fmt, conversational)
        if eval_fraction:
            log.info("data.eval_path is set, so data.eval_fraction=%s is not used", eval_fraction)
    elif eval_fraction > 0:
        train, eval_ds, eval_source = _hold_out(train, eval_fraction, source, seed)

    stats: dict[str, Any] = {
        "format": fmt,
        "conversational": fmt == "messages" or conversational,
        "source": source,
        "eval_source": eval_source,
        "rows": {"train": len(train), "eval": len(eval_ds) if eval_ds is not None else 0},
        "seq_len": seq_len,
        "over_seq_len": None,
        "dropped_by_truncation": None,
        "max_tokens": None,
    }
    if tokenizer is not None:
        splits = {"train": train} if eval_ds is None else {"train": train, "eval": eval_ds}
        _add_token_stats(stats, splits, conversational, tokenizer, data_cfg)
    log.info(
        "data: %s format, %d train rows from %s; eval: %s",
        fmt,
        stats["rows"]["train"],
        source,
        f"{stats['rows']['eval']} rows from {eval_source}" if eval_ds is not None else "none",
    )
    return train, eval_ds, stats


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


def _load(spec: Any, split: str, field: str, fmt: str) -> tuple[str, dict[str, list], bool, str]:
    rows, source = read_source(spec, split, field)
    detected = detect(rows) if fmt == "auto" else fmt
    columns, conversational = convert(rows, detected)
    return detected, columns, conversational, source


def _eval_file(eval_path: Any, split: str, configured: str, fmt: str, conversational: bool) -> tuple[Dataset, str]:
    """The eval set from `data.eval_path`, which must be in the train data's format."""
    eval_fmt, eval_columns, eval_conv, eval_source = _load(eval_path, split, "data.eval_path", configured)
    if eval_fmt != fmt or eval_conv != conversational:
        kind = lambda f, c: f + (" (chat messages)" if c else "")  # noqa: E731
        raise UserError(
            f"data.eval_path: {eval_source} is in format {kind(eval_fmt, eval_conv)} but data.path is "
            f"{kind(fmt, conversational)}; give both files the same fields"
        )
    return Dataset.from_dict(eval_columns), eval_source


def _hold_out(train: Dataset, eval_fraction: float, source: str, seed: int) -> tuple[Dataset, Dataset, str]:
    """A seeded `eval_fraction` of the train rows as the eval set; both keep the file's row order."""
    import numpy as np

    n = len(train)
    n_eval = max(1, int(round(n * eval_fraction)))
    if n_eval >= n:
        raise UserError(
            f"data.eval_fraction: {eval_fraction} of {n} rows in {source} leaves no rows to train on; "
            "add rows, lower data.eval_fraction, or pass data.eval_path"
        )
    order = np.random.default_rng(seed).permutation(n)
    eval_idx, train_idx = sorted(order[:n_eval].tolist()), sorted(order[n_eval:].tolist())
    return train.select(train_idx), train.select(eval_idx), f"{eval_fraction:g} of {source} (seed {seed})"


# --------------------------------------------------------------------------------------------------
# Token counts (the same tokenization TRL 1.16's SFTTrainer._prepare_dataset does)
# --------------------------------------------------------------------------------------------------


def _add_token_stats(
    stats: dict[str, Any], splits: dict[str, Dataset], conversational: bool, tokenizer: Any, data_cfg: Any
) -> None:
    """Fill `over_seq_len`, `dropped_by_truncation` and `max_tokens`, and say in the log what TRL will
    truncate and drop; a UserError when a split would keep no trained token at all."""
    fmt, seq_len = stats["format"], stats["seq_len"]
    completion_only = bool(cfg_get(data_cfg, "completion_only_loss", True))
    packing = bool(cfg_get(data_cfg, "packing", False))
    chat_template = chat_template_for(tokenizer, fmt, conversational, completion_only, stats["source"])
    trained_only = completion_only and fmt != "text"
    counts = {
        k: _count(ds, fmt, conversational, tokenizer, chat_template, trained_only, seq_len) for k, ds in splits.items()
    }
    stats["over_seq_len"] = {k: counts[k]["over"] if k in counts else 0 for k in ("train", "eval")}
    stats["dropped_by_truncation"] = {
        k: (0 if packing or k not in counts else counts[k]["dropped"]) for k in ("train", "eval")
    }
    stats["max_tokens"] = {k: counts[k]["max_tokens"] if k in counts else 0 for k in ("train", "eval")}
    for k, c in counts.items():
        _report_truncation(stats, k, c, packing)


def _report_truncation(stats: dict[str, Any], k: str, c: dict[str, int], packing: bool) -> None:
    """Log how many `k` examples TRL truncates (and drops); a UserError when it would drop them all."""
    fmt, seq_len, n = stats["format"], stats["seq_len"], stats["rows"][k]
    trained = "assistant" if fmt == "messages" else "completion"
    dropped = stats["dropped_by_truncation"][k]
    if dropped == n:
        raise UserError(
            f"trainer.seq_len: at {seq_len} tokens no {k} example keeps a {trained} token after truncation "
            f"({stats['source'] if k == 'train' else stats['eval_source']}, longest {c['max_tokens']} tokens), "
            "so there is nothing to train on; raise trainer.seq_len"
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
    log.warning(msg + "; raise trainer.seq_len to keep them whole")


def _count(
    ds: Dataset,
    fmt: str,
    conversational: bool,
    tokenizer: Any,
    chat_template: str | None,
    completion_only: bool,
    seq_len: int,
) -> dict[str, int]:
    """Per-split token statistics: how many examples TRL truncates to `seq_len`, how many of those it then
    drops (every trained token beyond `seq_len`), and the longest example."""
    lengths: list[int] = []
    first_trained: list[int] = []  # index of the first token with a label (TRL drops rows where it's >= seq_len)
    eos = tokenizer.eos_token or ""

    def with_eos(text: str) -> str:
        return text if not eos or text.endswith(eos) else text + eos

    step = 512
    for start in range(0, len(ds), step):
        batch = ds[start : start + step]
        if fmt == "text":
            ids = tokenizer([with_eos(t) for t in batch["text"]])["input_ids"]
            lengths += [len(x) for x in ids]
            first_trained += [0] * len(ids)
        elif fmt == "messages":
            out = tokenizer.apply_chat_template(
                batch["messages"],
                tokenize=True,
                return_dict=True,
                chat_template=chat_template,
                return_assistant_tokens_mask=completion_only,
            )
            lengths += [len(x) for x in out["input_ids"]]
            if completion_only:
                first_trained += [m.index(1) if 1 in m else len(m) for m in out["assistant_masks"]]
            else:
                first_trained += [0] * len(out["input_ids"])
        else:
            if conversational:
                prompt_ids = tokenizer.apply_chat_template(
                    batch["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True
                )["input_ids"]
                full_ids = tokenizer.apply_chat_template(
                    [p + c for p, c in zip(batch["prompt"], batch["completion"], strict=True)],
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            else:
                prompt_ids = tokenizer(batch["prompt"])["input_ids"]
                full_ids = tokenizer(
                    [p + with_eos(c) for p, c in zip(batch["prompt"], batch["completion"], strict=True)]
                )["input_ids"]
            for p, f in zip(prompt_ids, full_ids, strict=True):
                common = 0
                for a, b in zip(p, f, strict=False):
                    if a != b:
                        break
                    common += 1
                lengths.append(len(f))
                first_trained.append(common if completion_only else 0)
    over = sum(1 for n in lengths if n > seq_len)
    dropped = sum(1 for n, k in zip(lengths, first_trained, strict=True) if k >= min(n, seq_len))
    return {"over": over, "dropped": dropped, "max_tokens": max(lengths, default=0)}
