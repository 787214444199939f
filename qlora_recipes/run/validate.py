"""Reject impossible stacks before anything is loaded or written. Each check raises one UserError line.

`check_config` needs only the composed config, the environment and the files it names (no torch:
`qlora train` runs it first, so a typo is reported in about a second); `validate` adds what depends on
the devices; `modelcheck.validate_model` what needs transformers (the model's type and module names).
"""

import dataclasses
import math
import os
import re
import shlex
from collections.abc import Mapping

from omegaconf import DictConfig

from ..config.schema import PACKING_STRATEGIES, PEFT_METHODS, QUANT_METHODS, TrainConfig, padding_free_on
from ..errors import UserError
from ..integrations.trackers import check as check_trackers
from ..invocation import command
from ..model.check import check_model_dir
from ..units import PRECISION_DTYPE, cfg_get, dtype_name

CHOICES = {
    "quant.method": QUANT_METHODS,
    "quant.storage_dtype": ("uint8", "bfloat16", "float16", "float32"),
    "peft.method": PEFT_METHODS,
    "precision.name": ("bf16", "fp16", "fp32"),
    "trainer.checkpointing_mode": ("non_reentrant", "reentrant"),
    "data.format": ("auto", "alpaca", "messages", "sharegpt", "prompt_completion", "text"),
    "data.too_long": ("truncate", "drop"),
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
# Every other numeric key: its range and, for the message, what it means or what to use instead.
# ">= 1": an integer count; "> 0": a positive number; "[0, 1)": a fraction; "|null": null allowed.
RANGES = {
    "trainer.max_steps": (">= -1", "-1 or 0: run trainer.epochs epochs"),
    "trainer.epochs": (">= 0", "passes over the data; used when trainer.max_steps is -1"),
    "trainer.eval_steps": (">= 0", "0: evaluate at the end only"),
    "trainer.save_steps": (">= 0", "0: save the adapter at the end only, no checkpoints"),
    "trainer.save_total_limit": (">= 0", "the newest checkpoints kept"),
    "trainer.memory_log_steps": (">= 1", "steps between memory samples"),
    "trainer.lm_eval_limit": (">= 1|null", "examples per lm-eval task; null: all"),
    "peft.r": (">= 1", "the LoRA rank"),
    "peft.dropout": ("[0, 1)", "the LoRA dropout probability"),
    "optim.lr": ("> 0", "the learning rate"),
    "optim.warmup_ratio": ("[0, 1)", "a fraction of the total steps"),
    "optim.warmup_steps": (">= 0", "steps of warmup; 0: use optim.warmup_ratio"),
    "optim.weight_decay": (">= 0", "the AdamW weight decay"),
    "optim.max_grad_norm": ("> 0", "the gradient-norm clipping threshold"),
    "optim.beta1": ("[0, 1)", "Adam's first-moment decay"),
    "optim.beta2": ("[0, 1)", "Adam's second-moment decay"),
    "quant.int8_threshold": (">= 0", "LLM.int8's outlier threshold"),
    "data.eval_fraction": ("[0, 1)", "the share of rows held out for eval"),
    "data.metric_examples": (">= 1", "eval rows the generation metric uses"),
    "model.lora_lr": ("> 0", "the default learning rate of this model"),
    "model.max_position_embeddings": (">= 1", "the model's context length"),
    "model.head_dim": (">= 1|null", "null: hidden_size / num_heads"),
    "hardware.gpus": (">= 0", "GPUs per node"),
    "hardware.nodes": (">= 1", "nodes"),
    "hardware.gpu_memory_gib": ("> 0|null", "each GPU's memory in GiB"),
    "hardware.host_ram_gib": ("> 0|null", "host RAM in GiB"),
    "hardware.timeout_min": (">= 1", "minutes a scheduler grants the job"),
    "seed": ("[0, 4294967296)", "the random seed (numpy takes 0 .. 2**32 - 1)"),
}
# The architecture figures of a conf/model option (a local config.json replaces them).
MODEL_FIGURES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")

# transformers 5.23 SchedulerType; the three in SCHEDULER_KWARGS need lr_scheduler_kwargs this
# repository does not pass, the two in SCHEDULER_EVAL an eval strategy (TrainingArguments checks).
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)
SCHEDULER_KWARGS = {
    "cosine_with_min_lr": "min_lr",
    "cosine_warmup_with_min_lr": "min_lr",
    "warmup_stable_decay": "num_decay_steps",
}
SCHEDULER_EVAL = ("reduce_lr_on_plateau", "greedy")
# transformers `optim` strings the planner knows how to size (planner/constants.OPTIMIZERS) and
# transformers 5.23 accepts (OptimizerNames); tests/test_bad_input_catalog.py keeps the two in step.
OPTIMIZERS = (
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
)
# transformers 5.23 attention implementations (ALL_ATTENTION_FUNCTIONS and eager), each also with the
# old `paged|` prefix; `org/name` is a hub kernel, which only loading can check.
ATTENTION = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "paged|eager",
)
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# Fault injection for tests (lifecycle.faults): QLORA_RECIPES_FAULTS="key=int,key=int".
FAULT_KEYS = (
    "oom_above_micro_batch",
    "nan_at_step",
    "sigterm_at_step",
    "preempt_at_step",
    "adapter_skew_rank",
)  # the last: dist.py


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


