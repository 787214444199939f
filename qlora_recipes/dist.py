"""Several GPUs and several nodes: what a recipe's hardware node declares, how its ranks are
started, what each strategy adds to the trainer's arguments, and what one rank holds in memory.

- `declared_gpus` / `declared_host_ram`: the `hardware` node as the planner's inputs (bytes).
- `check_hardware_here`: one clear line when this machine lacks the GPUs a recipe is sized for.
- `launch_command`: `python train.py ...` for one process; `accelerate launch` (with the shipped
  config in launch/accelerate/) or `torchrun` for several, every rank in one run dir.
- `sft_kwargs`: the extra SFTConfig/TrainingArguments keywords of `dist.strategy`
  (DDP: no unused-parameter search; FSDP: fsdp=True + fsdp_config; ZeRO: the DeepSpeed json).
- `plan_stack`: memory.plan_stack for one rank, with the parameter sharding of FSDP / ZeRO-3
  applied (memory.py plans a full replica per GPU, which is right for DDP and ZeRO-2).

Nothing here imports torch, deepspeed or accelerate at import time.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any

from . import devices as _dev
from . import memory
from .errors import UserError

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("none", "ddp", "fsdp", "zero2", "zero3")
LAUNCHERS = ("accelerate", "torchrun")
SHARDED = ("fsdp", "zero3")  # strategies that shard the (4-bit) parameters across ranks
# A GPU counts as big enough when torch reports at least this share of the declared memory
# (driver and ECC reservations differ a little between boards of one model).
GPU_MEMORY_TOLERANCE = 0.98
# A recipe's name in messages: the `recipe` choice when known.
_RECIPE_KEY = "recipe"


# ---------------------------------------------------------------------------------------------
# The hardware node
# ---------------------------------------------------------------------------------------------
def _hw(cfg: Any) -> Any:
    return cfg.hardware


def declared_gpus(cfg: Any) -> list[int]:
    """The GPUs of one node as the planner's `gpus` argument (total bytes each); [] = CPU only."""
    hw = _hw(cfg)
    if hw.gpus <= 0:
        return []
    if not hw.gpu_memory_gib or hw.gpu_memory_gib <= 0:
        raise UserError(f"hardware.gpus={hw.gpus} without hardware.gpu_memory_gib: set the memory of each GPU in GiB")
    return [int(hw.gpu_memory_gib * GiB)] * int(hw.gpus)


def declared_host_ram(cfg: Any) -> int | None:
    """Host RAM of one node in bytes, or None (the planner then uses this machine's)."""
    ram = _hw(cfg).host_ram_gib
    return int(ram) * GiB if ram else None


def gpus_flag(cfg: Any) -> str:
    """The hardware node in scripts/plan.py's `--gpus` syntax (2x79GiB, or none)."""
    hw = _hw(cfg)
    return "none" if hw.gpus <= 0 else f"{hw.gpus}x{hw.gpu_memory_gib:g}GiB"


def ranks(cfg: Any) -> int:
    """Ranks the recipe runs with: one per GPU on every node, or 1 for dist.strategy=none."""
    hw = _hw(cfg)
    if cfg.dist.strategy == "none":
        return 1
    return max(1, hw.gpus) * max(1, hw.nodes)


def describe(cfg: Any) -> str:
    hw = _hw(cfg)
    if hw.gpus <= 0:
        return hw.name
    nodes = f" x {hw.nodes} nodes" if hw.nodes > 1 else ""
    return f"{hw.gpus} x {hw.gpu_memory_gib:g} GiB GPU{'s' if hw.gpus > 1 else ''}{nodes} ({hw.name})"


def check_hardware_here(cfg: Any, recipe: str, gpus_here: list[int] | None = None) -> None:
    """UserError (one line, pointing to `make plan-<recipe>`) unless this node has the GPUs the
    recipe's hardware node asks for: at least that many, each with at least that much memory."""
    hw = _hw(cfg)
    if hw.gpus <= 0:
        return
    here = _dev.detect_gpus() if gpus_here is None else list(gpus_here)
    want = int(hw.gpu_memory_gib * GiB) if hw.gpu_memory_gib else 0
    plan_hint = f"see its memory plan without a GPU: make plan-{recipe}"
    if len(here) < hw.gpus:
        have = "no CUDA GPU" if not here else f"{len(here)} GPU(s) of {', '.join(f'{g / GiB:.1f}' for g in here)} GiB"
        raise UserError(f"recipe {recipe} needs {describe(cfg)}; this machine has {have}; {plan_hint}")
    small = [(i, g) for i, g in enumerate(here[: hw.gpus]) if g < want * GPU_MEMORY_TOLERANCE]
    if small:
        i, g = small[0]
        raise UserError(
            f"recipe {recipe} needs {describe(cfg)}; cuda:{i} has {g / GiB:.1f} GiB; "
            f"{plan_hint} (or plan for this GPU: make plan ARGS='recipe={recipe}')"
        )


