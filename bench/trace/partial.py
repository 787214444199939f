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

from bench.trace import children

SLICES = ((2, 1), (3, 1), (2, 2))  # (checkpointed, kept) decoder layers of each traced slice


def resolved_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with trainer.gradient_checkpointing / micro_batch_size=auto as the plan resolves them."""
    from qlora_recipes.config.loader import load
    from qlora_recipes.planner import fastest

    if not fastest.is_auto(load(list(overrides))):
        return list(overrides)
    auto = children.plan_for(list(overrides), children.recipe_gpus(list(overrides)))["batch_auto"]
    return [*overrides, *(f"{k}={str(v).lower()}" for k, v in auto.items() if k != "why")]


def partial_layers(cfg: Any, layers: int) -> int | None:
    """N when the stack checkpoints only its first N of `layers` decoder layers, else None."""
    value = cfg.trainer.gradient_checkpointing
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < layers:
        return None
    return value if value >= SLICES[0][0] and layers - value >= SLICES[0][1] else None


def trace_partial(base: dict, n: int, layers: int, log_dir: Path | None) -> dict:
    """The three slices traced and combined to N checkpointed and layers - N kept decoder layers."""
    got = []
    for ckpt, kept in SLICES:
        spec = {
            **base,
            "overrides": [*base["overrides"], f"trainer.gradient_checkpointing={ckpt}"],
            "layers": ckpt + kept,
        }
        got.append(children.run_child(spec, (log_dir / f"C{ckpt}K{kept}.log") if log_dir else None))
    (c0, k0) = SLICES[0]
    result = combine(*got, n - c0, layers - n - k0)
    result.update({"layers": layers, "sliced": True, "layers_traced": [c + k for c, k in SLICES]})
    result["slices"] = {
        f"{c} checkpointed + {k} kept": children.brief(r) for (c, k), r in zip(SLICES, got, strict=True)
    }
    last = got[-1]
    result.update({k: last.get(k) for k in ("kernels", "modules", "optimizer")})
    result["modules_of"] = "the 2 + 2 layer slice"
    result["max_rss_gib"] = max(r.get("max_rss_gib", 0) for r in got)
    return result


def combine(a: dict, b: dict, c: dict, s1: int, s2: int) -> dict:
    """a + s1 * (b - a) + s2 * (c - a), phase by phase and device by device (run.extrapolate's two-kind form)."""
    return children.combine(a, [b, c], [s1, s2])
