"""Generate from a finished run (its 4-bit base + adapter, as trained) or from a merged model.

    load_for_generation(path) -> (model, tokenizer, info)   # info: kind, style, max_new_tokens
    generate(model, tokenizer, prompts, style, max_new_tokens, temperature=None) -> [str]

The one generation loop of the package: scripts/generate.py and the training metric (exact match of
greedy generations) both call `generate`. Prompts are formatted by `prompts.render`, the way the run's
data was; a merged dir carries the style in its merge_report.json; without one, prompts go in as they
are (`--chat` forces the template).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UserError
from .prompts import Prompt, render
from .runs import (
    MERGE_REPORT,
    check_adapter_base,
    load_run_config,
    load_stack,
    resolve_dir,
    run_prompt_style,
    run_tokenizer,
)

DEFAULT_MAX_NEW_TOKENS = 64


def _load_merged(folder: Path) -> tuple[Any, Any, str, int]:
    """A merged dir with plain transformers: (model, tokenizer, prompt style, max_new_tokens), the
    last two from its merge_report.json when there is one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report: dict = {}
    if (folder / MERGE_REPORT).is_file():
        try:
            report = json.loads((folder / MERGE_REPORT).read_text())
        except (json.JSONDecodeError, OSError):
            report = {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        kwargs: dict[str, Any] = {"dtype": "auto"}
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto"
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{folder}: the merged model could not be loaded ({first}); merge the run again") from None
    model.eval()
    return model, tokenizer, report.get("prompt_style", "plain"), report.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS


def load_for_generation(path: str | Path, chat: bool | None = None) -> tuple[Any, Any, dict]:
    """A run dir: its base loaded as the run loaded it (quantized) + the adapter. A merged dir: the
    standalone model with plain transformers. info: kind, dir, style, max_new_tokens."""
    kind, folder = resolve_dir(path, allow_merged=True)  # bad input answers before the heavy imports
    cfg = load_run_config(folder) if kind == "run" else None
    if cfg is not None:
        check_adapter_base(cfg, folder)
        tokenizer = run_tokenizer(cfg, folder)
        model = load_stack(cfg, folder)
        style = run_prompt_style(folder, cfg)
        max_new = cfg.data.max_new_tokens
    else:
        model, tokenizer, style, max_new = _load_merged(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat is not None:
        style = "chat" if chat else ("plain" if style == "chat" else style)
    return model, tokenizer, {"kind": kind, "dir": str(folder), "style": style, "max_new_tokens": max_new}


def generate(
    model,
    tokenizer,
    prompts: list[Prompt],
    style: str,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float = 1.0,
    batch_size: int = 1,
    max_batch_tokens: int | None = None,
) -> list[str]:
    """One completion per prompt (greedy unless `temperature` is given), without the prompt.

    Prompts go `batch_size` at a time, left-padded (generation continues on the right); a batch is
    tokenized with the special-token choice of its first prompt (a batch holds one data format).
    With `max_batch_tokens`, a batch also holds at most that many positions (prompts padded to the
    longest, plus max_new_tokens each), so its KV cache and prefill are bounded whatever the prompt
    lengths (the memory planner counts that bound); a longer prompt goes alone."""
    import torch

    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature else {"do_sample": False}
    outputs: list[str] = []
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        texts = [render(tokenizer, prompt, style) for prompt in prompts]
        for rendered in _batches(tokenizer, texts, batch_size, max_batch_tokens, max_new_tokens):
            batch = tokenizer(
                [text for text, _ in rendered], return_tensors="pt", padding=True, add_special_tokens=rendered[0][1]
            )
            batch = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
            with torch.no_grad():
                out = model.generate(
                    **batch,
                    max_new_tokens=max_new_tokens,
                    use_cache=True,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
            outputs += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return outputs


def _batches(tokenizer, rendered: list, size: int, max_tokens: int | None, new: int) -> list[list]:
    """Consecutive rendered prompts, `size` at a time and, with `max_tokens`, no more than keep
    len(batch) * (longest prompt + new) <= max_tokens."""
    if not max_tokens:
        return [rendered[i : i + size] for i in range(0, len(rendered), size)]
    out: list[list] = []
    longest = 0
    for text, special in rendered:
        n = len(tokenizer(text, add_special_tokens=special)["input_ids"])
        grown = max(longest, n)
        if out and len(out[-1]) < size and (len(out[-1]) + 1) * (grown + new) <= max_tokens:
            out[-1].append((text, special))
            longest = grown
        else:
            out.append([(text, special)])
            longest = n
    return out
