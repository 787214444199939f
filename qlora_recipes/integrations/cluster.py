"""Clusters: preemption signals, submitit's requeue, and a multi-node rendezvous from SLURM.

- Signals. SLURM preempts a job with SIGTERM and warns before its time limit with the signal of
  `--signal` (submitit asks for USR2, `SUBMITIT_PREEMPT_SIGNAL`). The guarded trainer
  (lifecycle.PreemptionCallback) catches both, finishes the current step, saves a checkpoint there
  and stops.
- Requeue. Inside a submitit job (hydra/launcher=slurm, or =local) submitit has its own handler on
  that signal: it pickles the job (Hydra's launcher is checkpointable: the same job, same overrides,
  same job dir) and requeues it (`scontrol requeue`; the local executor restarts the task). Called
  from the signal it would exit mid-step and lose the steps since the last save; we call it once
  our checkpoint is sealed (`hand_over`). The requeued job runs with resume=auto added to its
  overrides and continues from that checkpoint.
- Multi-node. `slurm_rendezvous` reads the node rank and the first node of the allocation from
  SLURM's variables, so `qlora launch RECIPE` under `srun` (launch/slurm/multinode.sbatch) builds
  the same torchrun / accelerate command on every node without MASTER_ADDR set by hand.
Light on imports: submitit is imported only inside a submitit job.
"""

from __future__ import annotations

import logging
import os
import re
import signal

log = logging.getLogger(__name__)

DEFAULT_PORT = "29500"


def preemption_signal() -> signal.Signals:
    """The signal SLURM sends before the time limit when asked (`--signal`); submitit's choice."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, f"SIG{name}", signal.SIGUSR2)


def submitit_handler(handler):
    """`handler` if it is submitit's checkpoint-and-requeue handler (this process is a submitit
    job), else None."""
    owner = getattr(handler, "__self__", None)
    if owner is None or not type(owner).__module__.startswith("submitit."):
        return None
    return handler if getattr(handler, "__name__", "") == "checkpoint_and_try_requeue" else None


def hand_over(handler, signame: str) -> None:
    """After our checkpoint is sealed: let submitit checkpoint the job and requeue it. Requeued, it
    exits the process (SystemExit); when submitit will not requeue (timed out too often) the run
    stops as a plain preemption and says why."""
    log.warning("%s: checkpoint saved; submitit requeues this job (it resumes with resume=auto)", signame)
    _resume_when_requeued(handler)
    try:
        handler(preemption_signal(), None)
    except Exception as err:  # submitit's UncompletedJobError: not requeued
        log.warning("submitit did not requeue the job: %s", err)


def stop_with_local_controller() -> None:
    """In a job of submitit's local executor (hydra/launcher=local): the job id submitit shows is
    its controller's pid, which passes SIGTERM on to this trainer but dies of any other signal
    (USR2 included), which would leave this process training on, orphaned, while the sweep fails.
    The kernel sends this process SIGTERM when the controller ends (PR_SET_PDEATHSIG): it saves a
    checkpoint at that step and stops. Linux only; elsewhere nothing changes."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "local" or not os.path.exists("/proc/self"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def _resume_when_requeued(handler) -> None:
    """Add resume=auto to the overrides submitit requeues the job with. The job is Hydra's
    submitit launcher called with (overrides, ...); its `checkpoint` resubmits those same
    arguments, so the requeued job composes the same config plus resume=auto."""
    delayed = getattr(handler.__self__, "_delayed", None)
    args = getattr(delayed, "args", None)
    if not args or not isinstance(args[0], list) or not all(isinstance(o, str) for o in args[0]):
        log.warning("not a Hydra launcher job: the requeued job resumes only if it was started with resume=auto")
        return
    overrides = args[0]
    overrides[:] = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume"] + ["resume=auto"]


# ---------------------------------------------------------------- multi-node rendezvous
def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: "gpu[07-08,11],cpu3" -> "gpu07" (what `scontrol show
    hostnames` lists first)."""
    first = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not first:
        raise ValueError(f"not a SLURM hostlist: {nodelist!r}")
    prefix, ranges = first.group(1), first.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def slurm_rendezvous(env=None) -> tuple[int, str, str] | None:
    """(node rank, first node's address, port) inside a SLURM allocation, else None. MASTER_ADDR /
    MASTER_PORT, where set, win (a cluster whose node names do not resolve)."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist or env.get("SLURM_NODEID") is None:
        return None
    addr = env.get("MASTER_ADDR") or first_host(nodelist)
    return int(env["SLURM_NODEID"]), addr, env.get("MASTER_PORT", DEFAULT_PORT)


def slurm_run_dir(recipe: str, env=None) -> str | None:
    """One run dir for every node of a SLURM job, the same after a requeue (same job id), so the
    requeued job resumes there; None outside SLURM."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    return os.path.join(os.getcwd(), "runs", "slurm", f"{job}-{recipe}") if job else None
