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
- Ctrl-C to a local sweep. The parent of a hydra/launcher=local sweep passes a stop signal on to
  each running job's trainer, which saves a checkpoint at that step and stops, and waits for it
  (`stop_local_jobs`): left alone a job trains on, orphaned, after the sweep said it stopped. Its
  controller never sees a terminal's Ctrl-C (`shield_local_controllers`): it would print a
  traceback and kill its trainer a second later, mid-save. SIGTERM to the sweep's whole process
  group (`timeout`, systemd, a container's stop) reaches each controller too, which passes it on as
  a preemption: the parent first marks the sweep as stopping (`sweep_stopping`), and a job that
  sees the mark is not requeued (`hand_over`) nor started again, so every job ends at its checkpoint.
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
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PORT = "29500"
LOCAL_CONTROLLER = "submitit.local._local"  # the module submitit's local executor runs each job's controller as
STOP_WAIT_S = 600.0  # a stopping job finishes its step and saves: minutes at most on a large model
STOP_MARK = "sweep-stopping"  # beside the jobs' submitit folders: the sweep stops, no job goes on
_STOPPING: list[str] = []  # the stop signals passed on to local jobs so far
_MARK: list[Path] = []  # in the parent of a local sweep: where its stop mark goes


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
    stopping = sweep_stopping()
    if stopping:  # the whole sweep stops (its process group was signalled): no job carries on without it
        log.warning("%s: checkpoint saved; the sweep is stopping (%s): this job is not requeued", signame, stopping)
        return
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
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return
    stopping = sweep_stopping()
    if stopping:  # requeued just before its sweep stopped: it does not start again
        from ..interrupts import Interrupted

        raise Interrupted(stopping)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the sweep's, below; a Ctrl-C held till now lands here
    if not os.path.exists("/proc/self"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def track_local_sweep(submitit_folder: str) -> None:
    """In the parent of a hydra/launcher=local sweep, before its jobs start: its stop mark goes beside
    the jobs' submitit folders (`submitit_folder` names each job, %j, under it); an earlier stopped
    sweep's mark there goes, so these jobs run."""
    _MARK[:] = [Path(submitit_folder).parent / STOP_MARK]
    _MARK[0].unlink(missing_ok=True)


def shield_local_controllers() -> None:
    """In the parent of a hydra/launcher=local sweep, before its jobs start: block SIGINT in this
    thread, which starts them, so that their controllers inherit it blocked (a terminal's Ctrl-C
    reaches every process of its group) and their trainers unblock it (stop_with_local_controller).
    A thread started first, with SIGINT unblocked, receives it for this process: Python runs the
    handler in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return
    threading.Thread(target=threading.Event().wait, name="sigint-receiver", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def unshield() -> None:
    if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def stop_local_jobs(signame: str, wait_s: float = STOP_WAIT_S) -> int:
    """In the parent of a hydra/launcher=local sweep: send `signame` to the trainer of each job still
    running (not to its controller, which would SIGKILL it a second later) and wait until their
    controllers have ended (a second Ctrl-C meanwhile exits at once). Returns the number of jobs
    signalled; 0 elsewhere (no /proc, no local jobs). The sweep's stop mark comes first, so that a
    job (re)started from here on sees it, and goes once every job has ended."""
    wait_s = 0.0 if _STOPPING else wait_s  # a second signal: the line now, the jobs finish their saves alone
    _STOPPING.append(signame)
    _mark_stopping(signame)
    sig = getattr(signal, signame)
    controllers = [pid for pid in _children(os.getpid()) if LOCAL_CONTROLLER in _cmdline(pid)]
    trainers = [pid for controller in controllers for pid in _children(controller)]
    heard = [pid for controller in controllers if _pending(controller, sig) for pid in _children(controller)]
    for pid in trainers:
        if pid in heard:  # sent to the whole group (a terminal's Ctrl-C): a second one would cut its save short
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):  # ended meanwhile
            pass
    deadline = time.monotonic() + wait_s
    while controllers and time.monotonic() < deadline:
        controllers = [pid for pid in controllers if not _ended(pid)]
        time.sleep(0.05)
    if not controllers and _MARK:  # no job is left to read it
        _MARK[0].unlink(missing_ok=True)
    return len(trainers)


def _mark_stopping(signame: str) -> None:
    """Mark the sweep as stopping for `signame`: whole (written aside, then renamed), and only
    where its jobs have their submitit folders (none started yet: nothing to mark)."""
    if not _MARK or not _MARK[0].parent.is_dir():
        return
    partial = _MARK[0].with_name(f".{STOP_MARK}.{os.getpid()}")
    try:
        partial.write_text(signame)
        os.replace(partial, _MARK[0])
    except OSError as err:  # a full disk: the jobs still stop at a checkpoint, one may be requeued
        log.warning("could not mark the sweep as stopping in %s: %s", _MARK[0].parent, err)


def sweep_stopping() -> str | None:
    """In a job of a hydra/launcher=local sweep: the signal its sweep is stopping for (the parent's
    mark, beside this job's submitit folder), else None."""
    folder = os.environ.get("SUBMITIT_FOLDER")
    if os.environ.get("SUBMITIT_EXECUTOR") != "local" or not folder:
        return None
    try:
        return (Path(folder).parent / STOP_MARK).read_text().strip() or "SIGTERM"
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """The pids of a process's children, from /proc (Linux); [] elsewhere or once it has ended."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return found


def _pending(pid: int, sig: signal.Signals) -> bool:
    """`sig` waits, blocked, in that process (shield_local_controllers): it was sent to its group."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [line.split()[1] for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:
        return False
    return any(int(mask, 16) >> (int(sig) - 1) & 1 for mask in masks)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ended(pid: int) -> bool:
    """A child of this process has ended (reaped here; submitit's Popen then reads it as ended too)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped already
        return True


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