def check_config(cfg: DictConfig) -> None:
    """Every check that needs only the config, the environment and the files it names (no torch)."""
    check_environment()
    _check_resolves(cfg)
    extra = unknown_keys(cfg)
    if extra:
        raise UserError(
            f"unknown key {extra[0]}: no stack reads it; check the spelling (`{command()} --cfg job` prints every key)"
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
        raise UserError(f"data.metric={cfg.data.metric} is not a metric; use exact_match, or null for eval loss only")
    from ..data.chat import check_template_option

    check_template_option(cfg_get(cfg, "data.chat_template"))
    _check_ranges(cfg)
    _check_choices(cfg)
    _check_combinations(cfg)
    check_trackers(cfg.logger)  # the logger group: each tracker's package importable, its options valid
    check_model_dir(cfg.model)


def validate(cfg: DictConfig, gpu_available: bool, world_size: int | None = None) -> None:
    check_config(cfg)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    t = cfg.trainer
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
    if cfg_get(cfg, "hub.push", False):  # a repo id, a token and the hub in reach, before hours of training
        from ..integrations.hub import check_push

        check_push(cfg.hub.repo_id, cfg.hub.revision)


# ---------------------------------------------------------------------------------------------
# Ranges, choices, the environment and the model dir: checked before anything is written.
# ---------------------------------------------------------------------------------------------
def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """The environment values the run reads: torchrun's ranks and the fault-injection spec."""
    ranks = {}
    for name, low in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)):
        raw = environ.get(name)
        if raw is None:
            continue
        if not re.fullmatch(r"[0-9]+", raw.strip()) or int(raw) < low:
            raise UserError(
                f"environment: {name}={shlex.quote(raw)} is not an integer >= {low}; torchrun sets it for each "
                f"process, so for one process run `unset {name}`"
            )
        ranks[name] = int(raw)
    if ranks.get("RANK", 0) >= ranks.get("WORLD_SIZE", 1 << 30):
        raise UserError(f"environment: RANK={ranks['RANK']} is not below WORLD_SIZE={ranks['WORLD_SIZE']}; unset both")
    spec = environ.get("QLORA_RECIPES_FAULTS", "")
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if item and not (eq and key in FAULT_KEYS and re.fullmatch(r"[0-9]+", value)):
            raise UserError(
                f"environment: QLORA_RECIPES_FAULTS={shlex.quote(spec)}: {item!r} is not KEY=INTEGER with KEY one of "
                f"{', '.join(FAULT_KEYS)} (fault injection for tests); run `unset QLORA_RECIPES_FAULTS`"
            )