# ---------------------------------------------------------------------------------------------
# Trainer arguments per strategy
# ---------------------------------------------------------------------------------------------
def fsdp_config(cfg: Any) -> dict:
    """TrainingArguments.fsdp_config for FSDP2 + QLoRA; the same settings as
    launch/accelerate/fsdp_qlora.yaml (tests/test_dist.py checks they agree)."""
    d = cfg.dist
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # decoder layers: the model's _no_split_modules
        "reshard_after_forward": True,  # FULL_SHARD
        "cpu_offload": bool(d.offload_params),
        "cpu_ram_efficient_loading": bool(d.cpu_ram_efficient_loading),
        "state_dict_type": str(d.state_dict_type),
        # trainer.gradient_checkpointing does the recomputation; FSDP's own would be a second one
        "activation_checkpointing": False,
    }


def sft_kwargs(cfg: Any, world_size: int | None = None) -> dict:
    """Extra SFTConfig keywords for dist.strategy (merged into stack.sft_config's call)."""
    strategy = cfg.dist.strategy
    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if strategy == "ddp" or (strategy == "none" and ws > 1):
        # LoRA leaves most parameters frozen and checkpointing re-enters forward: no search for
        # unused parameters (it fails with reentrant checkpointing and costs a pass otherwise).
        return {"ddp_find_unused_parameters": False}
    if strategy == "fsdp":
        return {"fsdp": True, "fsdp_config": fsdp_config(cfg)}
    if strategy in ("zero2", "zero3"):
        return {"deepspeed": str(cfg.dist.deepspeed_config)}
    return {}


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------
def _rendezvous(cfg: Any) -> tuple[int, str, str]:
    """(node rank, master address, master port) for a multi-node run, from the environment."""
    addr = os.environ.get("MASTER_ADDR")
    rank = os.environ.get("NODE_RANK", os.environ.get("SLURM_NODEID"))
    if not addr or rank is None:
        raise UserError(
            f"hardware.nodes={cfg.hardware.nodes}: set MASTER_ADDR (the first node's address) and NODE_RANK "
            "(0, 1, ...) on every node, then run the same command on each"
        )
    return int(rank), addr, os.environ.get("MASTER_PORT", "29500")


def default_run_dir(recipe: str) -> str:
    """One run dir for every rank (Hydra's default has the time in it and would differ per rank)."""
    now = _dt.datetime.now()
    return str(REPO / "runs" / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}-{recipe}")


def launch_command(cfg: Any, recipe: str, overrides: list[str], python: str | None = None) -> list[str]:
    """The command that trains `recipe` with `overrides` on this node."""
    python = python or sys.executable
    train = [str(REPO / "train.py"), f"recipe={recipe}", *overrides]
    ws = ranks(cfg)
    if ws <= 1:
        return [python, *train]
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        train.append(f"hydra.run.dir={default_run_dir(recipe)}")
    hw, d = cfg.hardware, cfg.dist
    if d.launcher == "torchrun":
        cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(hw.gpus)]
        if hw.nodes > 1:
            rank, addr, port = _rendezvous(cfg)
            cmd += ["--nnodes", str(hw.nodes), "--node_rank", str(rank), "--master_addr", addr, "--master_port", port]
        else:
            cmd += ["--standalone"]
        return cmd + train
    if not d.accelerate_config:
        raise UserError(
            f"dist.launcher=accelerate needs dist.accelerate_config (a launch/accelerate/*.yaml) for dist={d.strategy}"
        )
    cmd = [
        python,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(d.accelerate_config),
        "--num_processes",
        str(ws),
        "--num_machines",
        str(hw.nodes),
    ]
    if hw.nodes > 1:
        rank, addr, port = _rendezvous(cfg)
        cmd += ["--machine_rank", str(rank), "--main_process_ip", addr, "--main_process_port", port]
    if d.strategy == "fsdp":
        cmd += ["--fsdp_offload_params", "true" if d.offload_params else "false"]
    return cmd + train


