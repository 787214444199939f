"""A training run that never loses work and never claims what it did not do: atomic checkpoints,
resume, preemption, NaN and OOM, one run per run dir.

- `guarded(objective)` is the objective's TRL trainer under the guard every one wears (`guard.Guarded`:
  atomic, sealed checkpoints, the NaN stop, the LR schedule across a resume): `GuardedTrainer` (SFTTrainer,
  run/guarded_sft.py), `GuardedDPOTrainer`, `GuardedKTOTrainer`, `GuardedGRPOTrainer` (guarded_dpo.py, ...).
  Each is imported when it is picked (or named, `from .lifecycle import GuardedTrainer`), so a run imports
  the one TRL trainer its objective uses.
- `train_with_oom_ladder` catches out-of-memory during training and retries with the next rung
  that can be applied in-process (halve the micro-batch and double accumulation, then gradient
  checkpointing), resuming from the newest checkpoint (or from the untrained start).

Beside it, one concern each: `preemption` (a stop signal, agreed by every rank; a rank lost; fault
injection; a further one while the run stops is held), `checkpoints` (checkpoint dirs, RECORD, fsync, the
newest sound checkpoint), `schedule` (the LR schedule across a resume), `resume` (`resume_checkpoint`:
`resume=auto` / `resume.checkpoint`, the data and base fingerprints) and `rundir_lock` (`RunDirLock`: one run
per run dir). They never import this module.
"""

import gc
import importlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config.loader import with_overrides
from ..config.schema import TrainConfig
from ..errors import UserError
from ..model.checkpointing import checkpoint_every_layer
from .checkpoints import find_checkpoint
from .dist import lost_peer
from .guard import Guarded, NonFiniteLoss  # noqa: F401 - the guard and its stop, re-exported
from .preemption import Preempted, PreemptionCallback, RankLost, faults  # noqa: F401 - the run's stop, re-exported
from .resume import base_fingerprint, data_fingerprint

log = logging.getLogger(__name__)

# TRL's trainer class -> (its module here, the guarded class)
_GUARDED = {
    "SFTTrainer": ("guarded_sft", "GuardedTrainer"),
    "DPOTrainer": ("guarded_dpo", "GuardedDPOTrainer"),
    "KTOTrainer": ("guarded_kto", "GuardedKTOTrainer"),
    "GRPOTrainer": ("guarded_grpo", "GuardedGRPOTrainer"),
}


def guarded(objective: str) -> type:
    """The guarded TRL trainer of an objective (config/objectives.py names its TRL class), imported now:
    the others' TRL modules stay unimported (about 0.1 s of CPU each)."""
    from ..config.objectives import OBJECTIVES

    module, name = _GUARDED[OBJECTIVES[objective].trainer]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def __getattr__(name: str):
    """`lifecycle.GuardedTrainer` and the others by name, each imported when first named."""
    for module, cls in _GUARDED.values():
        if cls == name:
            return getattr(importlib.import_module(f"{__package__}.{module}"), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------- OOM ladder
@dataclass
class OomRecord:
    attempts: list = field(default_factory=list)

    def write(self, run_dir: Path, cfg: TrainConfig) -> None:
        t = cfg.trainer
        fit = {
            "trainer.micro_batch_size": t.micro_batch_size,
            "trainer.grad_accum": t.grad_accum,
            "trainer.gradient_checkpointing": t.gradient_checkpointing,
        }
        (run_dir / "oom.json").write_text(json.dumps({"attempts": self.attempts, "fit": fit}, indent=2) + "\n")


def next_in_process_rung(cfg: TrainConfig) -> tuple[TrainConfig, str] | None:
    """Halve the micro-batch (doubling accumulation keeps the effective batch), else turn on
    gradient checkpointing; None when neither is left. Returns the changed copy and its overrides."""
    from ..config.objectives import OBJECTIVES

    t = cfg.trainer
    least = 2 if OBJECTIVES[cfg.objective.name].kl_batch else 1  # kto's KL batch needs 2 rows (config/checks.py)
    if t.micro_batch_size // 2 >= least:
        applied = f"trainer.micro_batch_size={t.micro_batch_size // 2} trainer.grad_accum={t.grad_accum * 2}"
    elif t.gradient_checkpointing is not True:  # none or the first N layers: all of them
        applied = "trainer.gradient_checkpointing=true"
    else:
        return None
    return with_overrides(cfg, applied.split()), applied


def initial_values(model) -> dict:
    """A host copy of every trainable tensor as it is before training: the OOM ladder's restart point
    (a restart must not hold a second device copy of large trainable tensors), and what one
    process's step-0 digest hashes once the timed part is over."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def train_with_oom_ladder(
    cfg: TrainConfig,
    model,
    make_trainer,
    run_dir: Path,
    resume_from: str | None,
    relaunch_rungs: list[str],
    initial: dict,
):
    """Run make_trainer(cfg).train(); on out-of-memory apply the next in-process rung and go on
    from the newest checkpoint; with none yet, from the start: every trainable tensor (adapters and
    `peft.modules_to_save` copies) back to its `initial` value (`initial_values`), and a new trainer
    brings a fresh optimizer, scheduler, step count and seeded RNG. Returns (trainer, result, cfg that fit)."""
    record = OomRecord()
    fingerprints = data_fingerprint(cfg.data), base_fingerprint(cfg.model)
    while True:
        trainer = make_trainer(cfg)
        if isinstance(trainer, Guarded):
            trainer.data_fingerprint, trainer.base_fingerprint = fingerprints
        try:
            result = trainer.train(resume_from_checkpoint=resume_from)
            if record.attempts:
                record.write(run_dir, cfg)
            return trainer, result, cfg
        except torch.OutOfMemoryError:
            pass
        except RuntimeError as err:  # another rank gone (dist.lost_peer), or a bug
            cause = lost_peer(err)
            if cause is None:
                raise
            raise RankLost(trainer.state.global_step, find_checkpoint(run_dir / "checkpoints"), cause) from None
        step = trainer.state.global_step
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rung = next_in_process_rung(cfg)
        record.attempts.append(
            {
                "step": step,
                "micro_batch_size": cfg.trainer.micro_batch_size,
                "grad_accum": cfg.trainer.grad_accum,
                "next": rung[1] if rung else None,
            }
        )
        record.write(run_dir, cfg)
        if rung is None:
            hint = "; ".join(relaunch_rungs) or "offload=cpu"
            raise UserError(
                f"out of memory at step {step} even with micro-batch 1 and gradient checkpointing; "
                f"relaunch with one of: {hint} (see plan.json ladder)"
            ) from None
        cfg, applied = rung
        log.warning("out of memory at step %d: retrying with %s", step, applied)
        resume_from = find_checkpoint(run_dir / "checkpoints")
        # every new trainer gets the untrained start (a checkpoint, if any, then loads over it): DPO's
        # reference is scored from the adapter as the trainer finds it (GuardedDPOTrainer)
        _restore_trainable(model, initial)
        if applied.startswith("trainer.gradient_checkpointing"):  # every layer now (a partial N kept fewer)
            checkpoint_every_layer(model, {"use_reentrant": cfg.trainer.checkpointing_mode == "reentrant"})
            model.enable_input_require_grads()
        elif cfg.trainer.gradient_checkpointing and not model.is_activation_checkpointing:  # transformers 5 names
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": cfg.trainer.checkpointing_mode == "reentrant"}
            )
            model.enable_input_require_grads()


def _restore_trainable(model, initial: dict) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in initial:
                param.copy_(initial[name])
            param.grad = None
