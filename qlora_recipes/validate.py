"""Reject impossible stacks before anything is loaded. Each check raises one UserError line."""

import dataclasses
import os

from omegaconf import DictConfig

from .errors import UserError
from .schema import TrainConfig

CHOICES = {
    "quant.method": ("nf4", "fp4", "int8", "none"),
    "quant.storage_dtype": ("uint8", "bfloat16", "float16", "float32"),
    "peft.method": ("lora", "dora", "rslora"),
    "precision.name": ("bf16", "fp16", "fp32"),
    "trainer.checkpointing_mode": ("non_reentrant", "reentrant"),
    "data.format": ("auto", "alpaca", "messages", "prompt_completion", "text"),
    "offload.device_map": (None, "auto"),
}
PRECISION_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
POSITIVE = ("trainer.micro_batch_size", "trainer.grad_accum", "trainer.eval_batch_size", "trainer.seq_len",
            "trainer.logging_steps", "peft.r", "peft.alpha", "optim.lr", "data.max_new_tokens")


def _get(cfg: DictConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def unknown_keys(cfg: DictConfig, schema: type = TrainConfig, prefix: str = "") -> list[str]:
    """Keys added with `+key=value` that no schema field reads (they would be ignored silently)."""
    fields = {f.name: f.type for f in dataclasses.fields(schema)}
    found = []
    for key in cfg:
        if key not in fields:
            found.append(prefix + str(key))
        elif dataclasses.is_dataclass(fields[key]):
            found += unknown_keys(cfg[key], fields[key], f"{prefix}{key}.")
    return found


def validate(cfg: DictConfig, gpu_available: bool, world_size: int | None = None) -> None:
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    extra = unknown_keys(cfg)
    if extra:
        raise UserError(f"unknown key {extra[0]}: no stack reads it; check the spelling (`python train.py --cfg job` prints every key)")
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            names = ", ".join(str(a) for a in allowed)
            raise UserError(f"{key}={value} is not an option; choose one of: {names}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise UserError(f"{key}={_get(cfg, key)} must be positive")
    t = cfg.trainer
    if t.max_steps <= 0 and t.epochs <= 0:
        raise UserError("trainer.max_steps and trainer.epochs are both <= 0: set one of them")
    if not 0 <= cfg.peft.dropout < 1:
        raise UserError(f"peft.dropout={cfg.peft.dropout} must be in [0, 1)")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise UserError(f"data.eval_fraction={cfg.data.eval_fraction} must be in [0, 1)")
    if cfg.data.metric not in (None, "exact_match"):
        raise UserError(f"data.metric={cfg.data.metric} is not a metric; use exact_match or null")
    p = cfg.precision
    if PRECISION_DTYPE[p.name] != p.dtype:
        raise UserError(f"precision.dtype={p.dtype} contradicts precision={p.name}; pick precision=bf16|fp16|fp32 instead")
    if p.name == "fp16" and not gpu_available:
        raise UserError("precision=fp16 needs a CUDA GPU (CPU autocast has no fp16 loss scaling); use precision=bf16 or fp32 here")
    if p.name == "bf16" and gpu_available:
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise UserError("precision=bf16: this GPU has no bfloat16 support (pre-Ampere); use precision=fp16")
    o = cfg.offload
    if o.device_map == "auto" and not o.max_memory:
        raise UserError("offload.device_map=auto without offload.max_memory: use offload=cpu or set budgets")
    if o.disk and not o.folder:
        raise UserError("offload=disk needs an offload folder: set offload.folder=PATH (relative paths land in the run dir)")
    if o.disk and o.device_map != "auto":
        raise UserError("offload=disk needs offload.device_map=auto so accelerate can place layers on disk")
    if o.device_map == "auto" and world_size > 1:
        raise UserError(
            f"offload={'disk' if o.folder else 'cpu'} (device_map=auto) cannot run under {world_size} processes: "
            "each DDP/FSDP rank must hold its whole replica; use offload=none with torchrun"
        )
    if cfg.quant.method == "none" and cfg.quant.storage_dtype != "uint8":
        raise UserError("quant.storage_dtype only applies to 4-bit quantization; drop it or use quant=nf4")