def _check_resolves(cfg: DictConfig) -> None:
    """Every `${...}` resolves now, not when config.yaml is written."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ..config.loader import one_line

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise UserError(one_line(err)) from None


def _range_ok(value, spec: str) -> bool:
    rule, _, nullable = spec.partition("|")
    if value is None:
        return bool(nullable)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if rule.startswith("["):  # [low, high)
        low, high = (float(x) for x in rule[1:-1].split(","))
        return low <= value < high
    op, bound = rule.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def _check_ranges(cfg: DictConfig) -> None:
    ranges = {**RANGES, **{f"model.{k}": (">= 1|null", "an architecture figure") for k in MODEL_FIGURES}}
    for key, (spec, meaning) in ranges.items():
        value = cfg_get(cfg, key)
        if _range_ok(value, spec):
            continue
        rule, _, nullable = spec.partition("|")
        want = f"in {rule}" if rule.startswith("[") else rule
        hint = ""
        if key == "optim.warmup_ratio" and isinstance(value, (int, float)) and value >= 1:
            hint = f"; for {int(value)} warmup steps set optim.warmup_steps={int(value)} instead"
        elif key == "optim.max_grad_norm":
            hint = "; a large value such as 1e9 turns clipping off"
        raise UserError(f"{key}={value} must be {want}{' or null' if nullable else ''} ({meaning}){hint}")


def _check_choices(cfg: DictConfig) -> None:
    """String keys whose valid values are a fixed set: the libraries' own sets where they decide."""
    o, attn = cfg.optim, str(cfg.model.attn_implementation)
    if o.scheduler not in SCHEDULERS:
        raise UserError(f"optim.scheduler={o.scheduler} is not an option; choose one of: {', '.join(SCHEDULERS)}")
    if o.scheduler in SCHEDULER_KWARGS:
        raise UserError(
            f"optim.scheduler={o.scheduler} needs lr_scheduler_kwargs ({SCHEDULER_KWARGS[o.scheduler]}), which this "
            "repository does not pass; use optim.scheduler=cosine (or linear, constant_with_warmup, ...)"
        )
    if o.name not in OPTIMIZERS:
        raise UserError(
            f"optim.name={o.name} is not an option; choose one of: {', '.join(OPTIMIZERS)} "
            "(or pick the group: optim=paged8bit|adamw8bit|paged32bit|adamw|adafactor)"
        )
    compute = cfg_get(cfg, "quant.compute_dtype")
    if dtype_name(compute) not in COMPUTE_DTYPES:
        raise UserError(f"quant.compute_dtype={compute} is not an option; choose one of: {', '.join(COMPUTE_DTYPES)}")
    if attn.removeprefix("paged|") not in ATTENTION and "/" not in attn:  # transformers strips paged|
        raise UserError(
            f"model.attn_implementation={attn} is not an option; choose one of: {', '.join(ATTENTION)} "
            "(or a hub kernel, org/name)"
        )
    _check_target_types(cfg_get(cfg, "peft.target_modules"), cfg_get(cfg, "peft.modules_to_save"))


def _check_target_types(targets, to_save) -> None:
    example = "'peft.target_modules=[q_proj,v_proj]'"
    if isinstance(targets, str):
        if targets == "all-linear":
            return
        if not targets.strip():
            raise UserError(f"peft.target_modules is empty; use peft.target_modules=all-linear or a list, {example}")
        try:
            re.compile(targets)
        except re.error as err:
            raise UserError(
                f"peft.target_modules={targets!r} is not a valid regular expression ({err}); "
                f"use all-linear or a list, {example}"
            ) from None
        return
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) and t.strip() for t in targets)):
        raise UserError(
            f"peft.target_modules={'null' if targets is None else repr(targets)} is not a module list; "
            "use peft.target_modules=all-linear, a list of "
            f"module names ({example}) or a regular expression over full module names"
        )
    if to_save is not None and not all(isinstance(t, str) and t.strip() for t in to_save):
        raise UserError(f"peft.modules_to_save={to_save!r}: give module names, e.g. 'peft.modules_to_save=[lm_head]'")


def _check_combinations(cfg: DictConfig) -> None:
    t, d, scheduler = cfg.trainer, cfg.data, cfg.optim.scheduler
    if t.save_steps > 0 and t.save_total_limit == 0:
        raise UserError(
            f"trainer.save_total_limit=0 with trainer.save_steps={t.save_steps}: transformers reads 0 as keep every "
            "checkpoint; keep the newest N with trainer.save_total_limit=N (N >= 1), or trainer.save_steps=0"
        )
    has_eval = d.eval_path not in (None, "") or d.eval_fraction > 0
    if scheduler in SCHEDULER_EVAL and (t.eval_steps <= 0 or not has_eval):
        raise UserError(
            f"optim.scheduler={scheduler} steps on the eval loss: set trainer.eval_steps=N (N >= 1) and keep an "
            "eval split (data.eval_fraction > 0 or data.eval_path)"
        )
    if t.eval_steps > 0 and not has_eval:
        # the trainer would skip every evaluation without a word (stack.sft_config turns it off)
        raise UserError(
            f"trainer.eval_steps={t.eval_steps} but the run has no eval split (data.eval_path is null and "
            "data.eval_fraction=0): hold out rows with data.eval_fraction=0.1 or set data.eval_path=FILE, or set "
            "trainer.eval_steps=0 to train without evaluation"
        )


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
    # No GPU: FSDP and ZeRO run as CPU ranks over gloo (tests/test_sharded.py); what still needs
    # GPUs is the kernels, NCCL and real device memory (README, Multi-GPU).
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
                f"dist={s} needs DeepSpeed, which is not installed (optional): pip install -r requirements-dist.txt"
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
