"""Running traces: a child process per traced model, layer slices scaled to the whole model, and the
plan of the same stack beside it.

A trace of a 32- or 80-layer model runs every layer's forward, recompute and backward op through the
fake mode and the tracker (minutes on a busy 2-core machine). Its decoder layers are identical, so
memory is affine in the number of layers L, phase by phase: the static rows (4-bit weights, adapters,
gradients, optimizer state) grow by one layer's bytes, the activations kept for backward by one
layer's (its input under checkpointing, all it saves without), and the working sets of a phase do
not grow at all. `trace_stack` therefore traces two slices of the model (k and k + 1 decoder layers,
everything else whole: embeddings, vocabulary, sequence, batch, optimizer) and extrapolates each
phase's peak and components exactly: x(L) = x(k) + (L - k) * (x(k + 1) - x(k)). The smallest k is 2,
and with TRL's activation offloading 1 + TRL_OFFLOAD_FWD_STASH (its forward stash keeps the inputs of
the last five layers on the GPU, so fewer layers would not yet show the per-layer step).
tests/unit/test_memory_tracer.py checks a sliced trace against a full one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.trace.children import brief, combine, plan_for, recipe_gpus, run_child

__all__ = ["compare", "extrapolate", "plan_for", "recipe_gpus", "run_child", "slice_layers", "trace_stack"]

# the plan's phase names for the trace's (loss: the fused head forward and backward; backward: the
# decoder layers' backward with their recompute; reference: DPO's and KTO's no_grad reference forward;
# kl: KTO's no_grad forward of its KL batch; prefill and decode: GRPO's generation, the plan's
# sampling phase the larger of the two; forward has no row of its own in a plan)
PLAN_PHASE = {
    "vision": "train: vision forward",
    "prefill": "train: sampling",
    "decode": "train: sampling",
    "kl": "train: KL forward",
    "loss": "train: loss",
    "reference": "train: reference forward",
    "backward": "train: layer backward",
    "optimizer": "optimizer step",
}
STATIC = ("quantized_weights", "other_params", "buffers", "lora_weights", "gradients", "optimizer_state")
FULL_TRACE_MAX_LAYERS = 4  # models this small are traced whole


def slice_layers(cfg: Any) -> tuple[int, int] | None:
    """(k, k + 1) decoder layers to trace, or None to trace the model whole."""
    from qlora_recipes.planner import model_figures

    layers = model_figures(cfg.model).num_layers
    k = 2 + (cfg.trainer.activation_offload_stash if cfg.trainer.activation_offloading else 0)
    if layers <= max(FULL_TRACE_MAX_LAYERS, k + 1):
        return None
    return k, k + 1


def extrapolate(small: dict, large: dict, layers: int) -> dict:
    """The result of a model of `layers` layers from traces of k and k + 1 layers, phase by phase."""
    k = small["layers_traced"]
    return {"layers_traced": [k, large["layers_traced"]], "layers": layers, **combine(small, [large], [layers - k])}


def trace_stack(
    overrides: list[str], device: str = "cuda", layers: int | str | None = "auto", log_dir: Path | None = None, **extra
) -> dict:
    """Trace a stack: whole, or two layer slices extrapolated to the model's layers."""
    from bench.trace.partial import partial_layers, resolved_overrides, trace_partial
    from qlora_recipes.config.loader import load
    from qlora_recipes.planner import model_figures

    overrides = resolved_overrides(list(overrides))  # checkpointing / micro-batch auto: as the plan resolves them
    cfg = load(list(overrides))
    total_layers = model_figures(cfg.model).num_layers
    pair = (
        slice_layers(cfg)
        if layers == "auto"
        else (None if layers in (None, "full") else (int(layers), int(layers) + 1))
    )
    started = time.perf_counter()
    base = {"overrides": list(overrides), "device": device, **extra}

    def log(tag: str) -> Path | None:
        return (log_dir / f"{tag}.log") if log_dir else None

    partial = partial_layers(cfg, total_layers) if pair is not None else None
    if partial is not None:  # the first N layers checkpointed: two kinds of layer, three slices
        result = trace_partial(base, partial, total_layers, log_dir)
    elif pair is None:
        result = run_child(base, log("full"))
        result["layers"] = total_layers
        result["layers_traced"] = [result["layers_traced"]]
        result["sliced"] = False
    else:
        small = run_child({**base, "layers": pair[0]}, log(f"L{pair[0]}"))
        large = run_child({**base, "layers": pair[1]}, log(f"L{pair[1]}"))
        result = extrapolate(small, large, total_layers)
        result["sliced"] = True
        result["slices"] = {str(pair[0]): brief(small), str(pair[1]): brief(large)}
        result["kernels"] = large.get("kernels")
        result["modules"] = large.get("modules")  # per-module peaks: of the larger slice, not scaled
        result["modules_of"] = f"the {pair[1]}-layer slice"
        result["optimizer"] = large.get("optimizer")
        result["max_rss_gib"] = max(small.get("max_rss_gib", 0), large.get("max_rss_gib", 0))
    result["overrides"] = list(overrides)
    result["device"] = device
    result["trace_s"] = round(time.perf_counter() - started, 1)
    return result


