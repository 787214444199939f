"""Statistics of the harness: medians, ratios and errors, a least-squares line and the per-layer
extrapolation built on it, steady-state seconds per step, and the bounded binary search the sequence
search uses. Pure functions of numbers: no torch, no files."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def median(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return statistics.median(xs) if xs else None


def ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or base == 0:
        return None
    return ours / base


def pct_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in %: positive when the prediction is above the measurement."""
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict:
    """Least-squares y = intercept + slope * x; r2 and the largest absolute residual."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit_line needs at least 2 (x, y) pairs of equal length, got {len(xs)} and {len(ys)}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs at least 2 different x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum(r * r for r in residuals)
    return {
        "slope": slope,
        "intercept": intercept,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "max_abs_residual": max(abs(r) for r in residuals),
    }


def extrapolate_layers(points: Mapping[int, float], target_layers: int) -> dict:
    """Fit value = intercept + slope * layers over measured {layers: value} and evaluate at target_layers.

    Peak memory and seconds/step of a decoder-only model grow by the same amount per identical layer
    (weights, adapters, the checkpointed layer input), plus a constant (embeddings, lm_head, logits, one
    layer's working set), so a line through a few reduced-layer runs predicts the full depth."""
    good = {int(k): float(v) for k, v in points.items() if v is not None}
    fit = fit_line(sorted(good), [good[k] for k in sorted(good)])
    return {
        "points": {str(k): good[k] for k in sorted(good)},
        "per_layer": fit["slope"],
        "constant": fit["intercept"],
        "r2": fit["r2"],
        "max_abs_residual": fit["max_abs_residual"],
        "target_layers": target_layers,
        "at_target": fit["intercept"] + fit["slope"] * target_layers,
    }


def steady_step_s(step_end_s: Mapping[int, float], warmup: int) -> float | None:
    """Mean seconds per step after the first `warmup` steps: (end of the last step - end of step
    `warmup`) / the steps between. `step_end_s` maps step numbers (1-based) to cumulative times; it
    needs only some steps (train.py logs every trainer.memory_log_steps): the first logged step at or
    after `warmup` starts the interval. None with fewer than 2 usable points."""
    window = steady_window(step_end_s, warmup)
    if window is None:
        return None
    first, last = window
    return (step_end_s[last] - step_end_s[first]) / (last - first)


def steady_window(step_end_s: Mapping[int, float], warmup: int) -> tuple[int, int] | None:
    """The logged steps that bound the timed interval of steady_step_s: (first, last), or None."""
    steps = sorted(k for k in step_end_s if k >= max(1, warmup))
    return (steps[0], steps[-1]) if len(steps) >= 2 else None


def steady_tokens_per_s(step_end_s: Mapping[int, float], step_tokens: Mapping[int, float], warmup: int) -> float | None:
    """Tokens/s over the timed interval, from the tokens those very steps trained (cumulative counts by
    step): rows of mixed lengths make the run's mean tokens per step another figure than the timed
    steps'. None when either end of the interval has no count."""
    window = steady_window(step_end_s, warmup)
    if window is None or any(k not in step_tokens for k in window):
        return None
    first, last = window
    seconds = step_end_s[last] - step_end_s[first]
    return (step_tokens[last] - step_tokens[first]) / seconds if seconds > 0 else None


def search_longest(lo: int, hi: int, gran: int, fits: Callable[[int], bool], max_probes: int) -> int | None:
    """Largest multiple of `gran` in [lo, hi] with fits(x) (monotone: true up to some x), in at most
    max_probes calls of `fits`; None when lo does not fit. With probes left over it is exact."""
    grid = list(range(lo, hi + 1, gran)) or [lo]
    if not fits(grid[0]):
        return None
    good, bad, probes = 0, len(grid), 1
    while bad - good > 1 and probes < max_probes:
        mid = (good + bad) // 2
        probes += 1
        if fits(grid[mid]):
            good = mid
        else:
            bad = mid
    return grid[good]
