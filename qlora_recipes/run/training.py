"""One training run end to end: `train(cfg, run_dir)` is what `qlora train` and `python train.py` call.

Order: validate (config, model dir, target modules) -> plan -> tokenizer -> data, all before
anything is written (a plan that does not fit writes config.yaml and plan.json, for its ladder, and
is refused) -> config.yaml + plan.json -> model (quantized, device map) -> k-bit prep + adapters -> TRL SFTTrainer, guarded (atomic checkpoints,
NaN stop, OOM ladder, preemption) -> adapter -> eval -> metrics.json. Tests call `train` in-process.
A stop signal (SIGTERM, Ctrl-C, SLURM's warning) at any phase raises (interrupts.raising): while
loading, the caller's one line; while training, a checkpoint at that step (lifecycle); in the
final evaluation, the adapter is already saved.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import data, interrupts, planner
from ..config import adapters, devices
from ..config.devices import precision_line
from ..config.loader import to_yaml as config_yaml
from ..config.objectives import OBJECTIVES
from ..config.schema import TrainConfig
from ..console import next_commands, print_stack, print_summary, shown_path
from ..data.readers import check_data_sources
from ..data.token_count import count_train_tokens, efficiency_figures
from ..errors import UserError
from ..integrations import cluster, hub, trackers
from ..interrupts import sigint_deferred
from ..invocation import command, resume_command, task_overrides
from ..model import loading, vision
from ..model.check import check_hub_model, validate_model
from ..outputs.runfiles import give_umask_modes, remove_manifest, run_file_names, write_manifest
from ..units import fmt_bytes
from . import dist, lifecycle, metrics, rewards, sft_rows, stages, trainer_args
from .checkpoints import disk_full, find_checkpoint, free_bytes
from .lock import RunDirLock
from .memory import PeakTracker, configure_cuda_allocator, pin_malloc_thresholds, planned_peak_gib, rss_bytes
from .resume import AlreadyComplete, prefetch_fingerprints, resume_checkpoint
from .reuse import RunDirChanges, held_run, refuse_silent_reuse, restore_interrupted_replacement
from .validate import validate

log = logging.getLogger("train")


def _main_rank() -> bool:
    return int(os.environ.get("RANK", 0)) == 0  # under torchrun only rank 0 writes the run dir


def _write_metrics(run_dir: Path, figures: dict) -> None:
    """This rank's metrics file: metrics.json is rank 0's alone (ranks writing one file race on it),
    metrics.rankN.json rank N's; rank 0 drops those of ranks this job does not have (an earlier run's)."""
    rank = int(os.environ.get("RANK", 0))
    metrics.write_metrics(run_dir, figures, name="metrics.json" if rank == 0 else f"metrics.rank{rank}.json")
    if rank == 0:
        metrics.drop_rank_metrics(run_dir, int(os.environ.get("WORLD_SIZE", 1) or 1))


@dataclass
class _Fitted:
    """What the guarded trainer leaves: the trainer, its result, the config that fit, seconds spent."""

    trainer: Any
    result: Any
    cfg: TrainConfig
    seconds: float
    eval_before: dict | None = None  # the objective's eval figures before training (dpo: reward accuracy)
    drawing: Any = None  # memory.png being drawn (outputs.memory_chart.Drawing), or None


def train(cfg: TrainConfig, run_dir: Path, choices: dict | None = None, on_write=None) -> dict:
    """Run one stack end to end; returns the metrics also written to run_dir/metrics.json.
    `on_write()` runs where the run dir is first written (the caller's own files, e.g. Hydra's).

    The run's memory peak is its own (peak.py): tracked from here, so loading counts, to the end,
    so an earlier run in the same process (a Hydra multirun) does not leak into it."""
    gpu = loading.on_gpu()
    if gpu and (allocator := configure_cuda_allocator(cfg.trainer.expandable_segments)) and _main_rank():
        log.info("%s", allocator)
    if not gpu:
        pin_malloc_thresholds()  # CPU: RSS follows the live tensors, as the plan counts them (peak.py)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed, imported by the trainer, warns when it guesses
    # CPU: the plan's process baseline is this process's own footprint, its libraries imported (the
    # objective's TRL trainer too: imported on demand, after this it would be a footprint the plan misses)
    lifecycle.guarded(cfg.objective.name)
    footprint = nullcontext() if gpu else planner.measured_start(rss_bytes())
    tracker = PeakTracker(gpu).start()
    stops = (signal.SIGINT, signal.SIGTERM, cluster.preemption_signal())  # at any phase: raised, then one line
    try:
        with footprint, interrupts.raising(*stops), RunDirLock(run_dir, enabled=_main_rank()):  # one run per run dir
            return _train(cfg, run_dir, choices, tracker, on_write)
    finally:
        tracker.stop()


def _train(cfg: TrainConfig, run_dir: Path, choices: dict | None, tracker: PeakTracker, on_write=None) -> dict:
    from transformers import set_seed

    started = time.time()
    gpu = loading.on_gpu()
    chosen = precision_line(cfg)  # precision=auto: what this machine computes natively, and why
    if chosen and _main_rank():
        log.info("%s", chosen)
    cfg = adapters.settled(cfg)  # peft.adapter_dtype=auto, once: the checks, plan, config.yaml and model agree
    try:
        plan, resume_from = _check_and_plan(cfg, run_dir, choices, gpu, on_write)
    except AlreadyComplete as done:  # resume=auto on a finished run: nothing to do, exit 0
        log.warning("%s", done)
        return done.metrics
    stage = stages.check_init_from(cfg)  # init_from: a finished run, this base, this adapter shape

    cfg = planner.settle_batch(cfg, plan)  # gradient_checkpointing / micro_batch_size=auto: as the plan resolved them
    cfg = planner.settle_eval_batch(cfg, plan)  # eval_batch_size=auto: as the plan resolved it
    set_seed(cfg.seed)
    tokenizer = _processing_class(cfg)  # a vision-language model's processor, else the tokenizer
    seq_len = planner.seq_len_for_data(cfg, plan)  # trainer.seq_len=auto: from the train rows' tokens
    positions = planner.positions(cfg.model)  # rows past seq_len are told what gives them room
    if vision.is_vision_language(cfg.model):  # image rows, checked here, rendered by the trainer's collator
        from ..data.images import load_image_splits

        train_ds, eval_ds, data_stats = load_image_splits(cfg.data, tokenizer, seq_len, cfg.seed)
    else:
        train_ds, eval_ds, data_stats = data.load_splits(
            cfg.data, tokenizer, seq_len, cfg.seed, cfg.objective, positions
        )
    # planned for the batches the rows make, within the same host RAM budget as the first plan
    cfg, plan = planner.settle_for_data(cfg, plan, data_stats, host_ram=devices.host_budget(cfg))
    prefetch_fingerprints(cfg)  # what each checkpoint records, hashed while the model loads, not in train_s
    # grpo: its rewards imported and checked against the rows' columns before anything is written or loaded
    reward_funcs = rewards.reward_functions(cfg, tuple(train_ds.column_names)) if cfg.objective.name == "grpo" else None
    # a failure before the run has something to keep undoes its writes
    changes = RunDirChanges(cfg, run_dir, writes_hydra_files=on_write is not None)
    _write_run_files(cfg, run_dir, choices, plan, on_write, changes)  # every check has passed
    data_split, run = (train_ds, eval_ds, data_stats), (started, stage, reward_funcs, tracker)
    try:
        out = _load_train_and_record(cfg, run_dir, plan, resume_from, tokenizer, data_split, run, changes)
    except BaseException:
        with sigint_deferred():
            changes.undo()
        raise
    if _main_rank():  # adapter/README.md: the model card; with hub.push=true, the adapter to the hub
        hub.publish_adapter(cfg, run_dir)
    if _main_rank():  # the figures a user reads and what to run next; metrics.json has them all
        kept = find_checkpoint(run_dir / "checkpoints") is not None  # else a printed resume would be refused
        print_summary(out, run_dir, next_commands(command(), run_dir, task_overrides(), out["steps"], kept))
    return out


def _load_train_and_record(cfg: TrainConfig, run_dir, plan, resume_from, tokenizer, data_split, run, changes) -> dict:
    """Load, make trainable, train under the guards, save the adapter, evaluate, write metrics.json
    and the manifest: the run's figures. `run`: (when it started, the init_from stage, the rewards,
    the PeakTracker)."""
    train_ds, eval_ds, data_stats = data_split
    started, stage, reward_funcs, tracker = run
    model = loading.make_trainable(cfg, loading.load_model(cfg, run_dir, plan))
    trainable, total = model.get_nb_trainable_parameters()
    log.info("trainable params: %d of %d (%.3f%%)", trainable, total, 100 * trainable / total)

    want_em = cfg.data.metric == "exact_match" and eval_ds is not None
    pairs = _generation_pairs(eval_ds, data_stats, cfg.data.metric_examples) if want_em else []
    em_before = _exact_match(cfg, model, tokenizer, pairs, plan)

    tb = _tensorboard(run_dir) if "tensorboard" in trackers.enabled(cfg.logger) else None
    tracking = trackers.start(cfg.logger, run_dir) if _main_rank() else None  # the logger group's W&B / MLflow runs
    finished, fitted = False, None
    try:
        splits = (train_ds, eval_ds)
        watch = (tb, tracker, changes)
        fitted = _fit(
            cfg, run_dir, model, tokenizer, splits, data_stats["format"], plan, resume_from, watch, reward_funcs
        )
        try:
            with sigint_deferred():  # the trained adapter first, whole: a signal in the evaluation keeps it
                _save_adapter(fitted.trainer, tokenizer, run_dir)
                changes.keep()  # the new run has its adapter: the run it replaced goes
            final_eval = _final_eval(
                fitted.trainer, eval_ds if OBJECTIVES[cfg.objective.name].trainer_evaluates else None
            )
            scores = _scores(cfg, model, tokenizer, pairs, (final_eval or {}).get("eval_loss"), em_before, plan)
            scores.update(metrics.objective_figures(cfg.objective.name, fitted.eval_before, final_eval))
            scores.update(
                metrics.reward_figures(fitted.trainer.state.log_history) if cfg.objective.name == "grpo" else {}
            )
        except KeyboardInterrupt as err:
            raise _stopped_in_final_eval(interrupts.signal_name(err), fitted.trainer, run_dir) from None
        out = {**_run_figures(fitted, plan, resume_from), **scores, "wall_s": time.time() - started, "data": data_stats}
        out.update(metrics.memory_figures(tracker.peak_gib(), plan, tracker.gpu))  # after eval and saving
        out["init_from"] = stage  # the earlier stage: its run dir and objective
        sharded = cfg.dist.strategy in dist.SHARDED  # whole weights gathered; this rank's share, measured
        out["adapter_sha256"] = dist.adapter_digest(fitted.trainer) if sharded else metrics.trainable_digest(model)
        out["adapter_sha256_step0"] = getattr(fitted.trainer, "adapter_sha256_step0", None)  # equal on every rank
        if sharded:
            out["sharding"] = dist.sharding_figures(fitted.trainer)
        if fitted.drawing is not None:
            fitted.drawing.wait()  # memory.png is one of the run's files
        with sigint_deferred():
            _write_metrics(run_dir, out)
            if _main_rank():  # what merge and generate check the run's files against when they read them back
                write_manifest(run_dir, run_file_names(run_dir), complete=("adapter",))
        finished = True
    finally:
        if fitted is not None and fitted.drawing is not None:
            fitted.drawing.wait()  # no child left writing into a run dir that a failure undoes
        if tb is not None:
            tb.close()
        if tracking is not None:
            tracking.close(failed=not finished)
    return out


def _processing_class(cfg: TrainConfig):
    """What the trainer tokenizes with: a vision-language model's processor, else the tokenizer."""
    if not vision.is_vision_language(cfg.model):
        return loading.load_tokenizer(cfg.model)
    return vision.load_processor(cfg.model, loading.source(cfg.model))


