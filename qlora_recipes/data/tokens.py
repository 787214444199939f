"""Tokenize once: each split as TRL 1.16's `SFTTrainer._prepare_dataset` tokenizes it, done here so the
token counts come from the very ids TRL trains on and TRL does not tokenize again.

The rows keep their columns and gain TRL's: `input_ids`, plus `completion_mask` (prompt/completion: the
tokens after the prompt, where the tokenized prompt and prompt+completion diverge, `common_prefix_length`)
or `assistant_masks` (messages under assistant-only loss: the chat template's `{% generation %}` spans).
Non-chat text gets the EOS TRL's `add_eos` adds; chat data is rendered with the template TRL would pick.
TRL treats a dataset with `input_ids` as processed: the labels from those masks, truncation to max_length,
rows left with no trained token dropped and packing follow as TRL does them (for SFT rows not packed,
run/sft_rows.py does the first three in one vectorized pass and TRL skips its own).

datasets' progress bars are off (they drowned the training bar), except one while a split of more than
`PROGRESS_ROWS` rows is tokenized. The environment's HF_DATASETS_DISABLE_PROGRESS_BARS, when set, decides.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from ..config.schema import DataConfig
from ..console import library_bars_on
from ..errors import UserError
from .chat import chat_template_for
from .formats import format_kwargs
from .readers import BATCH_ROWS

# Splits larger than this show a progress bar while they are tokenized; smaller ones stay quiet.
PROGRESS_ROWS = 10_000
# Per-row figures the counts read, removed before training.
SCRATCH = ("trained_from", "prompt_left_out")


@dataclass(frozen=True)
class Tokenization:
    """What TRL's tokenization depends on: the format, the loss flags SFTConfig gets (format_kwargs) and
    the chat template TRL renders with (None: the tokenizer's own)."""

    fmt: str
    conversational: bool
    chat_template: str | None
    completion_only: bool
    assistant_only: bool


def tokenization_for(tokenizer: Any, fmt: str, conversational: bool, data: DataConfig, where: str) -> Tokenization:
    flags = format_kwargs(data, fmt)
    assistant_only = bool(flags["assistant_only_loss"])
    template = chat_template_for(tokenizer, fmt, conversational, assistant_only, where)
    return Tokenization(fmt, conversational, template, bool(flags["completion_only_loss"]), assistant_only)


def tokenize_split(ds: Any, tokenizer: Any, how: Tokenization, split: str, where: str) -> Any:
    """`ds` with TRL's token columns and the scratch columns `token_figures` reads."""
    with _progress_shown(len(ds) > PROGRESS_ROWS):
        return ds.map(
            _tokenize_batch,
            batched=True,
            batch_size=BATCH_ROWS,
            with_indices=True,
            fn_kwargs={"tokenizer": tokenizer, "how": how, "where": f"{where}: {split} example"},
            desc=f"tokenizing {split} ({len(ds)} rows)",
        )


def token_figures(ds: Any) -> tuple[Any, Any, int]:
    """(each example's token count, the index of its first trained token, how many examples lose the end of
    their prompt) from a `tokenize_split` result, read through Arrow so no token list becomes Python."""
    import numpy as np
    import pyarrow.compute as pc

    lengths, trained_from, left_out = [], [], 0
    columns = [c for c in ("input_ids", *SCRATCH) if c in ds.column_names]
    for table in ds.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS):
        lengths.append(pc.list_value_length(table["input_ids"]).to_numpy())
        trained_from.append(table["trained_from"].to_numpy())
        if "prompt_left_out" in table.column_names:
            left_out += int(pc.sum(pc.greater(table["prompt_left_out"], 0)).as_py() or 0)
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
    return join(lengths), join(trained_from), left_out


def _with_eos(text: str, eos: str | None) -> str:
    return text if not eos or text.endswith(eos) else text + eos  # TRL's add_eos


def _tokenize_batch(batch: dict, indices: list[int], tokenizer: Any, how: Tokenization, where: str) -> dict:
    """TRL's tokenize_fn over a batch (the same tokenizer calls, batched), plus the scratch figures."""
    chat = {"tokenize": True, "return_dict": True, "chat_template": how.chat_template}
    if how.fmt == "text":
        out = {"input_ids": tokenizer(text=[_with_eos(t, tokenizer.eos_token) for t in batch["text"]])["input_ids"]}
    elif how.fmt == "preference":
        out = _preference(batch, tokenizer, how, chat)
    elif how.fmt == "prompt":
        return _prompt_only(batch, tokenizer, how, chat)
    elif how.fmt == "messages":
        done = tokenizer.apply_chat_template(batch["messages"], return_assistant_tokens_mask=how.assistant_only, **chat)
        out = {k: done[k] for k in ("input_ids", "assistant_masks") if k in done}
    else:
        out = _prompt_completion(batch, tokenizer, how, chat)
    if how.fmt == "preference":
        return out
    masks = [out["assistant_masks"]] if "assistant_masks" in out else []
    if how.completion_only and "completion_mask" in out:
        masks.append(out["completion_mask"])  # TRL applies completion_mask only under completion_only_loss
    out["trained_from"] = [_first_trained(ids, [m[i] for m in masks]) for i, ids in enumerate(out["input_ids"])]
    for i, mask in enumerate(out.get("assistant_masks", [])):
        if 1 not in mask:  # TRL raises a RuntimeError here
            raise UserError(
                f"{where} {indices[i]}: no token of its assistant turns is inside the chat template's "
                "{% generation %} markers, so assistant-only loss has nothing to train; fix the template's markers, "
                "or set data.completion_only_loss=false"
            )
    return out


