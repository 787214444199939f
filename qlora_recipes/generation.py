"""Generate from a finished run (its 4-bit base + adapter, as trained) or from a merged model.

    load_for_generation(path) -> (model, tokenizer, info)   # info: kind, style, max_new_tokens
    read_prompts(file) -> [Prompt]                           # a text file (one a line) or JSON lines
    render(tokenizer, prompt, style) -> (text, add_special_tokens)
    generate(model, tokenizer, prompts, style, max_new_tokens, temperature=None) -> [str]

Prompts are rendered the way the run's data was: with the tokenizer's chat template (and the
generation prompt) when the data was chat (`messages`, or prompt/completion with message lists),
inside the Alpaca template for `alpaca` data, as they are otherwise. A merged dir carries the style
in its merge_report.json; without one, prompts go in as they are (`--chat` forces the template).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError
from .merge import REPORT, check_adapter_base, load_run_config, load_stack, resolve_dir, run_prompt_style

log = logging.getLogger(__name__)

STYLES = ("plain", "alpaca", "chat")
DEFAULT_MAX_NEW_TOKENS = 64
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


@dataclass
class Prompt:
    """kind: "text" (what a user typed: rendered per the run's style), "formatted" (already the exact
    prompt string, e.g. a data row's `prompt`) or "messages" (a list of {role, content})."""

    kind: str
    value: Any

    def show(self) -> str:
        if self.kind == "messages":
            return " | ".join(f"{m['role']}: {m['content']}" for m in self.value).replace("\n", "\\n")
        return str(self.value).replace("\n", "\\n")


def unescape(text: str) -> str:
    r"""`\n`, `\t` and `\\` typed on a command line or in a prompts file become the characters."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def _row_prompt(row: Any, where: str) -> Prompt:
    if isinstance(row, str):
        return Prompt("text", row)
    if isinstance(row, dict):
        if isinstance(row.get("messages"), list):
            messages = row["messages"]
            last = max(
                (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                default=None,
            )
            turns = messages[:last] if last is not None and last > 0 else messages
            return Prompt("messages", [{"role": m["role"], "content": m["content"]} for m in turns])
        if isinstance(row.get("prompt"), list):
            return Prompt("messages", row["prompt"])
        if isinstance(row.get("prompt"), str):
            return Prompt("formatted", row["prompt"])
        if isinstance(row.get("instruction"), str):
            from .data import alpaca_prompt  # (imports datasets: only when needed)

            return Prompt("formatted", alpaca_prompt(row["instruction"], row.get("input") or None))
        if isinstance(row.get("text"), str):
            return Prompt("formatted", row["text"])
    raise UserError(
        f"{where}: not a prompt; each JSON line must be a string or an object with prompt, messages, "
        "instruction or text"
    )


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a file: `.jsonl` / `.json` lines (strings, or rows in any training-data format:
    the prompt part is used), otherwise one prompt per non-empty line (with `\\n` escapes)."""
    raw = str(path)
    path = Path(raw).expanduser()
    if not path.exists():
        raise UserError(f"prompts file {raw}: no such file; give a text file with one prompt per line")
    if not path.is_file():
        raise UserError(f"prompts file {raw}: not a file; give a text file with one prompt per line")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (UnicodeDecodeError, OSError) as err:
        raise UserError(f"prompts file {raw}: cannot be read as UTF-8 text ({err})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise UserError(f"prompts file {raw}: empty, no prompts; put one prompt per line (or JSON lines with a prompt)")
    if path.suffix.lower() in (".jsonl", ".json"):
        prompts = []
        for n, line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"prompts file {raw} line {n}: not valid JSON ({err.msg}); one JSON value per line"
                ) from None
            prompts.append(_row_prompt(row, f"prompts file {raw} line {n}"))
        return prompts
    return [Prompt("text", unescape(line)) for _, line in lines]


def render(tokenizer, prompt: Prompt, style: str) -> tuple[str, bool]:
    """(the text to tokenize, whether the tokenizer should add its special tokens)."""
    if prompt.kind == "text":
        if style == "chat":
            prompt = Prompt("messages", [{"role": "user", "content": prompt.value}])
        elif style == "alpaca":
            from .data import alpaca_prompt  # (imports datasets: only when needed)

            prompt = Prompt("formatted", alpaca_prompt(prompt.value))
        else:
            prompt = Prompt("formatted", prompt.value)
    if prompt.kind == "messages":
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "chat prompts need a tokenizer with a chat template, and this one has none; "
                "pass plain prompts (without --chat)"
            )
        text = tokenizer.apply_chat_template(prompt.value, tokenize=False, add_generation_prompt=True)
        return text, False  # the template writes the special tokens itself
    return prompt.value, True


def load_for_generation(path: str | Path, chat: bool | None = None) -> tuple[Any, Any, dict]:
    """A run dir: its base loaded as the run loaded it (quantized) + the adapter. A merged dir: the
    standalone model with plain transformers. info: kind, dir, style, max_new_tokens."""
    kind, folder = resolve_dir(path, allow_merged=True)  # bad input answers before the heavy imports
    cfg = load_run_config(folder) if kind == "run" else None
    if cfg is not None:
        check_adapter_base(cfg, folder)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import modeling

    if cfg is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder / "adapter"))
        except (OSError, ValueError):
            tokenizer = modeling.load_tokenizer(cfg)
        model = load_stack(cfg, folder)
        style = run_prompt_style(folder, cfg)
        max_new = cfg.data.max_new_tokens
    else:
        report: dict = {}
        if (folder / REPORT).is_file():
            try:
                report = json.loads((folder / REPORT).read_text())
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
        style = report.get("prompt_style", "plain")
        max_new = report.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
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
) -> list[str]:
    """One completion per prompt (greedy unless `temperature` is given), without the prompt."""
    import torch

    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    outputs = []
    for prompt in prompts:
        text, special = render(tokenizer, prompt, style)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=special)
        ids = {k: v.to(device) for k, v in ids.items() if k in ("input_ids", "attention_mask")}
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature else {"do_sample": False}
        )
        with torch.no_grad():
            out = model.generate(
                **ids,
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
        outputs.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return outputs