def _check_and_plan(cfg: TrainConfig, run_dir: Path, choices: dict | None, gpu: bool, on_write=None) -> tuple:
    """Everything that can refuse a run from its config and model dir, before anything is loaded or
    written; a plan that does not fit is written (config.yaml, plan.json with its ladder), then refused."""
    validate(cfg, gpu_available=gpu)
    if _main_rank():
        restore_interrupted_replacement(run_dir)  # before anything reads the run dir
    refuse_silent_reuse(cfg, run_dir)  # a run already there: resume=auto continues it, overwrite=true replaces it
    # the causes a user can fix by hand first: a data file missing, then the model out of reach
    check_data_sources(cfg.data)
    check_hub_model(cfg.model)
    validate_model(cfg)
    vision.refuse_untried(cfg)  # a vision-language model: what it does not train with yet
    resume_from = resume_checkpoint(cfg, run_dir)  # checks the saved config first
    # one rank's share (WORLD_SIZE ranks): FSDP/ZeRO-3 on GPUs, every strategy on CPU ranks (gloo)
    plan = planner.plan(cfg, host_ram=devices.host_budget(cfg))
    if not (plan["fits"] or cfg.force or (cfg.overwrite and held_run(run_dir))):  # a refused overwrite keeps all
        _write_run_files(cfg, run_dir, choices, plan, on_write)
    planner.refuse_unless_fits(plan, force=cfg.force)
    return plan, resume_from


