"""peft.adapter_dtype=auto (the default): the adapters train in the compute dtype where the run computes
in bf16, as TRL's trainers and the QLoRA paper train a 4-bit base's adapters, and in float32 otherwise
(fp32 compute; fp16 compute, whose adapters would need a grad scaler of their own). bf16 adapters are
planned and tested with the 8-bit bitsandbytes optimizers, LoRA or rsLoRA, in one process
(config/checks.py refuses an explicit bfloat16 elsewhere): auto keeps float32 outside that.

Measured (NVIDIA H200, 8B shape at 2,048 tokens, NF4 + paged 8-bit AdamW + checkpointing, bf16 compute):
0.580 s/step with bf16 adapters against 0.669 with fp32 ones, the plain TRL script's 0.577
(bench/results/nvidia-h200-2026-11-28-gpu-check.md); the loss within noise of fp32 adapters
(bench/results/lean-effect-adapter-dtype-*.md).

The planner resolves auto for the precision it plans (after precision=auto re-picks for the GPUs
planned for); a run settles its config once, before its checks, plan and config.yaml, so the plan, the
loaded model and what is recorded say the same dtype.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schema import TrainConfig

AUTO = "auto"
BF16_ADAPTER_OPTIMS = ("paged_adamw_8bit", "adamw_bnb_8bit", "adamw_8bit")  # their state ignores the dtype


def bf16_allowed(cfg: TrainConfig, world_size: int) -> bool:
    """Whether this stack trains bf16 adapters as planned and tested: an 8-bit bitsandbytes optimizer,
    LoRA or rsLoRA (DoRA's magnitude trains in fp32), one process."""
    one_process = cfg.dist.strategy == "none" and world_size <= 1
    return cfg.optim.name in BF16_ADAPTER_OPTIMS and cfg.peft.method != "dora" and one_process


def adapter_dtype(cfg: TrainConfig, world_size: int | None = None) -> str:
    """peft.adapter_dtype as the run trains it: auto resolved for cfg's precision and `world_size`
    processes (default: WORLD_SIZE, as torchrun sets it), an explicit dtype as it is."""
    value = str(cfg.peft.adapter_dtype)
    if value != AUTO:
        return value
    ranks = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    return "bfloat16" if cfg.precision.name == "bf16" and bf16_allowed(cfg, ranks) else "float32"


def settled(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """cfg with peft.adapter_dtype=auto resolved (adapter_dtype); otherwise cfg itself."""
    if cfg.peft.adapter_dtype != AUTO:
        return cfg
    return replace(cfg, peft=replace(cfg.peft, adapter_dtype=adapter_dtype(cfg, world_size)))
