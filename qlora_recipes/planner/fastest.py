"""`trainer.gradient_checkpointing=auto` and `trainer.micro_batch_size=auto`: the fastest of the stacks
that fit, resolved from plans before anything reads them as numbers.

- gradient_checkpointing=auto: the fewest checkpointed decoder layers (the first N, model/checkpointing.py)
  whose plan fits; every layer when none fits (the plan and its ladder then say so).
- micro_batch_size=auto: trainer.grad_accum is read as the rows of one optimizer step per rank (the
  effective batch over the ranks) and split into micro-batch x accumulation: the largest micro-batch
  that fits, among the divisors of those rows, so the effective batch stays what grad_accum says. When
  the largest that fits does not divide it, one line says so and the largest divisor below it is taken.
- Both: fewer recomputed layers first, then the largest micro-batch at that count. Recomputing costs
  measured time (every layer: 1.57x the step time of none, RECOMPUTE_COST); a larger micro-batch only
  fills a GPU better, which nothing here has measured, so it takes the memory the layers leave.

A stack fits when its training phases fit every device (the eval phase has its own auto,
planner/evalbatch.py, resolved after these).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .peaks import device_peak

if TYPE_CHECKING:
    from ..config.schema import TrainConfig

AUTO = "auto"
# bench/results/nvidia-h100-80gb-hbm3-2026-11-26.md: the 8B shape, NF4, micro-batch 1, 2,048 tokens:
# 0.756 s/step with every layer checkpointed, 0.480 s/step with none (8b-nf4-paged8bit-ckpt, 8b-full-no-ckpt)
RECOMPUTE_COST = 0.756 / 0.480 - 1


def is_auto(cfg: TrainConfig) -> bool:
    return cfg.trainer.gradient_checkpointing == AUTO or cfg.trainer.micro_batch_size == AUTO


def fits_training(plan: dict) -> bool:
    """Every device's training peak within its budget (evaluation is bounded by eval_batch_size=auto)."""
    return all(device_peak(d, with_eval=False) <= d["budget"] for d in plan["devices"])


def with_batch(cfg: TrainConfig, checkpointing=None, micro: int | None = None, accum: int | None = None):
    out = copy.deepcopy(cfg)
    if checkpointing is not None:
        out.trainer.gradient_checkpointing = checkpointing
    if micro is not None:
        out.trainer.micro_batch_size = micro
    if accum is not None:
        out.trainer.grad_accum = accum
    return out


@dataclass
class Resolved:
    """What the autos resolved to and the lines saying why."""

    checkpointing: bool | int
    micro: int
    accum: int
    lines: list[str]

    def overrides(self) -> dict:
        return {
            "trainer.gradient_checkpointing": self.checkpointing,
            "trainer.micro_batch_size": self.micro,
            "trainer.grad_accum": self.accum,
        }