def _write_run_files(
    cfg: TrainConfig,
    run_dir: Path,
    choices: dict | None,
    plan: dict,
    on_write=None,
    changes: RunDirChanges | None = None,
) -> None:
    """config.yaml and plan.json (and the caller's files), all or none: Ctrl-C waits for the group.
    `changes`: the run's checks have passed; what these files replace (with overwrite=true, the whole
    run there) is set aside until the run has something to keep."""
    if not _main_rank():
        return
    print(f"run dir: {shown_path(run_dir)}", flush=True)
    print_stack(cfg, choices)
    with sigint_deferred():
        run_dir.mkdir(parents=True, exist_ok=True)
        if changes is not None:
            changes.begin()
        remove_manifest(run_dir)  # the run dir changes from here: what an earlier finish recorded goes
        (run_dir / "config.yaml").write_text(config_yaml(cfg))
        planner.write_plan(plan, run_dir)
        if on_write is not None:
            on_write()


def _tensorboard(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir / "tb")) if _main_rank() else None


def _fit(
    cfg: TrainConfig, run_dir, model, tokenizer, splits, data_format, plan, resume_from, watch, reward_funcs=None
) -> _Fitted:
    """Train under the guards; a preemption writes its metrics and raises lifecycle.Preempted.
    `watch`: the TensorBoard writer (or None) and the run's PeakTracker, for the memory timeline, and
    the run dir's RunDirChanges (the trainer's start and first checkpoint decide what a failure undoes)."""
    from transformers.integrations import TensorBoardCallback

    from .callbacks import EvalBeforeTraining, EvalProgress, MemoryLogger, RunDirKept

    train_ds, eval_ds = splits
    tb, tracker, changes = watch
    gpu = loading.on_gpu()
    planned = (planned_peak_gib(plan, gpu), tracker.quantity)  # memory.png's line to compare with
    preemption = lifecycle.PreemptionCallback()
    before: dict = {}  # dpo: TRL's eval rewards before the first step (the policy is the reference there)
    trainer_eval = eval_ds if OBJECTIVES[cfg.objective.name].trainer_evaluates else None
    extra = {"reward_funcs": reward_funcs} if reward_funcs is not None else {}  # grpo

    memory_logs: list = []  # the last trainer's draws memory.png, after the timed part

    def make_trainer(c: TrainConfig):
        tb_callback = TensorBoardCallback(tb_writer=tb)
        tb_callback.logging_dir = str(run_dir / "tb")  # where it reopens after train() closes it
        tb_callbacks = [tb_callback] if "tensorboard" in trackers.enabled(c.logger) else []  # logger=none: no tb/
        memory_log = MemoryLogger(run_dir, c.trainer.memory_log_steps, tb, tracker, planned)
        memory_logs.append(memory_log)
        dist.prepare_ranks(c.dist, gpu)
        args = trainer_args.trainer_config(c, run_dir, data_format, gpu, trainer_eval is not None)
        # sft: TRL's label, truncation and drop passes over our tokenized rows, vectorized
        rows, eval_rows = sft_rows.for_trainer(c.objective.name, args, train_ds, trainer_eval)
        trainer = lifecycle.guarded(c.objective.name)(
            model=model,
            args=args,
            train_dataset=rows,
            eval_dataset=eval_rows,
            processing_class=tokenizer,
            callbacks=[memory_log, *tb_callbacks, EvalProgress(), preemption, RunDirKept(changes)],
            **trainer_args.guard_kwargs(c),
            **extra,
        )
        trainer_args.offload_context(trainer, c.trainer)
        trainer.token_count = count_train_tokens(trainer)  # metrics.json's token_efficiency
        trainer.adapter_sha256_step0 = dist.sync_adapters(model)  # every rank starts from rank 0's adapters
        if c.objective.name != "sft" and trainer_eval is not None and not before:
            log.info("evaluation before training: %d eval rows", len(eval_ds))
            if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # the model is prepared in train()
                trainer.add_callback(EvalBeforeTraining(trainer, before))
            else:
                before.update(trainer.evaluate())
        return trainer

    trainer_args.note_optimizer_fallback(cfg.optim, gpu)
    started = time.time()
    preemption.install()
    try:
        initial = lifecycle.initial_values(model)  # the OOM ladder's restart point; one process's step-0 digest
        rungs = [rung["overrides"] for rung in plan.get("ladder", [])]
        trainer, result, fit_cfg = lifecycle.train_with_oom_ladder(
            cfg, model, make_trainer, run_dir, resume_from, rungs, initial
        )
    finally:
        preemption.uninstall()
    seconds = time.time() - started
    # drawn in a child process while the adapter is saved and evaluated; waited for before the files are listed
    drawing = memory_logs[-1].draw_png() if memory_logs and trainer.is_world_process_zero() else None
    if drawing is not None and (preemption.received or preemption.stop):
        drawing.wait()  # the run stops here: its memory.png first, as an uninterrupted run waits for it
    if preemption.received and not preemption.stop:  # came after the ranks' last agreement: not swallowed
        os.kill(os.getpid(), getattr(signal, preemption.received))
    if preemption.stop:
        raise _stopped_in_training(preemption.stop, trainer, run_dir)
    if dist.process_group_size() <= 1:  # no ranks to compare: the initial adapters' digest, off the timed part
        trainer.adapter_sha256_step0 = dist.tensors_digest(initial)
    return _Fitted(trainer, result, fit_cfg, seconds, before or None, drawing)


