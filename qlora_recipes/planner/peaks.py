"""How a device's rows add up to its peak. The rows of plan.json are static (weights, adapters,
gradients, optimizer state), fixed (CUDA context, process baseline, offload staging) or transient;
the transient rows do not coexist: a device's peak is its fixed and static rows plus the largest
phase - train (activations + max(lm_head_loss, layer_working + dequant_scratch, reference_forward); kl_forward; vision_forward), optimizer step
(optimizer_scratch), eval (eval_transient) or loading (load_transient: the checkpoint's mapped
pages on CPU, k-bit prep's upcast) - plus
allocator overhead. The allocated peak leaves
out what torch's allocator does not hand out (CUDA context, process baseline, allocator slack): it is
what torch.cuda.max_memory_allocated reports. Also the pressure of a plan (peak over budget on its
tightest device), which the ladder and the report read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..units import GiB
from .constants import ALLOCATOR_DYNAMIC_FRACTION, ALLOCATOR_STATIC_FRACTION, HEADROOM_TARGET

STATIC = (
    "quantized_weights",
    "other_params",
    "buffers",
    "checkpoint_pages",
    "lora_weights",
    "gradients",
    "optimizer_state",
)
# cpu_kernels: a CPU run's native bf16 kernels and their scratch, made by its first bf16 op, so not yet
# there while the model loads
FIXED = ("cuda_context", "process_baseline", "offload_staging", "cpu_kernels")
TRANSIENT = (
    "activations",
    "layer_working",
    "lm_head_loss",
    "reference_forward",
    "kl_forward",
    "sampling",
    "vision_forward",
    "dequant_scratch",
    "optimizer_scratch",
    "eval_transient",
    "load_transient",
)
# plan.json's rows, in the report's order
COMPONENTS = (
    *STATIC,
    *TRANSIENT,
    "offload_staging",
    "cuda_context",
    "process_baseline",
    "cpu_kernels",
    "allocator_overhead",
)


def _phases(row: Callable[[str], int]) -> dict[str, int]:
    """Transient bytes per phase of one device."""
    act = row("activations")
    phases = {
        "train: loss": act + row("lm_head_loss"),
        "train: layer backward": act + row("layer_working") + row("dequant_scratch"),
        "train: reference forward": act + row("reference_forward"),
        "optimizer step": row("optimizer_scratch"),
        "eval": row("eval_transient"),
        "load": row("load_transient"),
    }
    if row("kl_forward"):  # kto: its KL batch's forward, before the policy's, when nothing is kept yet
        phases["train: KL forward"] = row("kl_forward")
    if row("vision_forward"):  # a VLM: its vision tower's forward, before the decoder layers keep anything
        phases["train: vision forward"] = row("vision_forward")
    if row("sampling"):  # grpo: its completions generated before the step's forward (no activations held)
        phases["train: sampling"] = row("sampling")
    return phases


def phase_peaks(row: Callable[[str], int], device: str) -> tuple[int, dict[str, int], dict[str, int]]:
    """(static bytes, transient bytes per phase, peak per phase) of one device; `row(component)`
    gives the device's bytes of that component."""
    static = sum(row(k) for k in STATIC)
    fixed = sum(row(k) for k in FIXED)
    phases = _phases(row)
    kernels = row("cpu_kernels")
    by_phase = {
        k: int(fixed - (kernels if k == "load" else 0) + static + v + allocator_bytes(static, v, device))
        for k, v in phases.items()
    }
    return static, phases, by_phase


def allocated_peak(row: Callable[[str], int], load: int = 0) -> int:
    """The most bytes torch's allocator hands out on one device at once (comparable with
    torch.cuda.max_memory_allocated): static rows, offload staging (gathered / staged weights are
    tensors too) and the largest phase's transient rows, or `load` bytes while loading; no CUDA
    context, process baseline or allocator slack."""
    held = sum(row(k) for k in STATIC) + row("offload_staging")
    return int(max(held + max(_phases(row).values()), load))


def peak_allocated_gib(devices: list[dict]) -> float | None:
    """plan.json's peak_allocated_gib: the largest allocated peak of the GPUs (the CPU without)."""
    gpus = [d["peak_allocated"] for d in devices if d["device"].startswith("cuda") and "peak_allocated" in d]
    cpu = [d["peak_allocated"] for d in devices if d["device"] == "cpu" and "peak_allocated" in d]
    found = gpus or cpu
    return round(max(found) / GiB, 3) if found else None


def allocator_bytes(static: int, transient: int, device: str) -> float:
    """The caching allocator's slack over the static bytes and one phase's transient bytes. Only a
    GPU has one: on the CPU a training run pins glibc's malloc thresholds (peak.py), so each tensor
    of 128 KiB or more is its own mapping, gone from RSS when freed - nothing is cached."""
    if not device.startswith("cuda"):
        return 0.0
    return ALLOCATOR_STATIC_FRACTION * static + ALLOCATOR_DYNAMIC_FRACTION * transient


def device_entry(device: str, budget: int, peak: int, phase: str) -> dict:
    """A device of plan.json: its budget, peak, headroom and the phase that peaks."""
    return {
        "device": device,
        "budget": int(budget),
        "peak": int(peak),
        "headroom": int(budget - peak),
        "headroom_pct": round(100.0 * (budget - peak) / budget, 2) if budget else 0.0,
        "peak_phase": phase,
    }


def worst_device(devices: list[dict]) -> dict:
    """The device with the highest peak / budget."""
    return max(devices, key=lambda d: d["peak"] / d["budget"] if d["budget"] else math.inf)


def device_peak(d: dict, with_eval: bool) -> int:
    if with_eval or "peak_by_phase" not in d:
        return d["peak"]
    return max(v for k, v in d["peak_by_phase"].items() if k != "eval")


def pressure(plan: dict, with_eval: bool = True) -> float:
    return max(device_peak(d, with_eval) / d["budget"] if d["budget"] else math.inf for d in plan["devices"])


def ok(plan: dict, with_eval: bool = True) -> bool:
    """Every device at or under (1 - HEADROOM_TARGET) of its budget (eval phase optional)."""
    return pressure(plan, with_eval) <= 1 - HEADROOM_TARGET