# ---------------------------------------------------------------------------------------------
# Per-rank memory plan under parameter sharding (FSDP, ZeRO-3)
# ---------------------------------------------------------------------------------------------
_TRANSIENT = ("activations", "layer_working", "logits_loss", "dequant_scratch", "optimizer_scratch", "eval_transient")


def plan_stack(
    cfg: Any,
    gpus: list[int] | None = None,
    host_ram: int | None = None,
    world_size: int | None = None,
    ladder: bool = True,
) -> dict:
    """memory.plan_stack for one rank of `dist.strategy`; for FSDP / ZeRO-3 the parameters are
    sharded across `world_size` ranks (default: the recipe's GPUs x nodes, or WORLD_SIZE)."""
    strategy = cfg.dist.strategy
    if world_size is None:
        env_ws = int(os.environ.get("WORLD_SIZE", "0") or 0)
        world_size = env_ws or ranks(cfg)
    if strategy not in SHARDED or world_size <= 1:
        plan = memory.plan_stack(cfg, gpus=gpus, host_ram=host_ram, world_size=world_size, ladder=ladder)
        plan["dist"] = {"strategy": strategy, "world_size": world_size}
        return plan
    base = memory.plan_stack(cfg, gpus=gpus, host_ram=host_ram, world_size=world_size, ladder=False)
    st = memory.stack_from_cfg(cfg, world_size)
    gpus_here = len(gpus) if gpus is not None else len(_dev.detect_gpus())
    per_node = max(1, min(world_size, gpus_here or world_size))  # ranks sharing one host's RAM
    plan = _sharded(base, st, world_size, per_node, cfg, offload=bool(cfg.dist.offload_params), host_ram=host_ram)
    if ladder and not plan["fits"] and not cfg.dist.offload_params and strategy == "fsdp":
        alt = _sharded(base, st, world_size, per_node, cfg, offload=True, host_ram=host_ram)
        worst = max((d for d in alt["devices"] if d["device"] != "disk"), key=lambda d: d["peak"] / d["budget"])
        cost, note = memory.COSTS["cpu_offload"]
        plan["ladder"] = [
            {
                "change": "cpu_offload",
                "adds": "dist.offload_params=true",
                "overrides": "dist.offload_params=true",
                "peak_gib": alt["peak_gib"],
                "worst_device": worst["device"],
                "worst_peak_gib": round(worst["peak"] / GiB, 3),
                "headroom_pct": worst["headroom_pct"],
                "fits": alt["fits"],
                "cost": cost,
                "cost_note": note,
            }
        ]
    return plan


