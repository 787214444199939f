"""Reject impossible stacks before anything is loaded. Each check raises one UserError line."""

import dataclasses
import os

from omegaconf import DictConfig

from .errors import UserError
from .schema import PACKING_STRATEGIES, PEFT_METHODS, QUANT_METHODS, TrainConfig, padding_free_on
from .units import PRECISION_DTYPE, cfg_get

CHOICES = {
    "quant.method": QUANT_METHODS,
    "quant.storage_dtype": ("uint8", "bfloat16", "float16", "float32"),
    "peft.method": PEFT_METHODS,
    "precision.name": ("bf16", "fp16", "fp32"),
    "trainer.checkpointing_mode": ("non_reentrant", "reentrant"),
    "data.format": ("auto", "alpaca", "messages", "prompt_completion", "text"),
    "data.packing_strategy": PACKING_STRATEGIES,
    "offload.device_map": (None, "auto"),
}
POSITIVE = (
    "trainer.micro_batch_size",
    "trainer.grad_accum",
    "trainer.eval_batch_size",
    "trainer.seq_len",
    "trainer.logging_steps",
    "peft.r",
    "peft.alpha",
    "optim.lr",
    "data.max_new_tokens",
)


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
        raise UserError(
            f"unknown key {extra[0]}: no stack reads it; check the spelling (`python train.py --cfg job` prints every key)"
        )
    for key, allowed in CHOICES.items():
        value = cfg_get(cfg, key)
        if value not in allowed:
            names = ", ".join(str(a) for a in allowed)
            raise UserError(f"{key}={value} is not an option; choose one of: {names}")
    for key in POSITIVE:
        value = cfg_get(cfg, key)
        if value is None or value <= 0:
            raise UserError(f"{key}={value} must be positive")
    t = cfg.trainer
    if t.max_steps <= 0 and t.epochs <= 0:
        raise UserError("trainer.max_steps and trainer.epochs are both <= 0: set one of them")
    if not 0 <= cfg.peft.dropout < 1:
        raise UserError(f"peft.dropout={cfg.peft.dropout} must be in [0, 1)")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise UserError(f"data.eval_fraction={cfg.data.eval_fraction} must be in [0, 1)")
    if cfg.data.metric not in (None, "exact_match"):
        raise UserError(f"data.metric={cfg.data.metric} is not a metric; use exact_match or null")
    _check_padding_free(cfg, gpu_available)
    p = cfg.precision
    if PRECISION_DTYPE[p.name] != p.dtype:
        raise UserError(
            f"precision.dtype={p.dtype} contradicts precision={p.name}; pick precision=bf16|fp16|fp32 instead"
        )
    if p.name == "fp16" and not gpu_available:
        raise UserError(
            "precision=fp16 needs a CUDA GPU (CPU autocast has no fp16 loss scaling); use precision=bf16 or fp32 here"
        )
    if p.name == "bf16" and gpu_available:
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise UserError("precision=bf16: this GPU has no bfloat16 support (pre-Ampere); use precision=fp16")
    if t.activation_offloading and not gpu_available:
        # TRL's offloader asks torch for the accelerator and fails in SFTTrainer's __init__ without one
        raise UserError(
            "trainer.activation_offloading=true needs a CUDA GPU (it moves saved activations from the GPU to "
            "host RAM); drop it on this machine"
        )
    _check_liger(t.liger, gpu_available)
    o = cfg.offload
    if o.device_map == "auto" and not o.max_memory:
        raise UserError("offload.device_map=auto without offload.max_memory: use offload=cpu or set budgets")
    if o.disk and not o.folder:
        raise UserError(
            "offload=disk needs an offload folder: set offload.folder=PATH (relative paths land in the run dir)"
        )
    if o.disk and o.device_map != "auto":
        raise UserError("offload=disk needs offload.device_map=auto so accelerate can place layers on disk")
    if o.device_map == "auto" and world_size > 1:
        raise UserError(
            f"offload={'disk' if o.folder else 'cpu'} (device_map=auto) cannot run under {world_size} processes: "
            "each DDP/FSDP rank must hold its whole replica; use offload=none with torchrun"
        )
    if t.lm_eval_tasks:
        from .metrics import lm_eval_available

        if not lm_eval_available():
            raise UserError(
                "trainer.lm_eval_tasks is set but lm-eval-harness is not installed: pip install lm-eval, or drop the key"
            )
    if cfg.peft.method == "dora" and cfg.quant.method == "int8":
        # peft's DoRA weight norm needs the dequantized base; with LLM.int8 layers bitsandbytes
        # 0.50 fails in MatMul8bitFp (seen on CPU): a traceback after minutes of loading.
        raise UserError(
            "peft=dora does not work over quant=int8 (bitsandbytes 8-bit matmul fails); use quant=nf4 or peft=lora"
        )
    if cfg.quant.method == "none" and cfg.quant.storage_dtype != "uint8":
        raise UserError("quant.storage_dtype only applies to 4-bit quantization; drop it or use quant=nf4")
    validate_hardware(cfg)
    validate_dist(cfg, gpu_available, world_size)