def compare(result: dict, plan: dict, device: str = "cuda:0") -> dict:
    """Traced vs planned on one device: peaks, ratio, and each component and phase beside its plan row."""
    from qlora_recipes.units import GiB

    planned = plan.get("peak_allocated_gib")
    entry = next((d for d in plan["devices"] if d["device"] == device), None)
    if entry is not None and "peak_allocated" in entry:
        planned = entry["peak_allocated"] / GiB
    traced = result["peak"].get(device, 0) / GiB
    comps = plan.get("components", {})
    phase = result["peak_phase"].get(device)
    traced_comps = result["peak_components"].get(device, {})
    rows = {}
    for name in sorted(set(traced_comps) | {k for k, v in comps.items() if v.get(device)}):
        if name in ("cuda_context", "allocator_overhead", "process_baseline", "eval_transient"):
            continue
        rows[name] = {
            "traced_gib": round(traced_comps.get(name, 0) / GiB, 3),
            "planned_gib": round(comps.get(name, {}).get(device, 0) / GiB, 3),
        }
    phases = {}
    for ph, plan_name in PLAN_PHASE.items():
        got = result["phases"].get(f"{device}|{ph}")
        if got is None or entry is None:
            continue
        static = sum(comps.get(k, {}).get(device, 0) for k in STATIC) + comps.get("offload_staging", {}).get(device, 0)
        transient = _plan_transient(comps, device, plan_name)
        if plan_name in phases and phases[plan_name]["traced_gib"] >= round(got["total"] / GiB, 3):
            continue  # grpo: the larger of the prefill and the decoding steps
        phases[plan_name] = {
            "traced_gib": round(got["total"] / GiB, 3),
            "planned_gib": round((static + transient) / GiB, 3),
        }
    train = max((v["planned_gib"] for v in phases.values()), default=None)
    return {
        "device": device,
        "planned_gib": round(planned, 3) if planned is not None else None,
        "planned_train_gib": train,  # the plan's largest training phase (its peak leaves out eval here)
        "traced_gib": round(traced, 3),
        "ratio": round(traced / planned, 3) if planned else None,
        "traced_peak_phase": PLAN_PHASE.get(phase, phase),
        "planned_peak_phase": entry.get("peak_phase") if entry else None,
        "components": rows,
        "phases": phases,
    }


def _plan_transient(comps: dict, device: str, phase: str) -> int:
    def row(k: str) -> int:
        return comps.get(k, {}).get(device, 0)

    if phase == "train: loss":
        return row("activations") + row("lm_head_loss")
    if phase == "train: layer backward":
        return row("activations") + row("layer_working") + row("dequant_scratch")
    if phase == "train: reference forward":
        return row("activations") + row("reference_forward")
    if phase == "train: KL forward":
        return row("kl_forward")
    if phase == "train: vision forward":
        return row("vision_forward")
    if phase == "train: sampling":
        return row("sampling")
    return row("optimizer_scratch")