def _largest(lo: int, hi: int, good: Callable[[int], bool]) -> int | None:
    """The largest x in [lo, hi] with good(x), good true below some bound; None when good(lo) is false."""
    if not good(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if good(mid) else (lo, mid - 1)
    return lo


def fewest_layers(cfg: TrainConfig, plan_fn: Callable, layers: int, micro: int) -> int | None:
    """The fewest checkpointed layers at this micro-batch whose plan fits; None when not even all do."""
    most_kept = _largest(0, layers, lambda k: fits_training(plan_fn(with_batch(cfg, layers - k, micro, 1))))
    return None if most_kept is None else layers - most_kept


def largest_micro(cfg: TrainConfig, plan_fn: Callable, checkpointing, rows: int) -> int | None:
    """The largest micro-batch up to `rows` whose plan fits with this checkpointing; None if not even 1."""
    return _largest(1, rows, lambda m: fits_training(plan_fn(with_batch(cfg, checkpointing, m, 1))))


def resolve(cfg: TrainConfig, plan_fn: Callable[[TrainConfig], dict], layers: int) -> Resolved:
    """The autos of `cfg` resolved on its plans (plan_fn: a plan without ladder); the others as set."""
    t = cfg.trainer
    lines: list[str] = []
    gc_auto, mb_auto = t.gradient_checkpointing == AUTO, t.micro_batch_size == AUTO
    rows = int(t.grad_accum) if mb_auto else int(t.micro_batch_size)
    micro = 1 if mb_auto else rows
    checkpointing = t.gradient_checkpointing
    if gc_auto:
        n = fewest_layers(cfg, plan_fn, layers, micro)
        checkpointing = layers if n is None else n
        checkpointing = True if checkpointing >= layers else (False if checkpointing == 0 else checkpointing)
        lines.append(_gc_line(checkpointing, layers, micro, n is None))
    if not mb_auto:
        return Resolved(checkpointing, micro, int(t.grad_accum), lines)
    fit = largest_micro(cfg, plan_fn, checkpointing, rows) or 1
    chosen = max(d for d in range(1, fit + 1) if rows % d == 0)
    lines.append(_mb_line(chosen, fit, rows))
    return Resolved(checkpointing, chosen, rows // chosen, lines)


def _gc_line(value, layers: int, micro: int, none_fit: bool) -> str:
    if none_fit:
        return f"trainer.gradient_checkpointing=auto -> true (not even every layer checkpointed fits at micro-batch {micro})"
    what = {True: "every layer", False: "none"}.get(value, f"the first {value} of {layers} decoder layers")
    return f"trainer.gradient_checkpointing=auto -> {str(value).lower()} ({what}: the fewest that fit at micro-batch {micro})"


def _mb_line(chosen: int, fit: int, rows: int) -> str:
    split = f"x trainer.grad_accum={rows // chosen} keeps {rows} rows per optimizer step per rank"
    if chosen == fit:
        return f"trainer.micro_batch_size=auto -> {chosen} (the largest that fits, up to {rows}) {split}"
    return (
        f"trainer.micro_batch_size=auto -> {chosen}: {fit} fits but does not divide {rows} rows per optimizer step; "
        f"the largest divisor below it {split}"
    )


# --fastest: the options that cost speed but no quality beyond a rounding, cheapest first, with the step
# time each adds (planner/ladder.py COSTS cites where each was measured): fp32 frozen parts cost memory,
# not speed (the 16k H100 run with bf16 frozen parts was faster), fp32 adapters both (H200: 0.669 against
# 0.580 s an 8B step; counted at no gain here, and under bf16 compute auto picks bf16 already); the norm and
# embedding passes are elementwise; a tiled MLP adds one more MLP forward, about a sixth of the step
LEAN_STEPS = (
    ("precision.upcast_frozen=false", 0.0),
    ("peft.adapter_dtype=bfloat16", 0.0),
    ("trainer.lean_rmsnorm=true", 0.02),
    ("offload.embeddings=true", 0.02),
    ("trainer.tiled_mlp=true", 1 / 6),
)


def step_time(checkpointed: bool | int, layers: int, lean: float) -> float:
    """A stack's step time relative to the same stack without checkpointing or lean options."""
    n = layers if checkpointed is True else int(checkpointed)
    return (1 + RECOMPUTE_COST * n / layers) * (1 + lean)


def fastest_stack(cfg: TrainConfig, plan_fn: Callable[[TrainConfig], dict], layers: int, allowed) -> tuple | None:
    """(overrides, relative step time, plan) of the fastest stack that fits: both autos resolved over each
    cumulative prefix of LEAN_STEPS that `allowed(cfg)` accepts (config/checks.py), the effective batch kept;
    None when none fits."""
    from ..config.loader import with_overrides

    t = cfg.trainer
    rows = int(t.grad_accum) * (1 if t.micro_batch_size == AUTO else int(t.micro_batch_size))
    base = with_batch(cfg, AUTO, AUTO, rows)
    best, lean, added = None, 0.0, []
    for step, cost in ((None, 0.0), *LEAN_STEPS):
        trial = base if step is None else with_overrides(base, [*added, step])
        if step is not None and (not allowed(trial) or trial == with_overrides(base, added)):
            continue  # refused for this stack, or already so
        if step is not None:
            added.append(step)
            lean += cost
        auto = resolve(trial, plan_fn, layers)
        plan = plan_fn(with_batch(trial, auto.checkpointing, auto.micro, auto.accum))
        if not fits_training(plan):
            continue
        time = step_time(auto.checkpointing, layers, lean)
        if best is None or time < best[1] - 1e-9:
            overrides = {**{k: v for k, v in (s.split("=", 1) for s in added)}, **auto.overrides()}
            best = (overrides, time, plan)
    return best


def fastest_lines(found: tuple | None, planned_for: str, layers: int) -> list[str]:
    """What `qlora plan --fastest` prints: the stack, its estimated step time, the line to paste."""
    if found is None:
        return [f"fastest stack that fits {planned_for}: none; not even every layer checkpointed, micro-batch 1 and "
                "every lean option fit (see the ladder above)"]  # fmt: skip
    overrides, time, plan = found
    paste = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in overrides.items())
    gc = overrides["trainer.gradient_checkpointing"]
    ckpt = {True: "every layer", False: "no layer"}.get(gc, f"the first {gc} of {layers} layers")
    return [
        f"fastest stack that fits {planned_for}: checkpointing {ckpt}, micro-batch "
        f"{overrides['trainer.micro_batch_size']} x accumulation {overrides['trainer.grad_accum']}, peak "
        f"{plan['peak_gib']:.2f} GiB; step time ~{time:.2f}x the same stack without checkpointing",
        f"overrides: {paste}",
    ]
