"""One rank's plan under parameter sharding (FSDP, ZeRO-3): the one-device plan of a full replica
rewritten into the rank's share of parameters, gradients and optimizer state, the units it gathers,
and the load phase in which every rank still holds the whole quantized base. On CPU ranks (no GPU,
gloo: `plan_cpu_rank`) every strategy (DDP, FSDP, ZeRO-2, ZeRO-3) is planned per rank process, as
each rank's own peak RSS (bench/results/planner-sharded.json measures it).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from ..config import devices as _dev
from ..errors import UserError
from ..units import GiB, dtype_bytes
from .blocks import OUTPUT_HEAD
from .components import block_bytes
from .constants import CPU_PROCESS_BASELINE_BYTES, CUDA_CONTEXT_BYTES
from .figures import final_norm
from .peaks import (
    COMPONENTS,
    STATIC,
    TRANSIENT,
    allocated_peak,
    allocator_bytes,
    device_entry,
    peak_allocated_gib,
    phase_peaks,
)
from .spec import StackSpec

if TYPE_CHECKING:
    from ..config.schema import DistConfig

SHARDED = ("fsdp", "zero3")  # strategies that shard the (4-bit) parameters across ranks
CPU_RANKS = ("ddp", "fsdp", "zero2", "zero3")  # strategies planned per rank process on CPU


def plan_sharded(
    base: dict, st: StackSpec, dist: DistConfig, ws: int, ranks_here: int, offload: bool, host_ram: int | None
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
    tail_names = (OUTPUT_HEAD, final_norm(st.fig))  # a VLM's norm is its language model's
    tail = sum(bb.quant_data + bb.other + 4 * bb.lora_numel for blk, bb in bbs if blk.name in tail_names)
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


# ---------------------------------------------------------------------------------------------
# CPU ranks: every rank a process on one host (gloo), each with its own RSS.
# ---------------------------------------------------------------------------------------------
# What a rank process holds beyond one training process's baseline (CPU_PROCESS_BASELINE_BYTES)
# before any model bytes: torch.distributed and gloo (the process group's pairs, threads and
# buffers), what the strategy imports and runs (FSDP2 / DTensor; DeepSpeed's engine and its CPU
# accelerator with the shared-memory comm extension). Measured with the 1 M-parameter model, whose
# model, adapters and step are ~0.12 GiB of the peak: the ranks of all four strategies peak at
# 0.766-0.777 GiB (bench/results/planner-sharded.json) where one process of the same stack is
# planned at 0.742 GiB (measured 0.737-0.758: bench/results/planner-cpu.json).
CPU_RANK_EXTRA_BYTES = int(0.027 * GiB)


def plan_cpu_rank(base: dict, st: StackSpec, dist: DistConfig, ws: int, host_ram: int | None) -> dict:
    """One CPU rank's plan (no GPUs: `ws` rank processes on this host over gloo), rewritten from the
    one-process CPU plan `base`: the same transients (a rank computes its own micro-batch: loss,
    layer working set, loading) and its strategy's share of the static rows. Every rank loads the
    whole model first (the load phase is one process's); the host RAM budget is shared by the ranks."""
    plan = copy.deepcopy(base)
    # DeepSpeed's cast to 16 bits (_zero_rows) leaves the step's transients as planned for the upcast
    # model: measured (planner-sharded.json), ZeRO ranks 0.96-1.0 of this plan; planned as
    # precision.upcast_frozen=false (a 16-bit residual stream), 1.03-1.08
    rows = _cpu_rank_rows(base["components"], _sizes(st), st, dist.strategy, ws)
    budget = (host_ram or _dev.host_ram()) // ws
    _, _, by_phase = phase_peaks(lambda r: rows.get(r, {}).get("cpu", 0), "cpu")
    # loading is one process's: the whole model before any wrapping, no gathered units or buckets yet
    single_cpu = next(d for d in base["devices"] if d["device"] == "cpu")
    by_phase["load"] = single_cpu["peak_by_phase"]["load"] + CPU_RANK_EXTRA_BYTES
    fixed = sum(rows.get(r, {}).get("cpu", 0) for r in ("process_baseline", "offload_staging"))
    rows["load_transient"] = {
        "cpu": max(0, by_phase["load"] - fixed - sum(rows.get(r, {}).get("cpu", 0) for r in STATIC))
    }
    phase = max(by_phase, key=lambda k: by_phase[k])
    entry = device_entry("cpu", budget, by_phase[phase], phase)
    entry["peak_by_phase"] = by_phase
    entry["peak_allocated"] = allocated_peak(lambda r: rows.get(r, {}).get("cpu", 0))
    plan["components"] = {k: rows[k] for k in COMPONENTS if k in rows}
    plan["devices"] = [entry]
    plan["fits"] = entry["peak"] <= budget
    plan["peak_gib"] = round(entry["peak"] / GiB, 3)
    plan["peak_allocated_gib"] = peak_allocated_gib([entry])
    plan["ladder"] = []
    plan["notes"] = [*plan["notes"], _CPU_NOTES[dist.strategy].format(ws=ws), f"host RAM shared by {ws} ranks"]
    plan["stack"]["dist"] = dist.strategy
    plan["dist"] = {"strategy": dist.strategy, "world_size": ws, "ranks_per_node": ws, "cpu_ranks": True}
    return plan


_CPU_NOTES = {
    "ddp": "dist=ddp: one rank of {ws} on CPU, a full replica; 'offload staging' = DDP's gradient buckets",
    "fsdp": "dist=fsdp: one rank of {ws} on CPU; parameter shards, gradients and optimizer state 1/{ws} each; "
    "'offload staging' = all-gathered units (2 decoder layers + the root: embeddings, norm, lm_head)",
    "zero2": "dist=zero2: one rank of {ws} on CPU; whole 16-bit weights, fp32 master weights, gradients and "
    "optimizer state 1/{ws}; 'offload staging' = the 16-bit gradients before the reduce-scatter",
    "zero3": "dist=zero3: one rank of {ws} on CPU; 16-bit parameter partitions, fp32 master weights, gradients "
    "and optimizer state 1/{ws}; 'offload staging' = the gathered parameters (kept from forward to backward: "
    "stage3_max_reuse_distance) and the 16-bit gradients",
}


def _cpu_rank_rows(comps: dict, sizes: dict[str, int], st: StackSpec, strategy: str, ws: int) -> dict:
    """One CPU rank's bytes per component (all on "cpu"): the one-process transients (a rank
    computes its own micro-batch), the process baseline with the rank's extra, and the static rows
    as the strategy holds them."""
    rows: dict[str, dict[str, int]] = {}

    def cpu(row: str) -> int:
        return comps.get(row, {}).get("cpu", 0)

    for row in TRANSIENT:
        if row not in ("load_transient", "optimizer_scratch"):
            _put(rows, row, "cpu", cpu(row))
    _put(rows, "process_baseline", "cpu", cpu("process_baseline") + CPU_RANK_EXTRA_BYTES)
    _put(rows, "buffers", "cpu", cpu("buffers"))
    if strategy in ("zero2", "zero3"):
        _zero_rows(rows, cpu, sizes, st, strategy, ws)
        return rows
    k = ws if strategy == "fsdp" else 1
    _put(rows, "quantized_weights", "cpu", sizes["quant_data"] / k + sizes["quant_state"])
    for row in ("other_params", "lora_weights", "gradients", "optimizer_state", "optimizer_scratch"):
        _put(rows, row, "cpu", cpu(row) / k)
    # DDP: the reducer's flat gradient buckets; FSDP2: the all-gathered units
    _put(rows, "offload_staging", "cpu", cpu("gradients") if strategy == "ddp" else sizes["gathered"])
    return rows


def _zero_rows(rows: dict, cpu, sizes: dict[str, int], st: StackSpec, strategy: str, ws: int) -> None:
    """DeepSpeed's engine with bf16/fp16 on (the trainer passes precision's dtype) casts every float
    parameter to it (engine._cast_module_mixed_precision): the fp32 embeddings, norms, lm_head and
    adapters of k-bit prep become 2 bytes per element; the ZeRO optimizer keeps an fp32 master copy of
    this rank's partition of the trainable weights, their fp32 gradient partition and the optimizer
    state of that partition, and the 16-bit gradients until they are reduced. ZeRO-3 also partitions
    the parameters (the 4-bit data with them; the quantization state stays with each module) and
    gathers them to compute."""
    half = dtype_bytes(st.dtype) == 2
    lora_numel = cpu("lora_weights") // 4
    other = cpu("other_params") * 2 // st.frozen_bytes if half else cpu("other_params")
    lora_model = 2 * lora_numel if half else 4 * lora_numel
    k = ws if strategy == "zero3" else 1
    _put(rows, "quantized_weights", "cpu", sizes["quant_data"] / k + sizes["quant_state"])
    _put(rows, "other_params", "cpu", other / k)
    _put(rows, "lora_weights", "cpu", lora_model / k + (4 * lora_numel / ws if half else 0))
    _put(rows, "gradients", "cpu", 4 * lora_numel / ws)
    _put(rows, "optimizer_state", "cpu", cpu("optimizer_state") / ws)
    _put(rows, "optimizer_scratch", "cpu", cpu("optimizer_scratch") / ws)
    staging = lora_model  # the 16-bit gradients of the whole adapter before the reduce-scatter
    if strategy == "zero3":
        # gathered to compute, and with the shipped stage3_max_reuse_distance and
        # stage3_max_live_parameters (1e9 elements each) not released before backward reuses them:
        # for a model under 1e9 parameters, the whole model at 16 bits (measured: llama-50m's ranks
        # 0.6 % under this plan; without the gathered model they would be 4 % over)
        staging += sizes["quant_data"] + other + lora_model
    _put(rows, "offload_staging", "cpu", staging)