def _prompt_completion(batch: dict, tokenizer: Any, how: Tokenization, chat: dict) -> dict:
    """TRL's prompt/completion case: the completion starts where the tokenized prompt and prompt+completion
    diverge (`common_prefix_length`), usually right after the prompt."""
    from trl.data_utils import common_prefix_length

    prompts, completions = batch["prompt"], batch["completion"]
    out: dict[str, list] = {}
    if how.conversational:
        prompt_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, **chat)["input_ids"]
        both = [p + c for p, c in zip(prompts, completions, strict=True)]
        done = tokenizer.apply_chat_template(both, return_assistant_tokens_mask=how.assistant_only, **chat)
        full_ids = done["input_ids"]
        if "assistant_masks" in done:
            out["assistant_masks"] = done["assistant_masks"]
    else:
        eos = tokenizer.eos_token
        prompt_ids = tokenizer(text=prompts)["input_ids"]
        full_ids = tokenizer(text=[p + _with_eos(c, eos) for p, c in zip(prompts, completions, strict=True)])
        full_ids = full_ids["input_ids"]
    starts = [common_prefix_length(p, f) for p, f in zip(prompt_ids, full_ids, strict=True)]
    out["input_ids"] = full_ids
    out["completion_mask"] = [[0] * s + [1] * (len(f) - s) for s, f in zip(starts, full_ids, strict=True)]
    out["prompt_left_out"] = [len(p) - s for p, s in zip(prompt_ids, starts, strict=True)]
    return out


def _preference(batch: dict, tokenizer: Any, how: Tokenization, chat: dict) -> dict:
    """TRL 1.16 DPOTrainer's tokenize_fn, for the counts only (DPOTrainer tokenizes the text itself):
    prompt+chosen and prompt+rejected (EOS added to plain-text answers), the answers starting where both
    diverge from the tokenized prompt. `input_ids` is the longer of the two sequences, `trained_from` that
    start: the collator truncates each sequence to max_length and TRL drops a pair whose prompt fills it."""
    from trl.data_utils import common_prefix_length

    prompts = batch["prompt"]
    if how.conversational:
        prompt_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, **chat)["input_ids"]
        full = {
            k: tokenizer.apply_chat_template([p + a for p, a in zip(prompts, batch[k], strict=True)], **chat)[
                "input_ids"
            ]
            for k in ("chosen", "rejected")
        }
    else:
        eos = tokenizer.eos_token
        full = {
            k: tokenizer(text=[p + _with_eos(a, eos) for p, a in zip(prompts, batch[k], strict=True)])["input_ids"]
            for k in ("chosen", "rejected")
        }
        prompt_ids = tokenizer(text=prompts)["input_ids"]
    rows = zip(prompt_ids, full["chosen"], full["rejected"], strict=True)
    starts = [min(common_prefix_length(p, c), common_prefix_length(p, r)) for p, c, r in rows]
    longer = [max(c, r, key=len) for c, r in zip(full["chosen"], full["rejected"], strict=True)]
    left_out = [len(p) - s for p, s in zip(prompt_ids, starts, strict=True)]
    return {"input_ids": longer, "prompt_left_out": left_out, "trained_from": starts}


def _prompt_only(batch: dict, tokenizer: Any, how: Tokenization, chat: dict) -> dict:
    """grpo's prompts as TRL 1.16 GRPOTrainer tokenizes them (chat: with the generation prompt), for the
    counts only: the completions are sampled in training, after the prompt."""
    if how.conversational:
        ids = tokenizer.apply_chat_template(batch["prompt"], add_generation_prompt=True, **chat)["input_ids"]
    else:
        ids = tokenizer(text=batch["prompt"])["input_ids"]
    # trained_from 0: every prompt gets its sampled completions (TRL truncates no prompt), none is dropped
    return {"input_ids": ids, "prompt_left_out": [0] * len(ids), "trained_from": [0] * len(ids)}


def _first_trained(ids: list[int], masks: list[list[int]]) -> int:
    """The first position every applied mask trains (TRL's labels keep a token only there); len(ids) if none."""
    if not masks:
        return 0
    return next((i for i, bits in enumerate(zip(*masks, strict=True)) if all(bits)), len(ids))


def quiet_datasets() -> None:
    """datasets' progress bars off (TRL's label, truncation and packing passes among them), unless the
    environment's HF_DATASETS_DISABLE_PROGRESS_BARS says otherwise."""
    import datasets.config
    from datasets.utils import disable_progress_bars

    if datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is None:
        disable_progress_bars()


def _progress_shown(show: bool):
    """datasets' progress bars on for the block when `show` (and the environment leaves it to us)."""
    if not show:
        return contextlib.nullcontext()
    import datasets.config
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    env_decides = datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None
    return library_bars_on(env_decides, are_progress_bars_disabled, enable_progress_bars, disable_progress_bars)
