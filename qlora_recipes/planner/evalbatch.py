"""`trainer.eval_batch_size=auto`: the most rows per evaluation forward, up to MOST, whose evaluation
phase needs no more memory on any device than training does, so that evaluation (and the exact-match
metric's generation, bounded by eval_batch_size x seq_len positions) is never what a long context
runs out of. Resolved from the plan before anything reads it as a number; a stack without an eval
split takes MOST (no evaluation to bound).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

from .peaks import device_peak

if TYPE_CHECKING:
    from ..config.schema import TrainConfig

AUTO = "auto"
MOST = 16
CANDIDATES = (16, 8, 4, 2, 1)


def is_auto(cfg: TrainConfig) -> bool:
    return cfg.trainer.eval_batch_size == AUTO


def with_eval_batch(cfg: TrainConfig, rows: int) -> TrainConfig:
    out = copy.deepcopy(cfg)
    out.trainer.eval_batch_size = rows
    return out


def rows_for_data(cfg: TrainConfig, eval_rows: int) -> int | None:
    """The eval batch a run's evaluation really makes when its eval split holds fewer rows than
    trainer.eval_batch_size (the trainer never batches more rows than there are); None otherwise."""
    asked = cfg.trainer.eval_batch_size
    return eval_rows if not is_auto(cfg) and 0 < eval_rows < int(asked) else None


def data_note(rows: int, asked: int) -> str:
    return (
        f"evaluation planned for the eval split's {rows} rows, fewer than trainer.eval_batch_size={asked}: "
        "its batches hold no more"
    )


def _eval_within_training(plan: dict) -> bool:
    return all(device_peak(d, with_eval=True) <= device_peak(d, with_eval=False) for d in plan["devices"])


def resolve(cfg: TrainConfig, plan_fn: Callable[[TrainConfig], dict]) -> tuple[int, str]:
    """(rows, the line saying why): the first of CANDIDATES whose plan's eval phase is no larger than
    its training phases on every device; 1 when even one row's evaluation is larger (then one row it
    is, and the plan shows evaluation as the peak)."""
    for rows in CANDIDATES:
        plan = plan_fn(with_eval_batch(cfg, rows))
        if _eval_within_training(plan):
            if plan["stack"].get("eval_batch_size") is None:
                return rows, f"trainer.eval_batch_size=auto -> {rows} (no eval split: nothing to bound)"
            return rows, (
                f"trainer.eval_batch_size=auto -> {rows} (the most rows, up to {MOST}, whose evaluation "
                "needs no more memory than training)"
            )
    return 1, (
        "trainer.eval_batch_size=auto -> 1 (evaluating even one row needs more memory than training; "
        "the plan counts it)"
    )
