"""The longest `trainer.seq_len` a stack fits at on given hardware: a binary search over plans.

Plans grow with the sequence length (activations, the loss tiles, the eval batch), so the fitting
lengths are the ones below some bound; the search asks `plan` about a multiple of `granularity` at a
time, up to the model's positions (max_position_embeddings, times model.rope_scaling's factor), without the ladder (the stack as given).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from .seqlen import completion_room, positions

if TYPE_CHECKING:
    from ..config.schema import TrainConfig


def longest_seq_len(
    cfg: TrainConfig, plan_fn: Callable[..., dict], gpus: list[int] | None, host_ram: int | None, granularity: int = 64
) -> int | None:
    """The largest multiple of `granularity` (at most the model's positions) whose plan fits;
    None when not even `granularity` tokens fit."""

    def fits(seq_len: int) -> bool:
        trial = copy.deepcopy(cfg)
        trial.trainer.seq_len = seq_len
        return bool(plan_fn(trial, gpus=gpus, host_ram=host_ram, ladder=False)["fits"])

    top = (positions(cfg.model) - completion_room(cfg)) // granularity  # grpo: its completion's room kept
    if top < 1 or not fits(granularity):
        return None
    good, bad = 1, top + 1  # fits(good * granularity) holds; bad is the first multiple known not to
    if fits(top * granularity):
        return top * granularity
    bad = top
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid * granularity):
            good = mid
        else:
            bad = mid
    return good * granularity
