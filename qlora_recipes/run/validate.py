"""Reject impossible stacks before anything is loaded or written. Each check raises one UserError line.

`check_config` needs only the typed config, the environment and the files it names (no torch:
`qlora train` runs it first, so a typo is reported in about a second): config/checks.py `check_stack`
(the config on its own, which `qlora plan` runs too) plus the environment, the chat template, the
trackers' packages and the model dir. `validate` adds what depends on the devices;
`model.check.validate_model` what needs transformers (the model's type and module names).
"""

import os
import re
import shlex
from collections.abc import Mapping

from ..config.attention import VARLEN, varlen_blocker
from ..config.checks import check_stack
from ..config.schema import ATTENTION, FSDP_STATE_DICT_TYPES, OPTIMIZERS, SCHEDULERS, TrainConfig, padding_free_on  # noqa: F401 - the valid sets, named here too
from ..errors import UserError
from ..integrations.trackers import check as check_trackers
from ..model.check import check_model_dir

# Fault injection for tests (preemption.faults): QLORA_RECIPES_FAULTS="key=int,key=int".
FAULT_KEYS = (
    "oom_above_micro_batch",
    "nan_at_step",
    "sigterm_at_step",
    "preempt_at_step",
    "eval_wait_s",
    "nan_grads_at_step",
    "adapter_skew_rank",
    "fault_rank",
    "sigkill_at_step",
)  # adapter_skew_rank: dist.py; the others: preemption.py


def check_config(cfg: TrainConfig) -> None:
    """Every check that needs only the config, the environment and the files it names (no torch)."""
    check_environment()
    check_stack(cfg)
    from ..data.chat import check_template_option

    check_template_option(cfg.data.chat_template)
    check_trackers(cfg.logger)  # the logger group: each tracker's package importable, its options valid
    check_model_dir(cfg.model)


def _check_host_embeddings(cfg: TrainConfig, gpu_available: bool) -> None:
    """offload.embeddings: a GPU to keep them off, and a table no output head shares."""
    if not cfg.offload.embeddings:
        return
    if not gpu_available:
        raise UserError("offload.embeddings=true needs a CUDA GPU (it keeps the embeddings off it); drop it here")
    from ..planner import model_figures

    if model_figures(cfg.model).tie_embeddings:
        raise UserError(
            f"offload.embeddings=true: {cfg.model.name_or_path} ties its input embeddings to the LM head, which "
            "the loss needs on the GPU; drop it for this model"
        )


def validate(cfg: TrainConfig, gpu_available: bool, world_size: int | None = None) -> None:
    """check_config, then what depends on the devices and the number of processes."""
    check_config(cfg)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    t = cfg.trainer
    _check_padding_free(cfg, gpu_available)
    p = cfg.precision
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
    _check_host_embeddings(cfg, gpu_available)
    o = cfg.offload
    if o.device_map == "auto" and world_size > 1:
        raise UserError(
            f"offload={'disk' if o.folder else 'cpu'} (device_map=auto) cannot run under {world_size} processes: "
            "each DDP/FSDP rank must hold its whole replica; use offload=none with torchrun"
        )
    if cfg.objective.precompute_ref_log_probs and world_size > 1:
        # TRL caches the precomputed log-probs in a file that each rank names for itself when the
        # dataset is in memory (datasets' per-process temp dir, a random name): rank 1 reads a file
        # rank 0 never wrote
        raise UserError(
            f"objective.precompute_ref_log_probs=true cannot run under {world_size} processes (TRL's cache of the "
            "reference log-probs is per process); drop it (the reference is then the adapter off, on every rank)"
        )
    if t.lm_eval_tasks:
        from .metrics import lm_eval_available

        if not lm_eval_available():
            raise UserError(
                "trainer.lm_eval_tasks is set but lm-eval-harness is not installed: pip install lm-eval, or drop the key"
            )
    _check_one_process_options(cfg, world_size)
    validate_dist(cfg, gpu_available, world_size)
    if cfg.hub.push:  # a repo id, a token and the hub in reach, before hours of training
        from ..integrations.hub import check_push

        check_push(cfg.hub.repo_id, cfg.hub.revision)


