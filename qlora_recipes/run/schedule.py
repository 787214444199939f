"""The LR schedule across a resume: the schedule a run was given (recorded in each checkpoint's
RECORD), how it continues when a resume changes the total steps (`continue_schedule`'s policy), its
LR factors, and a LambdaLR that follows the continued schedule (`warped_scheduler`).
"""

import logging
from pathlib import Path

import torch

from ..errors import UserError
from .checkpoints import CHECKPOINT, read_record, trainer_state

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- LR schedule across a resume
def _fresh_schedule(args, total: int) -> dict:
    """The schedule transformers builds from `args` for `total` steps, except where its warmup
    leaves no step with a non-zero LR (warmup starts at 0: 1 step with 1 warmup step): then
    without warmup, so that the run trains at all (scheduler_for says so)."""
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    kwargs = dict(args.lr_scheduler_kwargs or {})
    fresh = {"type": str(kind), "kwargs": kwargs, "warmup": args.get_warmup_steps(total), "total": total, "warps": []}
    if fresh["warmup"] > 0 and not _some_step_trains(fresh):
        fresh["warmup"] = 0
    return fresh


def _some_step_trains(schedule: dict) -> bool:
    """Whether a step of the schedule runs at a non-zero LR. Warmup rises from 0 and decay ends
    after the last step, so the steps up to one past the warmup decide. A scheduler that is no
    LambdaLR (reduce_lr_on_plateau) counts as training."""
    try:
        lambdas = _base_lambdas(schedule, 1)
    except UserError:
        return True
    return any(fn(step) > 0 for fn in lambdas for step in range(min(schedule["total"], schedule["warmup"] + 2)))


def scheduler_for(schedule: dict, args, optimizer, resumed: bool):
    """A LambdaLR for the schedule where it is not the one transformers builds from `args` (a
    resume changed the total, or the warmup was dropped, saying so), else None."""
    dropped = args.get_warmup_steps(schedule["total"]) != schedule["warmup"]
    if dropped and not resumed:
        log.warning(
            "optim: with %d training step(s) and %d warmup step(s) every step would run at learning rate 0 "
            "(warmup starts at 0) and train nothing; training without warmup, at optim.lr from the first step",
            schedule["total"],
            args.get_warmup_steps(schedule["total"]),
        )
    return warped_scheduler(schedule, optimizer) if schedule["warps"] or dropped else None


def schedule_end(schedule: dict) -> int:
    return schedule["warps"][-1][2] if schedule["warps"] else schedule["total"]


def continue_schedule(checkpoint: str | None, args, total: int) -> dict:
    """The LR schedule of a run of `total` steps, resumed from `checkpoint` (None: a fresh run).

    Policy: a schedule keeps the shape it was given for its original total (warmup included).
    When a resume changes the total (trainer.max_steps / trainer.epochs), the steps done keep their
    LR and the rest of the schedule, from the resume step to its end, is stretched (or compressed)
    onto the steps left: the LR goes on from where it was and reaches the schedule's final value at
    the new total, never going back up. After the schedule has ended, extra steps run at its final LR
    (resume_checkpoint warns when that is 0: such steps change nothing). Each change appends a
    warp [resume step, old end, new end], recorded in every checkpoint's RECORD."""
    fresh = _fresh_schedule(args, total)
    if checkpoint is None:
        return fresh
    record, step = read_record(checkpoint), int(CHECKPOINT.match(Path(checkpoint).name).group(1))
    old = record.get("schedule")
    if old is None:  # written before RECORD: the default schedule of the total it was trained for
        old = _fresh_schedule(args, trainer_state(checkpoint).get("max_steps") or total)
    settings = (fresh["type"], fresh["kwargs"], _fresh_schedule(args, old["total"])["warmup"])
    if (old["type"], old["kwargs"], old["warmup"]) != settings:
        log.warning("resume: LR schedule settings changed (resume.allow_changes): a new schedule over %d steps", total)
        return fresh
    end = schedule_end(old)
    if total == end or total <= step:
        return old
    return {**old, "warps": [*old["warps"], [step, end, total]]}


def _warp(schedule: dict, t: float) -> float:
    """The step of the original schedule that step t of the continued one runs at."""
    for start, old_end, new_end in reversed(schedule["warps"]):
        if t > start:
            t = start + (t - start) * (old_end - start) / (new_end - start)
    return t


def _base_lambdas(schedule: dict, groups: int) -> list:
    from transformers.optimization import get_scheduler

    probe = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=1.0)
    base = get_scheduler(
        schedule["type"],
        probe,
        num_warmup_steps=schedule["warmup"],
        num_training_steps=schedule["total"],
        scheduler_specific_kwargs=schedule["kwargs"],
    )
    if not isinstance(base, torch.optim.lr_scheduler.LambdaLR):
        raise UserError(
            f"optim.scheduler={schedule['type']} cannot be continued over a changed total; resume with the "
            "original trainer.max_steps / trainer.epochs"
        )
    return base.lr_lambdas


def lr_factors(schedule: dict, t: float, groups: int = 1) -> list[float]:
    """The LR multiplier of each param group at step t of `schedule`."""
    return [fn(_warp(schedule, t)) for fn in _base_lambdas(schedule, groups)]


def warped_scheduler(schedule: dict, optimizer):
    """A LambdaLR following `schedule` (plain functions: a checkpoint's scheduler state restores
    the step count, never the warps)."""

    def bind(fn):
        return lambda step: fn(_warp(schedule, step))

    lambdas = _base_lambdas(schedule, len(optimizer.param_groups))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [bind(fn) for fn in lambdas])