def _stopped_in_training(signame: str, trainer, run_dir: Path) -> lifecycle.Preempted:
    """A stop signal the ranks agreed on: metrics.json says so, with the checkpoint saved at that step."""
    if trainer.args.world_size > 1:  # every rank stops here; the launcher's SIGTERM, as another exits, adds nothing
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    step = trainer.state.global_step
    checkpoint = find_checkpoint(run_dir / "checkpoints")
    _write_metrics(run_dir, {"status": "preempted", "signal": signame, "steps": step, "checkpoint": checkpoint})
    return lifecycle.Preempted(signame, step, checkpoint)


def _final_eval(trainer, eval_ds) -> dict | None:
    """The eval figures after training (eval_loss; dpo: its rewards too), announced first: a long
    evaluation is no silent one (the trainer's callback says how far it got every EVAL_PROGRESS_S seconds)."""
    if eval_ds is None:
        return None
    batch = trainer.args.per_device_eval_batch_size
    log.info("final evaluation: %d eval rows in %d batches of %d", len(eval_ds), -(-len(eval_ds) // batch), batch)
    return trainer.evaluate()


def _stopped_in_final_eval(signame: str, trainer, run_dir: Path) -> lifecycle.Preempted:
    """A stop signal after the adapter was saved: metrics.json says so (no eval figures), and the
    newest checkpoint (at the last step) lets resume=auto evaluate and finish."""
    step = trainer.state.global_step
    checkpoint = find_checkpoint(run_dir / "checkpoints")
    adapter = str(run_dir / "adapter")
    status = {"status": "preempted", "signal": signame, "phase": "final evaluation", "steps": step}
    with sigint_deferred():
        _write_metrics(run_dir, {**status, "checkpoint": checkpoint, "adapter": adapter})
    return lifecycle.Preempted(signame, step, checkpoint, adapter=adapter, phase="during the final evaluation")


def _generation_pairs(eval_ds, data_stats: dict, limit: int | None) -> list:
    """(prompt, reference) pairs of the eval rows the task metric scores; image rows keep their images."""
    if data_stats.get("images"):
        return metrics.image_pairs(eval_ds, limit)
    return data.generation_pairs(eval_ds, data_stats["format"], limit)


def _exact_match(cfg: TrainConfig, model, tokenizer, pairs, plan: dict) -> float | None:
    """The task metric: prompts cut to seq_len tokens, at most max_new_tokens generated, batches no
    larger than an eval batch of the planned length (eval_batch_size x the plan's seq_len
    positions): the bound the memory plan counts (planner/loss.py). Image rows (`tokenizer` is then
    the processor) go in batches under the same bound, with their images, never cut."""
    t = cfg.trainer
    planned_len = plan.get("stack", {}).get("seq_len") or t.seq_len
    if vision.is_vision_language(cfg.model):
        budget = t.eval_batch_size * planned_len
        return metrics.image_exact_match(
            model, tokenizer, pairs, cfg.data.max_new_tokens, t.seq_len, max_batch_tokens=budget
        )
    return metrics.exact_match(
        model,
        tokenizer,
        pairs,
        cfg.data.max_new_tokens,
        max_batch_tokens=t.eval_batch_size * planned_len,
        max_prompt_tokens=t.seq_len,
    )


def _scores(cfg: TrainConfig, model, tokenizer, pairs, eval_loss, em_before, plan: dict) -> dict:
    """Eval loss, perplexity, the task metric before and after, and lm-eval tasks when asked for."""
    t = cfg.trainer
    lm_eval = (
        metrics.lm_eval_scores(model, tokenizer, t.lm_eval_tasks, t.lm_eval_limit, t.eval_batch_size)
        if t.lm_eval_tasks
        else None
    )
    return {
        "eval_loss": eval_loss,
        "eval_perplexity": metrics.perplexity(eval_loss),
        "eval_exact_match_before": em_before,
        "eval_exact_match": _exact_match(cfg, model, tokenizer, pairs, plan),
        "lm_eval": lm_eval,
    }


def _run_figures(fitted: _Fitted, plan: dict, resume_from: str | None) -> dict:
    """Loss curve, throughput, memory (measured and planned) and the batch shape that fit."""
    import torch

    history = fitted.trainer.state.log_history
    loss_curve = metrics.losses(history)
    tokens = max((float(e.get("num_tokens", 0)) for e in history), default=0.0)
    return {
        "status": "ok",
        "train_loss_first": loss_curve[0] if loss_curve else None,
        "train_loss_last": loss_curve[-1] if loss_curve else None,
        "train_loss_mean": fitted.result.training_loss,
        "train_losses": loss_curve,  # every logged training loss, in order
        "tokens_per_s": tokens / fitted.seconds if fitted.seconds > 0 else None,
        **efficiency_figures(getattr(fitted.trainer, "token_count", None)),
        "device": loading.device_name(),
        "steps": fitted.trainer.state.global_step,
        "micro_batch_size": fitted.cfg.trainer.micro_batch_size,
        "grad_accum": fitted.cfg.trainer.grad_accum,
        "resumed_from": resume_from,
        "train_s": fitted.seconds,
        "torch": torch.__version__,
    }


def _save_adapter(trainer, tokenizer, run_dir: Path) -> None:
    """The adapter dir appears complete or not at all (written aside, then renamed); a full disk
    (or Ctrl-C) while writing leaves no adapter.partial, and the checkpoints as they were."""
    staging = run_dir / "adapter.partial"
    try:
        if not dist.save_gathered_adapter(trainer, str(staging), _main_rank()):
            trainer.save_model(str(staging))  # rank 0 writes (ZeRO-3 gathers the adapter first)
        if _main_rank():
            tokenizer.save_pretrained(staging)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if disk_full(err):
            kept = find_checkpoint(run_dir / "checkpoints")
            weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
            free = free_bytes(run_dir)
            space = f"its weights take {fmt_bytes(weights)}" + (f", {fmt_bytes(free)} free" if free is not None else "")
            raise UserError(
                f"disk full while saving the adapter in {run_dir} ({space}): nothing of it was kept"
                + (f" and the checkpoints are intact (newest: {kept})" if kept else "")
                + f"; free space and resume from the newest checkpoint: {resume_command(task_overrides(), shown_path(run_dir))}"
            ) from None
        raise
    if _main_rank():
        give_umask_modes(staging)  # safetensors writes 0600
        shutil.rmtree(run_dir / "adapter", ignore_errors=True)
        staging.rename(run_dir / "adapter")
