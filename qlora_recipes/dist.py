"""The `dist` group: what each strategy adds to the trainer's arguments, and the command that
starts a recipe's ranks. `strategy_kwargs` gives the extra SFTConfig/TrainingArguments keywords of
`dist.strategy` (DDP: no unused-parameter search; FSDP: fsdp=True + fsdp_config; ZeRO: the
DeepSpeed json); `launch_command` gives `python train.py ...` for one process, and `accelerate
launch` (with the shipped config in launch/accelerate/) or `torchrun` for several, every rank in one
run dir. What one rank holds in memory is the planner's (qlora_recipes/planner); the hardware node
is read in devices.py. Nothing here imports torch, deepspeed or accelerate at import time.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path
from typing import Any

from . import devices as _dev
from .errors import UserError


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


def strategy_kwargs(cfg: Any, world_size: int | None = None) -> dict:
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
    """One run dir for every rank (Hydra's default has the time in it and would differ per rank);
    under ./runs like Hydra's own."""
    now = _dt.datetime.now()
    return str(Path.cwd() / "runs" / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}-{recipe}")


def launch_command(cfg: Any, recipe: str, overrides: list[str], python: str | None = None) -> list[str]:
    """The command that trains `recipe` with `overrides` on this node: `qlora train` as a module, so
    it runs the same from a checkout or an installed wheel, from any directory."""
    python = python or sys.executable
    train = ["-m", "qlora_recipes", "train", f"recipe={recipe}", *overrides]
    ws = _dev.ranks(cfg)
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
    if d.deepspeed_config:  # absolute, so the ranks need not start in the repository
        cmd += ["--deepspeed_config_file", str(d.deepspeed_config)]
    return cmd + train
