"""Tracing trainer.gradient_checkpointing=N (the first N decoder layers checkpointed, model/checkpointing.py)
and the autos that resolve to it.

The autos are resolved as a run resolves them, by the stack's plan for its recipe's GPU (plan.json's
`batch_auto`), and traced at what they resolved to. With a partial N a model has two kinds of identical
layers, so memory is affine in both counts, phase by phase: three slices, (c, u) = (2, 1), (3, 1) and
(2, 2) checkpointed and kept layers, give x(N, L - N) = x(2, 1) + (N - 2) * (x(3, 1) - x(2, 1)) +
(L - N - 1) * (x(2, 2) - x(2, 1)), as bench/trace/run.py extrapolates one kind from two slices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SLICES = ((2, 1), (3, 1), (2, 2))  # (checkpointed, kept) decoder layers of each traced slice


def resolved_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with trainer.gradient_checkpointing / micro_batch_size=auto as the plan resolves them."""
    from bench.trace.run import plan_for, recipe_gpus
    from qlora_recipes.config.loader import load
    from qlora_recipes.planner import fastest

    if not fastest.is_auto(load(list(overrides))):
        return list(overrides)
    auto = plan_for(list(overrides), recipe_gpus(list(overrides)))["batch_auto"]
    return [*overrides, *(f"{k}={str(v).lower()}" for k, v in auto.items() if k != "why")]


def partial_layers(cfg: Any, layers: int) -> int | None:
    """N when the stack checkpoints only its first N of `layers` decoder layers, else None."""
    value = cfg.trainer.gradient_checkpointing
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < layers:
        return None
    return value if value >= SLICES[0][0] and layers - value >= SLICES[0][1] else None


def trace_partial(base: dict, n: int, layers: int, log_dir: Path | None) -> dict:
    """The three slices traced and combined to N checkpointed and layers - N kept decoder layers."""
    from bench.trace.run import _brief, run_child

    got = []
    for ckpt, kept in SLICES:
        spec = {
            **base,
            "overrides": [*base["overrides"], f"trainer.gradient_checkpointing={ckpt}"],
            "layers": ckpt + kept,
        }
        got.append(run_child(spec, (log_dir / f"C{ckpt}K{kept}.log") if log_dir else None))
    (c0, k0) = SLICES[0]
    result = combine(*got, n - c0, layers - n - k0)
    result.update({"layers": layers, "sliced": True, "layers_traced": [c + k for c, k in SLICES]})
    result["slices"] = {f"{c} checkpointed + {k} kept": _brief(r) for (c, k), r in zip(SLICES, got, strict=True)}
    last = got[-1]
    result.update({k: last.get(k) for k in ("kernels", "modules", "optimizer")})
    result["modules_of"] = "the 2 + 2 layer slice"
    result["max_rss_gib"] = max(r.get("max_rss_gib", 0) for r in got)
    return result


def _affine2(a: dict, b: dict, c: dict, s1: int, s2: int) -> dict:
    keys = set(a) | set(b) | set(c)
    out = {k: int(a.get(k, 0) + s1 * (b.get(k, 0) - a.get(k, 0)) + s2 * (c.get(k, 0) - a.get(k, 0))) for k in keys}
    return {k: v for k, v in out.items() if v}


def combine(a: dict, b: dict, c: dict, s1: int, s2: int) -> dict:
    """a + s1 * (b - a) + s2 * (c - a), phase by phase and device by device (run.extrapolate's two-kind form)."""
    from bench.trace.run import PHASES, phase_table

    out: dict = {"phases": {}, "peak": {}, "peak_phase": {}, "peak_components": {}}
    devices = {key.split("|", 1)[0] for r in (a, b, c) for key in r["phases"]}
    for dev in sorted(devices):
        ta, tb, tc = (phase_table(r, dev) for r in (a, b, c))
        best = None
        for phase in PHASES:
            if not all(phase in t for t in (ta, tb, tc)):
                continue
            total = int(
                ta[phase]["total"]
                + s1 * (tb[phase]["total"] - ta[phase]["total"])
                + s2 * (tc[phase]["total"] - ta[phase]["total"])
            )
            comps = _affine2(ta[phase]["components"], tb[phase]["components"], tc[phase]["components"], s1, s2)
            out["phases"][f"{dev}|{phase}"] = {"total": total, "components": comps}
            if best is None or total > best[0]:
                best = (total, phase, comps)
        if best:
            out["peak"][dev], out["peak_phase"][dev], out["peak_components"][dev] = best
    out["static"] = {
        dev: _affine2(*(r["static"].get(dev, {}) for r in (a, b, c)), s1, s2)
        for dev in set(a["static"]) | set(b["static"]) | set(c["static"])
    }
    return out