def _sharded(base: dict, st: Any, ws: int, ranks_here: int, cfg: Any, offload: bool, host_ram: int | None) -> dict:
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
        raise UserError(f"dist={cfg.dist.strategy} needs GPUs: declare them in the hardware node (hardware.gpus)")
    dev = gpu_devs[0]["device"]
    gpu_budget = gpu_devs[0]["budget"]
    host_budget = host_ram or _dev.host_ram()
    bbs = memory.block_bytes(st)
    quant_data = sum(bb.quant_data for _, bb in bbs)
    quant_state = sum(bb.quant_state for _, bb in bbs)
    other = sum(bb.other for _, bb in bbs)
    buffers = sum(bb.buffers for _, bb in bbs)
    lora = sum(4 * bb.lora_numel for _, bb in bbs)
    comps = base["components"]
    optim_state = sum(comps.get("optimizer_state", {}).values())
    grads = sum(comps.get("gradients", {}).values())
    layer_units = [bb.quant_data + bb.other + 4 * bb.lora_numel for blk, bb in bbs if blk.is_layer]
    tail = sum(bb.quant_data + bb.other + 4 * bb.lora_numel for blk, bb in bbs if blk.name in ("lm_head", "model.norm"))
    gathered = 2 * max(layer_units, default=0) + tail
    full_at_load = sum(bb.quant_data + bb.quant_state + bb.other_at_load + bb.buffers for _, bb in bbs)

    new: dict[str, dict[str, int]] = {}

    def put(row: str, device: str, value: float) -> None:
        if value:
            new.setdefault(row, {})[device] = new.get(row, {}).get(device, 0) + int(value)

    holder = "cpu" if offload else dev
    put("quantized_weights", holder, quant_data / ws * (ranks_here if offload else 1))
    put("quantized_weights", dev, quant_state)
    put("other_params", holder, other / ws * (ranks_here if offload else 1))
    put("buffers", dev, buffers)
    put("lora_weights", holder, lora / ws * (ranks_here if offload else 1))
    put("gradients", holder, grads / ws * (ranks_here if offload else 1))
    put("optimizer_state", holder, optim_state / ws * (ranks_here if offload else 1))
    for row in _TRANSIENT:
        if row == "optimizer_scratch":  # per trainable element of the shard, where the step runs
            put(row, holder, comps.get(row, {}).get(dev, 0) / ws * (ranks_here if offload else 1))
        else:
            put(row, dev, comps.get(row, {}).get(dev, 0))
    put("offload_staging", dev, gathered)  # the all-gathered units
    put("cuda_context", dev, memory.CUDA_CONTEXT_BYTES)
    put("process_baseline", "cpu", memory.CPU_PROCESS_BASELINE_BYTES * ranks_here)

    static_rows = ("quantized_weights", "other_params", "buffers", "lora_weights", "gradients", "optimizer_state")
    fixed_rows = ("cuda_context", "process_baseline", "offload_staging")
    load_on_cpu = bool(cfg.dist.load_on_cpu)
    devices = []
    for name, budget in ((dev, gpu_budget), ("cpu", host_budget)):
        static = sum(new.get(r, {}).get(name, 0) for r in static_rows)
        fixed = sum(new.get(r, {}).get(name, 0) for r in fixed_rows)
        row = lambda r, n=name: new.get(r, {}).get(n, 0)  # noqa: E731
        act = row("activations")
        phases = {
            "train: loss": act + row("logits_loss"),
            "train: layer backward": act + row("layer_working") + row("dequant_scratch"),
            "optimizer step": row("optimizer_scratch"),
            "eval": row("eval_transient"),
        }
        by_phase = {
            k: int(
                fixed + static + v + memory.ALLOCATOR_STATIC_FRACTION * static + memory.ALLOCATOR_DYNAMIC_FRACTION * v
            )
            for k, v in phases.items()
        }
        # loading: the whole quantized base per rank, on the GPU or (load_on_cpu) in host RAM
        if name == dev and not load_on_cpu:
            by_phase["load"] = int(memory.CUDA_CONTEXT_BYTES + full_at_load)
        if name == "cpu":
            base_rss = memory.CPU_PROCESS_BASELINE_BYTES * ranks_here
            by_phase["load"] = int(base_rss + (full_at_load * ranks_here if load_on_cpu else 0))
        phase = max(by_phase, key=lambda k: by_phase[k])
        peak = by_phase[phase]
        if phase != "load":
            put(
                "allocator_overhead",
                name,
                memory.ALLOCATOR_STATIC_FRACTION * static + memory.ALLOCATOR_DYNAMIC_FRACTION * phases[phase],
            )
        devices.append(
            {
                "device": name,
                "budget": int(budget),
                "peak": int(peak),
                "headroom": int(budget - peak),
                "headroom_pct": round(100.0 * (budget - peak) / budget, 2) if budget else 0.0,
                "peak_phase": phase,
                "peak_by_phase": by_phase,
            }
        )
    plan["components"] = {k: new[k] for k in memory.COMPONENTS if k in new}
    plan["devices"] = devices
    plan["fits"] = all(d["peak"] <= d["budget"] for d in devices)
    plan["peak_gib"] = round(devices[0]["peak"] / GiB, 3)
    plan["ladder"] = []
    plan["device_map"] = {"": f"{cfg.dist.strategy} shard {ws} ways"}
    where = "host RAM (offload_params)" if offload else dev
    plan["notes"] = [n for n in plan["notes"] if "every data-parallel rank" not in n] + [
        f"dist={cfg.dist.strategy}: one rank of {ws}; parameter shards, gradients and optimizer state (1/{ws} each) "
        f"in {where}; 'offload staging' = all-gathered units (2 decoder layers + lm_head/norm)",
        f"load phase: each rank loads the whole quantized base ({full_at_load / GiB:.1f} GiB) "
        f"{'in host RAM' if load_on_cpu else 'on its GPU'} before sharding",
    ]
    if cfg.dist.strategy == "fsdp" and offload:
        plan["notes"].append("dist.offload_params: the optimizer step runs on the CPU (FSDP CPUOffloadPolicy)")
    plan["stack"]["dist"] = cfg.dist.strategy
    plan["dist"] = {
        "strategy": cfg.dist.strategy,
        "world_size": ws,
        "ranks_per_node": ranks_here,
        "offload_params": offload,
        "load_on_cpu": load_on_cpu,
    }
    return plan