# ---------------------------------------------------------------------------------------------
# Hardware node and distributed strategies (conf/dist, launch/). Each rejected combination names
# the library thread that shows it failing.
# ---------------------------------------------------------------------------------------------
DIST_STRATEGIES = ("none", "ddp", "fsdp", "zero2", "zero3")
DIST_LAUNCHERS = ("accelerate", "torchrun")
FSDP_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


# Attention implementations that keep the flattened sequences of a padding-free row apart: flash
# kernels read the collator's cu_seq_lens; for these, transformers' create_causal_mask builds a
# block-diagonal mask from position_ids (masking_utils.find_packed_sequence_indices; training only:
# TRL's compute_loss passes use_cache=False and no attention_mask).
POSITION_IDS_MASKED = ("sdpa", "eager", "flex_attention")


def _check_padding_free(cfg: DictConfig, gpu_available: bool) -> None:
    """data.padding_free / packing: what TRL 1.16 and the attention backend can train correctly."""
    d, attn = cfg.data, str(cfg.model.attn_implementation)
    if d.padding_free and not d.packing:
        # SFTTrainer.__init__ raises: without packing max_length (= trainer.seq_len) is not enforced
        raise UserError(
            "data.padding_free=true without data.packing: TRL cannot cut rows to trainer.seq_len then; "
            "add data.packing=true (data.packing_strategy=bfd is padding-free by itself)"
        )
    if not padding_free_on(d):
        return
    why = "data.padding_free" if d.padding_free else f"data.packing_strategy={d.packing_strategy}"
    if "flash" in attn:
        if not gpu_available:
            raise UserError(
                f"{why}: model.attn_implementation={attn} needs a CUDA GPU; use model.attn_implementation=sdpa "
                "here (transformers masks the packed sequences apart from their position_ids)"
            )
    elif attn not in POSITION_IDS_MASKED:
        raise UserError(
            f"{why}: model.attn_implementation={attn} does not keep packed sequences apart (they would attend "
            "to each other); use model.attn_implementation=flash_attention_2 (GPU) or sdpa"
        )


def _check_liger(wanted: bool, gpu_available: bool) -> None:
    """Liger's kernels are Triton: CUDA only, and an optional package (requirements-gpu.txt)."""
    if not wanted:
        return
    if not gpu_available:
        raise UserError("trainer.liger=true needs a CUDA GPU (Liger's kernels are Triton); drop it on this machine")
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError("trainer.liger=true needs liger-kernel: pip install -r requirements-gpu.txt")


def _bnb_optimizer(name: str) -> bool:
    """bitsandbytes optimizers: 8-bit state and/or paged (CUDA managed) memory."""
    return "8bit" in name or name.startswith("paged")


def validate_hardware(cfg: DictConfig) -> None:
    hw = cfg.hardware
    if hw.gpus < 0 or hw.nodes < 1 or hw.timeout_min <= 0:
        raise UserError(
            f"hardware: gpus={hw.gpus}, nodes={hw.nodes}, timeout_min={hw.timeout_min}; "
            "need gpus >= 0 (per node), nodes >= 1, timeout_min > 0"
        )
    if hw.gpus > 0 and not (hw.gpu_memory_gib and hw.gpu_memory_gib > 0):
        raise UserError(f"hardware.gpus={hw.gpus} needs hardware.gpu_memory_gib (each GPU's memory in GiB, e.g. 79)")
    if hw.host_ram_gib is not None and hw.host_ram_gib <= 0:
        raise UserError(f"hardware.host_ram_gib={hw.host_ram_gib} must be positive (GiB) or null")
    if not hw.bf16 and cfg.precision.name == "bf16":
        raise UserError(
            f"precision=bf16 but hardware {hw.name!r} has no bfloat16 (pre-Ampere, e.g. T4, V100): use precision=fp16"
        )


