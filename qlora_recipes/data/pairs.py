"""Preference pairs whose chosen answer is the rejected one: DPO's loss on such a pair is log 2 whatever
the weights, with no gradient, and its reward accuracy 0, so a file of them trains nothing without a
word. Counted for every split (the data stats' `identical_pairs`), warned about above a share of
IDENTICAL_WARN, refused when every pair of the train split is one. They are kept, not dropped: each
still takes its place in a batch, as the count says."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import UserError
from .readers import BATCH_ROWS

if TYPE_CHECKING:
    from datasets import Dataset

log = logging.getLogger(__name__)

IDENTICAL_WARN = 0.10  # a share of identical pairs above this is worth a warning


def count_identical(ds: Dataset) -> int:
    """Pairs whose chosen and rejected answers are equal (text, or the same messages)."""
    same = 0
    for batch in ds.select_columns(["chosen", "rejected"]).iter(batch_size=BATCH_ROWS):
        same += sum(c == r for c, r in zip(batch["chosen"], batch["rejected"], strict=True))
    return same


def check_identical(splits: dict[str, Dataset | None], sources: dict[str, str | None]) -> dict[str, int]:
    """{split: identical pairs} of the preference splits given; UserError when every train pair is one,
    a warning where their share is above IDENTICAL_WARN."""
    counts = {}
    for k, ds in splits.items():
        if ds is None:
            continue
        n, same = len(ds), count_identical(ds)
        counts[k] = same
        if k == "train" and n and same == n:
            raise UserError(
                f"{sources[k]}: all {n} pairs have the same chosen and rejected answer, so there is nothing to "
                "prefer (the loss would stay at log 2); give each pair a rejected answer unlike its chosen one"
            )
        if same > IDENTICAL_WARN * n:
            log.warning(
                "%d of %d %s pairs of %s have the same chosen and rejected answer: they teach nothing (kept, "
                "counted in the data stats as identical_pairs); give them different answers or remove them",
                same,
                n,
                k,
                sources[k],
            )
    return counts
