"""Progress of the merge on stderr: decoder layers merged and shards written, with tqdm.

    with MergeProgress(model) as progress:
        for name, tensor in tensors:
            progress.tensor(name)           # a new decoder layer's first tensor: the one before is done
            ...
            progress.shards(len(writer.files))

On a terminal: a bar, redrawn at most twice a second. Piped into a log (not a TTY): a plain line at
most every LOG_INTERVAL seconds and a final one, never carriage returns, so a log shows where a long
merge is. TQDM_DISABLE=1 turns it off (tqdm reads its TQDM_* variables itself).
"""

from __future__ import annotations

import re
import sys

LOG_INTERVAL = 30.0  # seconds between progress lines in a log
LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit}s [{elapsed}<{remaining}]{postfix}"
LAYER_LISTS = ("layers", "h", "blocks", "layer")  # the decoder layers' ModuleList in transformers' models


class _Lines:
    """A stream for tqdm that turns each redraw ('\\r' + text) into a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def decoder_layers(model) -> tuple[str | None, int]:
    """(the decoder layers' module name, e.g. "model.layers", their count) of a peft stack's base model;
    (None, 0) for a model without such a list."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    wanted = getattr(config, "num_hidden_layers", None)
    lists = [
        (name, len(m))
        for name, m in base.named_modules()
        if isinstance(m, torch.nn.ModuleList) and name.rpartition(".")[2] in LAYER_LISTS and len(m)
    ]
    for name, count in lists:
        if count == wanted:
            return name, count
    return max(lists, key=lambda item: item[1], default=(None, 0))


class MergeProgress:
    """Decoder layers merged (the unit of the bar) and shards written (its postfix), on stderr."""

    def __init__(self, model, stream=None):
        from tqdm.auto import tqdm

        self.stream = stream or sys.stderr
        prefix, self.total = decoder_layers(model)
        self.pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.") if prefix else None
        self.seen: set[str] = set()
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.bar = tqdm(
            total=self.total or None,
            desc="merging",
            unit="layer" if self.pattern else "tensor",  # no decoder layer list: count tensors
            file=self.stream if tty else _Lines(self.stream),
            mininterval=0.5 if tty else LOG_INTERVAL,
            bar_format=None if tty else LOG_FORMAT,
            dynamic_ncols=tty,
        )
        self.bar.set_postfix_str("0 shards written", refresh=False)

    def tensor(self, name: str) -> None:
        """A merged tensor came: a decoder layer not seen before means the previous ones are done."""
        if self.pattern is None:
            self.bar.update(1)
            return
        match = self.pattern.match(name)
        if match and match.group(1) not in self.seen:
            if self.seen:
                self.bar.update(1)
            self.seen.add(match.group(1))

    def shards(self, written: int) -> None:
        self.bar.set_postfix_str(f"{written} shard{'s' if written != 1 else ''} written", refresh=False)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and self.total:
            self.bar.update(self.total - self.bar.n)  # every layer came: the last is done too
        self.bar.close()
