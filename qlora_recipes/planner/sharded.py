"""One rank's plan under parameter sharding (FSDP, ZeRO-3): the one-device plan of a full replica
rewritten into the rank's share of parameters, gradients and optimizer state, the units it gathers,
and the load phase in which every rank still holds the whole quantized base.
"""

from __future__ import annotations

import copy
from typing import Any

from .. import devices as _dev
from ..errors import UserError
from ..units import GiB
from .components import block_bytes
from .constants import CPU_PROCESS_BASELINE_BYTES, CUDA_CONTEXT_BYTES
from .peaks import COMPONENTS, TRANSIENT, allocated_peak, allocator_bytes, device_entry, peak_allocated_gib, phase_peaks
from .spec import StackSpec

SHARDED = ("fsdp", "zero3")  # strategies that shard the (4-bit) parameters across ranks


def plan_sharded(
    base: dict, st: StackSpec, dist: Any, ws: int, ranks_here: int, offload: bool, host_ram: int | None
) -> dict:
    """Rewrite a single-GPU plan (device_map null: everything on cuda:0) into one rank's share.

    Per rank, on its GPU: 1/ws of every parameter, gradient and optimizer state (none of it with
    offload_params: then the shards, their gradients and the optimizer step live in host RAM);
    the bitsandbytes quantization state of every layer (it stays with the module on each rank:
    bitsandbytes `fix_4bit_weight_quant_state_from_module`); the all-gathered units: two decoder
    layers (the one computing and the one prefetched) and the tail unit [final norm, lm_head],
    which FSDP2 keeps gathered from the end of forward to the start of backward (accelerate
    fsdp2_prepare_model); and the activations of its own micro-batch, as on one GPU.
    Loading: every rank loads the whole quantized base before it is sharded (accelerate skips
    cpu_ram_efficient_loading for Params4bit models; transformers skips zero.Init for quantized
    ones, bitsandbytes issue 1249) - on its GPU, or with dist.load_on_cpu in host RAM.
    The device peak is the larger of the load and the training phase. ZeRO-3 is planned the same
    way (its prefetch buckets stand in for FSDP's gathered units).
    """
    plan = copy.deepcopy(base)
    gpu_devs = [d for d in base["devices"] if d["device"].startswith("cuda")]
    if not gpu_devs:
        raise UserError(f"dist={dist.strategy} needs GPUs: declare them in the hardware node (hardware.gpus)")
    dev = gpu_devs[0]["device"]
    sizes = _sizes(st)
    rows = _rank_rows(base["components"], sizes, dev, ws, ranks_here, offload)
    load_on_cpu = bool(dist.load_on_cpu)
    budgets = ((dev, gpu_devs[0]["budget"]), ("cpu", host_ram or _dev.host_ram()))
    devices = [_device(rows, name, budget, ranks_here, load_on_cpu, sizes["full_at_load"]) for name, budget in budgets]
    plan["components"] = {k: rows[k] for k in COMPONENTS if k in rows}
    plan["devices"] = devices
    plan["fits"] = all(d["peak"] <= d["budget"] for d in devices)
    plan["peak_gib"] = round(devices[0]["peak"] / GiB, 3)
    plan["peak_allocated_gib"] = peak_allocated_gib(devices)
    plan["ladder"] = []
    plan["device_map"] = {"": f"{dist.strategy} shard {ws} ways"}
    where = "host RAM (offload_params)" if offload else dev
    plan["notes"] = [n for n in plan["notes"] if "every data-parallel rank" not in n] + [
        f"dist={dist.strategy}: one rank of {ws}; parameter shards, gradients and optimizer state (1/{ws} each) "
        f"in {where}; 'offload staging' = all-gathered units (2 decoder layers + lm_head/norm)",
        f"load phase: each rank loads the whole quantized base ({sizes['full_at_load'] / GiB:.1f} GiB) "
        f"{'in host RAM' if load_on_cpu else 'on its GPU'} before sharding",
    ]
    if dist.strategy == "fsdp" and offload:
        plan["notes"].append("dist.offload_params: the optimizer step runs on the CPU (FSDP CPUOffloadPolicy)")
    plan["stack"]["dist"] = dist.strategy
    plan["dist"] = {
        "strategy": dist.strategy,
        "world_size": ws,
        "ranks_per_node": ranks_here,
        "offload_params": offload,
        "load_on_cpu": load_on_cpu,
    }
    return plan


