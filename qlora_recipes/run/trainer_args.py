"""TRL's trainer configs built from the stack: the one place the trainer's arguments are made.
`trainer_config` picks the objective's (SFTConfig, DPOConfig, KTOConfig); all share `_shared`, the trainer, optim,
precision, logger and dist groups' keywords."""

import logging
import warnings
from pathlib import Path

from ..config.schema import OptimConfig, TrainConfig

log = logging.getLogger("train")
DEFAULT_OFFLOAD_STASH = 5  # trl.models.get_act_offloading_ctx_manager's max_fwd_stash_size


def offload_context(trainer, t) -> None:
    """trainer.activation_offload_stash other than TRL's default, or pageable host copies
    (trainer.activation_offload_pinned=false): the trainer's offloading context rebuilt with them (SFT,
    DPO and KTO trainers all keep it in `maybe_activation_offload_context`); copies still overlap compute
    on TRL's side stream when pinned."""
    from trl.models import get_act_offloading_ctx_manager

    if t.activation_offloading and (
        t.activation_offload_stash != DEFAULT_OFFLOAD_STASH or not t.activation_offload_pinned
    ):
        trainer.maybe_activation_offload_context = get_act_offloading_ctx_manager(
            model=trainer.model,
            max_fwd_stash_size=t.activation_offload_stash,
            use_pin_memory=t.activation_offload_pinned,
        )


def trainer_config(cfg: TrainConfig, run_dir: Path, data_format: str, on_gpu: bool, has_eval: bool):
    """The objective's TRL config (config/objectives.py names it)."""
    if cfg.objective.name == "dpo":
        return dpo_config(cfg, run_dir, on_gpu, has_eval)
    if cfg.objective.name == "kto":
        return kto_config(cfg, run_dir, on_gpu, has_eval)
    if cfg.objective.name == "grpo":
        return grpo_config(cfg, run_dir, on_gpu)
    return sft_config(cfg, run_dir, data_format, on_gpu, has_eval)


def guard_kwargs(cfg: TrainConfig) -> dict:
    """What the objective's guarded trainer takes beside TRL's arguments (dpo: the reference adapter)."""
    if cfg.objective.name == "dpo":
        return {"ref_adapter": bool(cfg.objective.ref_adapter)}
    return {}


def sft_config(cfg: TrainConfig, run_dir: Path, data_format: str, on_gpu: bool, has_eval: bool):
    """TRL's SFTConfig: the shared keywords, the data format's loss masking and packing."""
    from trl import SFTConfig

    from .. import data

    return SFTConfig(**_shared(cfg, run_dir, on_gpu, has_eval), **data.format_kwargs(cfg.data, data_format))


def dpo_config(cfg: TrainConfig, run_dir: Path, on_gpu: bool, has_eval: bool):
    """TRL's DPOConfig: the shared keywords and the objective group's DPO keys. TRL's other defaults stay:
    dropout off in the model (disable_dropout), keep_start truncation of each sequence at max_length."""
    from trl import DPOConfig

    o = cfg.objective
    return DPOConfig(
        **_shared(cfg, run_dir, on_gpu, has_eval),
        beta=o.beta,
        # sft_weight: TRL's "sft" loss (the chosen answers' NLL) beside the preference loss, weighted
        loss_type=[o.loss_type, "sft"] if o.sft_weight else [o.loss_type],
        loss_weights=[1.0, float(o.sft_weight)] if o.sft_weight else None,
        precompute_ref_log_probs=bool(o.precompute_ref_log_probs),
    )


def kto_config(cfg: TrainConfig, run_dir: Path, on_gpu: bool, has_eval: bool):
    """TRL's KTOConfig: the shared keywords and the objective group's KTO keys. TRL's other defaults stay:
    loss_type kto (with its KL estimate), dropout off, sequential sampling (each row's KL completion is
    its micro-batch neighbour's, fixed when the data is prepared)."""
    from trl import KTOConfig

    o = cfg.objective
    return KTOConfig(
        **_shared(cfg, run_dir, on_gpu, has_eval),
        beta=o.beta,
        desirable_weight=o.desirable_weight,
        undesirable_weight=o.undesirable_weight,
        precompute_ref_log_probs=bool(o.precompute_ref_log_probs),
    )


def grpo_config(cfg: TrainConfig, run_dir: Path, on_gpu: bool):
    """TRL's GRPOConfig: the shared keywords but the sequence length (GRPO's is the prompt's plus
    max_completion_length) and activation offloading (GRPOTrainer has neither), and the objective
    group's generation keys. TRL evaluates nothing (its evaluation would sample num_generations
    completions per eval prompt); the exact-match metric measures the eval split before and after.
    One generation batch per optimizer step (TRL's default steps_per_generation = grad_accum)."""
    from trl import GRPOConfig

    o = cfg.objective
    shared = _shared(cfg, run_dir, on_gpu, has_eval=False)
    for key in ("max_length", "activation_offloading"):
        shared.pop(key)
    # each logged reward is TRL's mean over the logging window: the first window's, not step 1's two prompts
    shared["logging_first_step"] = False
    return GRPOConfig(
        **shared,
        beta=o.beta,
        num_generations=o.num_generations,
        max_completion_length=o.max_completion_length,
        temperature=o.temperature,
    )


def _shared(cfg: TrainConfig, run_dir: Path, on_gpu: bool, has_eval: bool) -> dict:
    """The keywords every objective's config takes from the trainer, optim and precision groups, the
    logger group's trackers and the dist strategy."""
    from ..integrations import trackers
    from ..run import dist

    t, o = cfg.trainer, cfg.optim
    steps_eval = has_eval and t.eval_steps > 0
    return dict(
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
        # N layers: the model keeps its first N when the trainer enables it (model/checkpointing.py)
        activation_checkpointing=bool(t.gradient_checkpointing),
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
        report_to=trackers.report_to(cfg.logger),
        run_name=trackers.run_name(cfg.logger, run_dir),
        project=cfg.logger.project,  # trackio's project
        disable_tqdm=not t.progress_bar,
        seed=cfg.seed,
        data_seed=cfg.seed,
        dataloader_num_workers=0,
        **dist.strategy_kwargs(cfg.dist),
    )


# bitsandbytes' words when a paged optimizer meets CPU tensors (bitsandbytes/optim/optimizer.py).
_PAGED_ON_CPU = r"Paged optimizers are not supported on CPU"


def note_optimizer_fallback(optim: OptimConfig, on_gpu: bool) -> None:
    """Paging moves optimizer state through CUDA unified memory; on CPU bitsandbytes runs the same
    optimizer unpaged (identical updates) and warns about it. Expected here: one line of ours, and
    exactly that warning silenced."""
    if on_gpu or not str(optim.name).startswith("paged_"):
        return
    log.info("optim: %s runs unpaged on this CPU (paging needs CUDA; the updates are the same)", optim.name)
    warnings.filterwarnings("ignore", message=_PAGED_ON_CPU, category=UserWarning)
