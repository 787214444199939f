"""Prompts after training: read them from a file or a command line, and format them the way the run was trained.

    read_prompts(file) -> [Prompt]                           # a text file (one a line) or JSON lines
    render(tokenizer, prompt, style) -> (text, add_special_tokens)

A prompt is rendered the way the run's data was: with the tokenizer's chat template (and the
generation prompt) when the data was chat (`messages`, or prompt/completion with message lists),
inside the Alpaca template for `alpaca` data, as it is otherwise. Generation, the merge's logit
comparison and the training metric all format prompts here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError

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


def data_prompt(value: str | list) -> Prompt:
    """The prompt part of a training row as the data module gives it: a message list (conversational
    data) or the exact prompt string."""
    return Prompt("messages" if isinstance(value, list) else "formatted", value)


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
            from . import data  # (imports datasets: only when needed)

            return Prompt("formatted", data.alpaca_prompt(row["instruction"], row.get("input") or None))
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
            from . import data  # (imports datasets: only when needed)

            prompt = Prompt("formatted", data.alpaca_prompt(prompt.value))
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