def _check_one_process_options(cfg: TrainConfig, world_size: int) -> None:
    """The options tested in one process only (config/checks.py refuses them with a dist= strategy)
    under several processes too: `torchrun` with dist=none runs DDP all the same."""
    if world_size <= 1:
        return
    t = cfg.trainer
    for option, on in (
        ("trainer.tiled_mlp=true", t.tiled_mlp),
        ("trainer.lean_rmsnorm=true", t.lean_rmsnorm),
        ("peft.adapter_dtype=bfloat16", cfg.peft.adapter_dtype == "bfloat16"),
    ):
        if on:
            raise UserError(
                f"{option} is tested in one process, not under {world_size} processes (WORLD_SIZE={world_size}, "
                f"torchrun runs them as DDP): drop {option.split('=')[0]} or train in one process"
            )


# ---------------------------------------------------------------------------------------------
# The environment: checked before anything is written.
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


# ---------------------------------------------------------------------------------------------
# Hardware node and distributed strategies (conf/dist, launch/). Each rejected combination names
# the library thread that shows it failing.
# ---------------------------------------------------------------------------------------------


# Attention implementations that keep the flattened sequences of a padding-free row apart: flash
# kernels and sdpa_varlen (model/packed_attention.py) read the collator's cu_seq_lens; for sdpa, eager and
# flex, transformers' create_causal_mask builds a block-diagonal mask from position_ids
# (masking_utils.find_packed_sequence_indices; training only: TRL's compute_loss passes use_cache=False
# and no attention_mask). config/attention.py says which auto picks.
POSITION_IDS_MASKED = ("sdpa", "eager", "flex_attention", VARLEN)


def _check_attention(cfg: TrainConfig, gpu_available: bool) -> None:
    """Attention the run could not train with: flex without a GPU (torch 2.13 has no flex backward on a
    CPU), sdpa_varlen for a family whose attention it does not apply."""
    attn = str(cfg.model.attn_implementation)
    if attn == "flex_attention" and not gpu_available:
        raise UserError(
            "model.attn_implementation=flex_attention needs a CUDA GPU to train (torch has no flex attention "
            "backward on a CPU); use model.attn_implementation=auto here"
        )
    blocker = varlen_blocker(cfg.model.architecture) if attn == VARLEN else None
    if blocker:
        raise UserError(
            f"model.attn_implementation={VARLEN}: {cfg.model.architecture} {blocker}, which {VARLEN} does not "
            "apply; use model.attn_implementation=auto"
        )


def _check_padding_free(cfg: TrainConfig, gpu_available: bool) -> None:
    """data.padding_free / packing: what TRL 1.16 and the attention backend can train correctly."""
    d, attn = cfg.data, str(cfg.model.attn_implementation)
    _check_attention(cfg, gpu_available)
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
                f"{why}: model.attn_implementation={attn} needs a CUDA GPU; use model.attn_implementation=auto "
                f"here ({VARLEN}: each packed sequence apart, no dense mask)"
            )
    elif attn not in POSITION_IDS_MASKED:
        raise UserError(
            f"{why}: model.attn_implementation={attn} does not keep packed sequences apart (they would attend "
            f"to each other); use model.attn_implementation=auto ({VARLEN}, or flash_attention_2 where installed)"
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


def validate_dist(cfg: TrainConfig, gpu_available: bool, world_size: int) -> None:
    """Combinations of dist.strategy with the stack that cannot work, before anything launches."""
    import importlib.util
    import json
    from pathlib import Path

    d = cfg.dist
    s = d.strategy  # one of DIST_STRATEGIES, and the launcher one of DIST_LAUNCHERS: check_stack
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
    # No GPU: FSDP and ZeRO run as CPU ranks over gloo (tests/e2e/test_sharded_training_on_cpu_ranks.py); what still needs
    # GPUs is the kernels, NCCL and real device memory (docs/multi-gpu.md).
    # an int8 base, or a 4-bit one not stored in the compute dtype: config/checks.py (plan refuses them too)
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
