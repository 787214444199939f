"""Prompts after training: read them from a file, stdin or a command line, and format them the way the run was trained.

    read_prompts(file) -> [Prompt]                           # a text file (one a line), JSON lines, or - (stdin)
    load_prompt_format(run_dir, style) -> PromptFormat       # how the run's data prompts looked (metrics.json)
    render(tokenizer, prompt, style_or_format) -> (text, add_special_tokens)

A plain prompt (a line someone typed) is rendered the way the run's data was: with the tokenizer's chat
template (and the generation prompt, after the system message every training conversation started with)
when the data was chat (`messages`, ShareGPT, or prompt/completion with message lists), inside the
Alpaca template for `alpaca` data, and for prompt/completion data between the prefix and suffix every
training prompt shared (`order: ` ... `\n` for the sample), unless it already carries them. A `formatted`
prompt (a data row's prompt, or `--raw`) goes in as it is. Generation, the merge's logit comparison and
the training metric all format prompts here.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from .runfiles import read_json

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


@dataclass
class Prompt:
    """kind: "text" (what a user typed: rendered per the run's style), "formatted" (already the exact
    prompt string, e.g. a data row's `prompt`) or "messages" (a list of {role, content}). images: the
    files an image row of a prompts file names (absolute paths), for a vision-language model."""

    kind: str
    value: Any
    images: list[str] = field(default_factory=list)

    def show(self) -> str:
        if self.kind == "messages":
            return " | ".join(f"{m['role']}: {_content_text(m['content'])}" for m in self.value).replace("\n", "\\n")
        return str(self.value).replace("\n", "\\n")


def _content_text(content: Any) -> str:
    """A turn's content as text: a part list's text parts in order, an image part as <image>."""
    if not isinstance(content, list):
        return str(content)
    return "".join("<image>" if p.get("type") == "image" else str(p.get("text") or "") for p in content)


@dataclass
class PromptFormat:
    """How a run's data prompts looked (load_splits' `prompt_format`, saved in the run's metrics.json):
    style "chat" (with the `system` message every conversation started with, if one), "alpaca", or
    "plain" (with the `prefix` and `suffix` every prompt/completion prompt shared)."""

    style: str = "plain"
    prefix: str = ""
    suffix: str = ""
    system: str | None = None

    @classmethod
    def of(cls, value: Any) -> PromptFormat:
        """A PromptFormat from itself, a `prompt_format` dict, or a bare style name."""
        if isinstance(value, PromptFormat):
            return value
        if isinstance(value, dict):
            return cls(
                style=str(value.get("style") or "plain"),
                prefix=str(value.get("prefix") or ""),
                suffix=str(value.get("suffix") or ""),
                system=value.get("system") or None,
            )
        return cls(style=str(value or "plain"))

    def wrap(self, text: str) -> str:
        """A plain prompt between the data's shared prefix and suffix, each added only where the text does
        not already carry it (`dcba` and `order: dcba\\n` both become `order: dcba\\n`)."""
        head = "" if text.startswith(self.prefix) else self.prefix
        tail = "" if text.endswith(self.suffix) else self.suffix
        return head + text + tail

    def messages(self, text: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": text}]


def recorded_prompt_format(run_dir: Path | None) -> dict | None:
    """The prompt format a run dir recorded (its metrics.json `data.prompt_format`); None when there is
    none (no run dir, or a run from before the format was recorded)."""
    path = Path(run_dir) / "metrics.json" if run_dir is not None else None
    if path is None or not path.is_file():
        return None
    data = read_json(path, "re-run training").get("data")
    recorded = data.get("prompt_format") if isinstance(data, dict) else None
    return recorded if isinstance(recorded, dict) else None


def load_prompt_format(run_dir: Path | None, style: str, recorded: dict | None = None) -> PromptFormat:
    """The prompt format of a run dir (`recorded`, else its metrics.json `data.prompt_format`), with
    `style` (the run's, or the one --chat / --no-chat forced); just the style when none is known."""
    if recorded is None:
        recorded = recorded_prompt_format(run_dir)
    fmt = PromptFormat.of(recorded or {"style": style})
    if fmt.style != style:  # forced: keep only what applies to the forced style
        fmt = PromptFormat(style=style, system=fmt.system if style == "chat" else None)
    return fmt


def unescape(text: str) -> str:
    r"""`\n`, `\t` and `\\` typed on a command line or in a prompts file become the characters."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def data_prompt(value: str | list) -> Prompt:
    """The prompt part of a training row as the data module gives it: a message list (conversational
    data) or the exact prompt string."""
    return Prompt("messages" if isinstance(value, list) else "formatted", value)


def _row_images(row: dict, where: str, base: Path | None) -> list[str]:
    """An image row's `images`: paths relative to the prompts file's folder (or absolute)."""
    images = row.get("images")
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise UserError(f"{where}: field 'images' must be a list of image file paths")
    return [str(base / i) if base is not None and not Path(i).expanduser().is_absolute() else i for i in images]


def _row_prompt(row: Any, where: str, base: Path | None = None) -> Prompt:
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
            turns = [{"role": m["role"], "content": m["content"]} for m in turns]
            return Prompt("messages", turns, _row_images(row, where, base))
        if isinstance(row.get("prompt"), list):
            return Prompt("messages", row["prompt"])
        if isinstance(row.get("prompt"), str):
            return Prompt("formatted", row["prompt"])
        if isinstance(row.get("instruction"), str):
            from .. import data  # (imports datasets: only when needed)

            return Prompt("formatted", data.alpaca_prompt(row["instruction"], row.get("input") or None))
        if isinstance(row.get("text"), str):
            return Prompt("formatted", row["text"])
    raise UserError(
        f"{where}: not a prompt; each JSON line must be a string or an object with prompt, messages, "
        "instruction or text"
    )


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a file (`-`: stdin): `.jsonl` / `.json` lines (strings, or rows in any training-data
    format: the prompt part is used), otherwise one prompt per non-empty line (with `\\n` escapes)."""
    raw = str(path)
    if raw == "-":
        return parse_prompts(sys.stdin.read(), "stdin", jsonl=False)
    path = Path(raw).expanduser()
    if not path.exists():
        raise UserError(f"prompts file {raw}: no such file; give a text file with one prompt per line")
    if not path.is_file():
        raise UserError(f"prompts file {raw}: not a file; give a text file with one prompt per line")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (UnicodeDecodeError, OSError) as err:
        raise UserError(f"prompts file {raw}: cannot be read as UTF-8 text ({err})") from None
    jsonl = path.suffix.lower() in (".jsonl", ".json")
    return parse_prompts(text, raw, jsonl=jsonl, base=path.resolve().parent)


def parse_prompts(text: str, raw: str, jsonl: bool, base: Path | None = None) -> list[Prompt]:
    """Prompts from the text of a prompts file (`raw` names it): JSON lines, or one prompt a line; an
    image row's images are read relative to `base` (the file's folder)."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise UserError(f"prompts file {raw}: empty, no prompts; put one prompt per line (or JSON lines with a prompt)")
    if jsonl:
        prompts = []
        for n, line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"prompts file {raw} line {n}: not valid JSON ({err.msg}); one JSON value per line"
                ) from None
            prompts.append(_row_prompt(row, f"prompts file {raw} line {n}", base))
        return prompts
    return [Prompt("text", unescape(line)) for _, line in lines]


def render(tokenizer, prompt: Prompt, style: str | PromptFormat | dict) -> tuple[str, bool]:
    """(the text to tokenize, whether the tokenizer should add its special tokens). `style` is the run's
    PromptFormat (or just its style name: chat, alpaca, plain)."""
    fmt = PromptFormat.of(style)
    if prompt.kind == "text":
        if fmt.style == "chat":
            prompt = Prompt("messages", fmt.messages(prompt.value))
        elif fmt.style == "alpaca":
            from ..data.formats import alpaca_prompt  # (imports datasets: only when needed)

            prompt = Prompt("formatted", alpaca_prompt(prompt.value))
        else:
            prompt = Prompt("formatted", fmt.wrap(prompt.value))
    if prompt.kind == "messages":
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "chat prompts need a tokenizer with a chat template, and this one has none; "
                "pass plain prompts (without --chat, or with --raw)"
            )
        text = tokenizer.apply_chat_template(prompt.value, tokenize=False, add_generation_prompt=True)
        return text, False  # the template writes the special tokens itself
    return prompt.value, True