def _sizes(st: StackSpec) -> dict[str, int]:
    """Whole-model bytes the shares are taken of, the gathered units, and what loading holds."""
    bbs = block_bytes(st)
    layer_units = [bb.quant_data + bb.other + 4 * bb.lora_numel for blk, bb in bbs if blk.is_layer]
    tail = sum(bb.quant_data + bb.other + 4 * bb.lora_numel for blk, bb in bbs if blk.name in ("lm_head", "model.norm"))
    return {
        "quant_data": sum(bb.quant_data for _, bb in bbs),
        "quant_state": sum(bb.quant_state for _, bb in bbs),
        "other": sum(bb.other for _, bb in bbs),
        "buffers": sum(bb.buffers for _, bb in bbs),
        "lora": sum(4 * bb.lora_numel for _, bb in bbs),
        "gathered": 2 * max(layer_units, default=0) + tail,
        "full_at_load": sum(bb.quant_data + bb.quant_state + bb.other_at_load + bb.buffers for _, bb in bbs),
    }


def _put(rows: dict[str, dict[str, int]], row: str, device: str, value: float) -> None:
    if value:
        rows.setdefault(row, {})[device] = rows.get(row, {}).get(device, 0) + int(value)


def _rank_rows(comps: dict, sizes: dict[str, int], dev: str, ws: int, ranks_here: int, offload: bool) -> dict:
    """One rank's bytes per component: shards on its GPU, or with offload all the node's ranks' shards
    in host RAM; the quantization state, buffers, transients and gathered units on its GPU."""
    rows: dict[str, dict[str, int]] = {}
    optim_state = sum(comps.get("optimizer_state", {}).values())
    grads = sum(comps.get("gradients", {}).values())
    holder = "cpu" if offload else dev
    k = ranks_here if offload else 1  # with offload, every rank of the node keeps its shards in host RAM
    _put(rows, "quantized_weights", holder, sizes["quant_data"] / ws * k)
    _put(rows, "quantized_weights", dev, sizes["quant_state"])
    _put(rows, "other_params", holder, sizes["other"] / ws * k)
    _put(rows, "buffers", dev, sizes["buffers"])
    _put(rows, "lora_weights", holder, sizes["lora"] / ws * k)
    _put(rows, "gradients", holder, grads / ws * k)
    _put(rows, "optimizer_state", holder, optim_state / ws * k)
    for row in TRANSIENT:
        if row == "load_transient":  # a rank's loading is _device's `full_at_load`
            continue
        if row == "optimizer_scratch":  # per trainable element of the shard, where the step runs
            _put(rows, row, holder, comps.get(row, {}).get(dev, 0) / ws * k)
        else:
            _put(rows, row, dev, comps.get(row, {}).get(dev, 0))
    # trainer.activation_offloading: every rank of the node keeps its saved activations in host RAM
    _put(rows, "activations", "cpu", comps.get("activations", {}).get("cpu", 0) * ranks_here)
    _put(rows, "offload_staging", dev, sizes["gathered"])  # the all-gathered units
    _put(rows, "cuda_context", dev, CUDA_CONTEXT_BYTES)
    _put(rows, "process_baseline", "cpu", CPU_PROCESS_BASELINE_BYTES * ranks_here)
    return rows


def _device(rows: dict, name: str, budget: int, ranks_here: int, load_on_cpu: bool, full_at_load: int) -> dict:
    """One device of the rank's plan; its peak is the largest of the training phases and the load."""
    static, phases, by_phase = phase_peaks(lambda r: rows.get(r, {}).get(name, 0), name)
    # loading: the whole quantized base per rank, on the GPU or (load_on_cpu) in host RAM
    if name != "cpu" and not load_on_cpu:
        by_phase["load"] = int(CUDA_CONTEXT_BYTES + full_at_load)
    if name == "cpu":
        base_rss = CPU_PROCESS_BASELINE_BYTES * ranks_here
        by_phase["load"] = int(base_rss + (full_at_load * ranks_here if load_on_cpu else 0))
    phase = max(by_phase, key=lambda k: by_phase[k])
    if phase != "load":
        _put(rows, "allocator_overhead", name, allocator_bytes(static, phases[phase], name))
    entry = device_entry(name, budget, by_phase[phase], phase)
    entry["peak_by_phase"] = by_phase
    loaded = full_at_load * (ranks_here if name == "cpu" else 1) if load_on_cpu == (name == "cpu") else 0
    entry["peak_allocated"] = allocated_peak(lambda r: rows.get(r, {}).get(name, 0), loaded)
    return entry
