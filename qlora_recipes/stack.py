"""Library objects built from a composed stack: BitsAndBytesConfig, LoraConfig, SFTConfig.

All translation from our option names to the libraries' arguments lives here, so a new option is
one file in conf/ plus, at most, one branch below.
"""

import logging
import warnings
from pathlib import Path

from omegaconf import DictConfig

from .units import cfg_get, torch_dtype

log = logging.getLogger("train")


def skip_modules(cfg: DictConfig) -> list[str] | None:
    """What bitsandbytes leaves unquantized. None: transformers' default (the output embedding, tied
    weights). A `quant.skip_modules` list *replaces* that default in transformers, which would
    quantize the output head (TRL's fused LM head then fails in training), so the default is added
    back: the output embedding always stays unquantized."""
    user = [str(m) for m in cfg.quant.skip_modules]
    if not user:
        return None
    return sorted(set(user) | set(output_modules(cfg)))


def output_modules(cfg: DictConfig) -> list[str]:
    """transformers' own default skip list for this model (output embedding, tied weights, last
    module: `get_keys_to_not_convert`), from an empty-weights skeleton of its config; `lm_head`
    when the config cannot be read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    path = str(cfg.model.name_or_path)
    local = Path(path).expanduser()
    remote = cfg.model.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(
            str(local) if local.is_dir() else path, trust_remote_code=remote, revision=cfg.model.revision
        )
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
        return sorted(get_keys_to_not_convert(skeleton))
    except (OSError, ValueError, KeyError, ImportError):  # no config here: the name every known family uses
        return ["lm_head"]


def bnb_config(cfg: DictConfig):
    """The quantization config for from_pretrained, or None for quant=none."""
    from transformers import BitsAndBytesConfig

    quant = cfg.quant
    # Quantized layers offloaded to CPU/disk must stay unquantized fp32 there (transformers rule).
    cpu_offload = cfg.offload.device_map == "auto"
    if quant.method in ("nf4", "fp4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant.method,
            bnb_4bit_use_double_quant=quant.double_quant,
            bnb_4bit_compute_dtype=torch_dtype(quant.compute_dtype),
            bnb_4bit_quant_storage=torch_dtype(quant.storage_dtype),
            llm_int8_skip_modules=skip_modules(cfg),
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    if quant.method == "int8":
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=quant.int8_threshold,
            llm_int8_skip_modules=skip_modules(cfg),
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    return None


def lora_config(cfg: DictConfig):
    from peft import LoraConfig

    p = cfg.peft
    targets = p.target_modules if isinstance(p.target_modules, str) else list(p.target_modules)
    return LoraConfig(
        r=p.r,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=targets,
        modules_to_save=list(p.modules_to_save) if p.modules_to_save else None,
        use_dora=p.method == "dora",
        use_rslora=p.method == "rslora",
        bias="none",
        task_type="CAUSAL_LM",
    )


def sft_config(cfg: DictConfig, run_dir: Path, data_format: str, on_gpu: bool, has_eval: bool):
    """TRL's SFTConfig: the one place it is built, from the trainer, optim and precision groups, the
    data format's loss masking and packing, and the dist strategy's keywords."""
    from trl import SFTConfig

    from . import data, dist, trackers

    t, o = cfg.trainer, cfg.optim
    steps_eval = has_eval and t.eval_steps > 0
    return SFTConfig(
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=t.micro_batch_size,
        per_device_eval_batch_size=t.eval_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        max_steps=t.max_steps,
        num_train_epochs=t.epochs,
        learning_rate=o.lr,
        lr_scheduler_type=o.scheduler,
        # transformers 5 has one key: a float < 1 is a ratio of the total steps, >= 1 a number of steps
        warmup_steps=o.warmup_steps if o.warmup_steps > 0 else float(o.warmup_ratio),
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        optim=o.name,
        bf16=cfg.precision.name == "bf16",
        fp16=cfg.precision.name == "fp16",
        use_cpu=not on_gpu,
        # transformers 5 names it activation checkpointing (the gradient_* keys warn, removed in v6)
        activation_checkpointing=t.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": t.checkpointing_mode == "reentrant"},
        activation_offloading=t.activation_offloading,  # saved activations to pinned host RAM (CUDA)
        use_liger_kernel=t.liger,
        max_length=t.seq_len,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        eval_strategy="steps" if steps_eval else "no",
        eval_steps=t.eval_steps if steps_eval else None,
        save_strategy="steps" if t.save_steps > 0 else "no",
        save_steps=t.save_steps if t.save_steps > 0 else 500,
        save_total_limit=t.save_total_limit,
        # With evaluation, rotation also keeps the checkpoint with the best eval loss.
        metric_for_best_model="eval_loss" if steps_eval and t.save_steps > 0 else None,
        greater_is_better=False if steps_eval and t.save_steps > 0 else None,
        logging_nan_inf_filter=False,  # a NaN loss must show, not be averaged away
        # the logger group's trackers (training attaches TensorBoard itself, with the memory timeline)
        report_to=trackers.report_to(cfg),
        run_name=trackers.run_name(cfg, run_dir),
        project=cfg_get(cfg, "logger.project", "qlora-recipes"),  # trackio's project
        disable_tqdm=not t.progress_bar,
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_num_workers=0,
        **data.format_kwargs(cfg.data, data_format),
        **dist.strategy_kwargs(cfg),
    )


# bitsandbytes' words when a paged optimizer meets CPU tensors (bitsandbytes/optim/optimizer.py).
_PAGED_ON_CPU = r"Paged optimizers are not supported on CPU"


def note_optimizer_fallback(cfg: DictConfig, on_gpu: bool) -> None:
    """Paging moves optimizer state through CUDA unified memory; on CPU bitsandbytes runs the same
    optimizer unpaged (identical updates) and warns about it. Expected here: one line of ours, and
    exactly that warning silenced."""
    if on_gpu or not str(cfg.optim.name).startswith("paged_"):
        return
    log.info("optim: %s runs unpaged on this CPU (paging needs CUDA; the updates are the same)", cfg.optim.name)
    warnings.filterwarnings("ignore", message=_PAGED_ON_CPU, category=UserWarning)