def validate_dist(cfg: DictConfig, gpu_available: bool, world_size: int) -> None:
    """Combinations of dist.strategy with the stack that cannot work, before anything launches."""
    import importlib.util
    import json
    from pathlib import Path

    d, q = cfg.dist, cfg.quant
    s = d.strategy
    if s not in DIST_STRATEGIES:
        raise UserError(f"dist.strategy={s} is not an option; choose one of: {', '.join(DIST_STRATEGIES)}")
    if d.launcher not in DIST_LAUNCHERS:
        raise UserError(f"dist.launcher={d.launcher} is not an option; choose one of: {', '.join(DIST_LAUNCHERS)}")
    if d.state_dict_type not in FSDP_STATE_DICT_TYPES:
        raise UserError(f"dist.state_dict_type={d.state_dict_type}; choose one of: {', '.join(FSDP_STATE_DICT_TYPES)}")
    if s == "none":
        return
    if cfg.offload.device_map == "auto":
        # The existing WORLD_SIZE check, also when a single process is started with a strategy.
        raise UserError(
            f"offload={'disk' if cfg.offload.folder else 'cpu'} (device_map=auto) cannot run under dist={s}: "
            "each rank must hold its own replica or shard; use offload=none"
            + (" (FSDP moves shards to host RAM with dist.offload_params=true)" if s == "fsdp" else "")
        )
    if s in ("fsdp", "zero2", "zero3") and not gpu_available:
        raise UserError(f"dist={s} needs CUDA GPUs; on this machine use dist=none or dist=ddp (gloo)")
    four_bit = q.method in ("nf4", "fp4")
    if s in ("fsdp", "zero3") and q.method == "int8":
        # FSDP: "Must flatten tensors with uniform dtype but got torch.float16 and torch.int8"
        # (bitsandbytes issue 1709); ZeRO-3 cannot partition Int8Params (bigcode starcoder issue 96).
        raise UserError(
            f"dist={s} cannot shard an int8 (LLM.int8) base; "
            f"use quant=nf4 with quant.storage_dtype={cfg.precision.dtype}"
        )
    if s in ("fsdp", "zero3") and four_bit and q.storage_dtype != cfg.precision.dtype:
        # FSDP shards only floating tensors of one dtype per unit: uint8 storage fails ("Cannot
        # flatten integer dtype tensors", peft issue 1432; bitsandbytes PR 970) or, under FSDP2,
        # is silently left unsharded on every rank (accelerate issue 3983); a float storage of
        # another dtype fails to flatten with the rest (transformers PR 29587 sets the mixed
        # precision policy from bnb_4bit_quant_storage). ZeRO-3 + QLoRA needs the same
        # (peft docs, "Use PEFT QLoRA and DeepSpeed with ZeRO3").
        raise UserError(
            f"dist={s} with a 4-bit base needs quant.storage_dtype={cfg.precision.dtype} (the compute dtype), "
            f"not {q.storage_dtype}: set quant.storage_dtype={cfg.precision.dtype}"
        )
    if s == "fsdp" and _bnb_optimizer(cfg.optim.name):
        # bitsandbytes 8-bit / paged optimizers on FSDP-sharded flat parameters: bitsandbytes
        # issue 89 (open), LlamaFactory issue 5619, pytorch/ao issue 1213 (PagedAdamW and FSDP2),
        # bitsandbytes issue 2080 (state precision depends on the shard layout).
        raise UserError(
            f"dist=fsdp cannot use optim.name={cfg.optim.name} (bitsandbytes 8-bit/paged state does not work on "
            "FSDP shards); use optim=adamw (the sharded LoRA state is small)"
        )
    if s == "zero3" and d.offload_params and cfg.optim.name != "adamw_torch":
        # With offload_optimizer DeepSpeed runs its own CPU AdamW (the json's optimizer section);
        # a trainer optimizer would be ignored or refused ("ZeRO-Offload with a client optimizer").
        raise UserError(
            f"dist=zero3 offloads the optimizer to DeepSpeed's CPU AdamW; optim.name={cfg.optim.name} would be "
            "ignored: use optim=adamw"
        )
    if s in ("zero2", "zero3"):
        if importlib.util.find_spec("deepspeed") is None:
            raise UserError(
                f"dist={s} needs DeepSpeed, which is not installed (and not in requirements.txt): pip install deepspeed"
            )
        path = Path(str(d.deepspeed_config or ""))
        if not d.deepspeed_config or not path.is_file():
            raise UserError(f"dist.deepspeed_config={d.deepspeed_config}: no such file; use one in launch/deepspeed/")
        try:
            json.loads(path.read_text())
        except ValueError as err:
            raise UserError(f"dist.deepspeed_config={path}: not valid JSON ({err})") from None
    if d.launcher == "accelerate" and (not d.accelerate_config or not Path(str(d.accelerate_config)).is_file()):
        raise UserError(
            f"dist.accelerate_config={d.accelerate_config}: no such file; "
            "use one in launch/accelerate/ or dist.launcher=torchrun"
        )
