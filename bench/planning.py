"""Every call the harness makes into the planner, in one place: the plan of a composed config for
the GPUs declared (or this CPU), the planner's figures a measurement is compared with, and the
planner's error. Stages and measurements call these, never the planner itself, so a move of the
planner changes this file only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.stats import pct_error
from qlora_recipes.units import GiB


def plan_stack(cfg: Any, gpus: list[int]) -> dict:
    """The planner's plan (plan.json) of a composed config for these GPUs' total bytes (none: this
    CPU), without the OOM ladder: the stack as given."""
    from qlora_recipes.planner import plan

    return plan(cfg, gpus=gpus, world_size=1, ladder=False)  # one process: what a bench child runs


def fits(cfg: Any, gpus: list[int]) -> bool:
    return bool(plan_stack(cfg, gpus)["fits"])


def plan_summary(plan: Mapping[str, Any]) -> dict:
    """The planner's figures compared with a measurement: its peak, the CUDA context and allocator
    overhead it includes (a GPU run's max_memory_reserved sees neither the context nor, for
    max_memory_allocated, the allocator overhead)."""
    dev = max(plan["devices"], key=lambda d: d["peak"]) if plan.get("devices") else None
    name = dev["device"] if dev else None
    comps = plan.get("components", {})
    ctx = comps.get("cuda_context", {}).get(name, 0) if name else 0
    alloc = comps.get("allocator_overhead", {}).get(name, 0) if name else 0
    return {
        "device": name,
        "peak_gib": plan.get("peak_gib"),
        "peak_phase": dev.get("peak_phase") if dev else None,
        "cuda_context_gib": ctx / GiB,
        "allocator_overhead_gib": alloc / GiB,
        "fits": plan.get("fits"),
    }


def summary(cfg: Any, gpus: list[int]) -> dict:
    """`plan_summary` of the plan of `cfg`."""
    return plan_summary(plan_stack(cfg, gpus))


def plan_errors(plan: Mapping[str, Any], measured: Mapping[str, Any], gpu: bool) -> dict:
    """Planner error in %. CPU: planned peak vs the process's peak RSS. GPU: planned peak less the CUDA
    context vs max_memory_reserved (the headline), and less the allocator overhead too vs
    max_memory_allocated."""
    if not plan or measured.get("status") != "ok":
        return {}
    peak = plan.get("peak_gib")
    if not gpu:
        return {
            "vs_peak_rss": pct_error(peak, measured.get("peak_rss_gib")),
            "headline": pct_error(peak, measured.get("peak_rss_gib")),
        }
    ctx, alloc = plan.get("cuda_context_gib") or 0.0, plan.get("allocator_overhead_gib") or 0.0
    reserved = pct_error(peak - ctx, measured.get("peak_reserved_gib")) if peak is not None else None
    allocated = pct_error(peak - ctx - alloc, measured.get("peak_allocated_gib")) if peak is not None else None
    return {"vs_reserved": reserved, "vs_allocated": allocated, "headline": reserved}


def comparable(summary: Mapping[str, Any] | None, quantity: str) -> float | None:
    """The planner's figure for a measured quantity (a `plan_summary`): see `plan_errors`."""
    if not summary or summary.get("peak_gib") is None:
        return None
    if quantity == "peak_rss_gib":
        return summary["peak_gib"]
    if quantity == "peak_reserved_gib":
        return summary["peak_gib"] - summary["cuda_context_gib"]
    if quantity == "peak_allocated_gib":
        return summary["peak_gib"] - summary["cuda_context_gib"] - summary["allocator_overhead_gib"]
    return None
