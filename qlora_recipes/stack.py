"""Library objects built from a composed stack: BitsAndBytesConfig, LoraConfig, SFTConfig.

All translation from our option names to the libraries' arguments lives here, so a new option is
one file in conf/ plus, at most, one branch below.
"""

from pathlib import Path

from omegaconf import DictConfig

from .units import torch_dtype


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
            llm_int8_skip_modules=list(quant.skip_modules) or None,
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    if quant.method == "int8":
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=quant.int8_threshold,
            llm_int8_skip_modules=list(quant.skip_modules) or None,
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

    from . import data, dist

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
        warmup_steps=o.warmup_ratio,  # transformers 5: a float < 1 is a ratio of the total steps
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        optim=o.name,
        bf16=cfg.precision.name == "bf16",
        fp16=cfg.precision.name == "fp16",
        use_cpu=not on_gpu,
        gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": t.checkpointing_mode == "reentrant"},
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
        report_to=[],  # TensorBoard is attached by the caller with an explicit log dir
        disable_tqdm=not t.progress_bar,
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_num_workers=0,
        **data.format_kwargs(cfg.data, data_format),
        **dist.strategy_kwargs(cfg),
    )
