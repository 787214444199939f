"""Training data: load, validate and shape it into datasets TRL's `SFTTrainer` takes as they are.

`readers` turns a source (`data.path`, `data.eval_path`: a local file, a dataset dir or a hub name) into
raw rows; `formats` detects and checks the format and converts each row (alpaca, messages, ShareGPT,
prompt_completion, text); `chat` picks the chat template chat data is trained with (`data.chat_template`:
the tokenizer's own, a built-in, or a file); `tokens` tokenizes each split once, as TRL's SFTTrainer
would, so TRL trains on those ids without tokenizing again; `splits` ties them together in `load_splits`
(eval split, token counts, rows over `trainer.seq_len` truncated or dropped, the prompt format generation
reuses).
Every bad row or source stops the run with one line naming the file, the row and the field.

The names below load on first use: `qlora_recipes.data.chat` (which validate.py reads) stays light,
`datasets` is imported only when rows are.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ALPACA_PROMPT_INPUT": "formats",
    "ALPACA_PROMPT_NO_INPUT": "formats",
    "FORMATS": "formats",
    "alpaca_prompt": "formats",
    "format_kwargs": "formats",
    "generation_pairs": "formats",
    "load_splits": "splits",
    "BUILTIN_TEMPLATES": "chat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
