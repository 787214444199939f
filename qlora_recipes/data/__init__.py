"""Training data: load, validate and shape it into datasets TRL's `SFTTrainer` takes as they are.

`readers` turns a source (`data.path`, `data.eval_path`: a local file, a dataset dir or a hub name) into
raw rows; `formats` detects and checks the format and converts each row (alpaca, messages,
prompt_completion, text); `chat` picks the chat template messages are trained with; `splits` ties them
together in `load_splits` (eval split, token counts). Every bad row or source stops the run with one
line naming the file, the row and the field.
"""

from .formats import (
    ALPACA_PROMPT_INPUT,
    ALPACA_PROMPT_NO_INPUT,
    FORMATS,
    alpaca_prompt,
    format_kwargs,
    generation_pairs,
)
from .splits import load_splits

__all__ = [
    "ALPACA_PROMPT_INPUT",
    "ALPACA_PROMPT_NO_INPUT",
    "FORMATS",
    "alpaca_prompt",
    "generation_pairs",
    "load_splits",
    "format_kwargs",
]
