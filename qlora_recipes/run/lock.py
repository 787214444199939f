"""One run per run dir: `RunDirLock` holds `run.lock` while a run uses the dir; a second run on a
busy run dir is refused, naming the pid that holds it.

Under SLURM the lock also records the job id and its restart count: a job that SLURM requeued after
a hard kill (node failure, preemption without a clean exit) may start on another node, where the pid
in the lock cannot be checked; that same job, started again (a higher SLURM_RESTART_COUNT), takes the
lock over, since SLURM starts a requeued job only once its earlier start has ended.
"""

import getpass
import json
import logging
import os
import socket
from pathlib import Path

from ..errors import UserError
from ..interrupts import sigint_deferred

log = logging.getLogger(__name__)
LOCK = "run.lock"  # in the run dir while a run uses it


# ---------------------------------------------------------------- one run per run dir
class RunDirLock:
    """`run.lock` in the run dir while a run uses it: the owner's pid, host and user (and SLURM job),
    under an flock that the kernel drops when the owner dies. Busy (the flock is held, or the file
    names a live process of this host, or any process of another host) -> UserError naming the pid.
    Left by a process that is gone, or by an earlier start of this requeued SLURM job -> taken over,
    saying so. `enabled=False` (ranks other than 0): no lock."""

    def __init__(self, run_dir: Path, enabled: bool = True, path: Path | None = None, busy: str | None = None):
        """`path`: the lock file (default run_dir/run.lock); `busy`: what is in use and the way out, for
        a lock beside something else than a run dir (a merge's output)."""
        self.run_dir, self.enabled, self.fd = Path(run_dir), enabled, None
        self.path = Path(path) if path is not None else self.run_dir / LOCK
        self.busy = busy
        self.created = False  # the run dir did not exist: removed again if the run wrote nothing

    def __enter__(self):
        if not self.enabled:
            return self
        try:
            with sigint_deferred():  # a Ctrl-C waits: the run dir and run.lock are made whole, or not at all
                self._acquire()
        except KeyboardInterrupt:  # the Ctrl-C held while locking: `with` will not call __exit__, so here
            self.__exit__(None, None, None)
            raise
        return self

    def _acquire(self):
        import fcntl

        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = _identity()
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    locked = False
                except OSError:  # a filesystem without flock: the pid in the file decides alone
                    locked = True
                holder = _lock_holder(fd)
                others = holder is not None and not _same_process(holder, me)
                requeue = others and _requeue_of(holder, me)
                if not locked or (others and not requeue and _alive(holder)):
                    raise UserError(self._busy(holder))
                try:
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if not same:  # its owner removed it as we opened it: try again
                    os.close(fd)
                    continue
            except BaseException:
                os.close(fd)
                raise
            if others:
                self._say_taken_over(holder, me, requeue)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            self.fd = fd
            return self
        raise UserError(f"could not lock the run dir {self.run_dir} ({self.path} keeps changing); try again")

    def _say_taken_over(self, holder: dict, me: dict, requeue: bool) -> None:
        if requeue:
            log.warning(
                "run dir lock %s was held by SLURM job %s on %s (restart %d); this is that job requeued "
                "(restart %d), so its earlier start has ended: taking the lock over",
                self.path,
                me["slurm_job_id"],
                holder["host"],
                holder.get("slurm_restart_count", 0),
                me["slurm_restart_count"],
            )
        else:
            log.warning(
                "run dir lock %s was left by process %s, which is gone; taking it over", self.path, holder["pid"]
            )

    def _busy(self, holder: dict | None) -> str:
        who = f"process {holder['pid']} on {holder['host']}" if holder else "another process"
        if holder and holder.get("slurm_job_id"):
            who += f" (SLURM job {holder['slurm_job_id']})"
        what, hint = (f"run dir {self.run_dir}", "wait for it to finish or stop it, or choose another hydra.run.dir")
        if self.busy is not None:
            what, _, hint = self.busy.partition("; ")
        if holder and holder["host"] != socket.gethostname():
            hint += f"; if that process is gone, delete {self.path}"
        return f"{what} is in use by {who} (lock {self.path}); {hint}"

    def __exit__(self, *exc):
        if self.fd is None:
            return False
        with sigint_deferred():  # run.lock and a run dir this run made go together
            self._release()
        return False

    def _release(self) -> None:
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None
        if self.created:
            try:
                self.run_dir.rmdir()  # a run refused before writing anything leaves no dir
            except OSError:
                pass


def _identity() -> dict:
    """What the lock records of this process: pid, host, user; under SLURM the job id and restart count."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    me = {"pid": os.getpid(), "host": socket.gethostname(), "user": user}
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        me["slurm_job_id"] = job
        me["slurm_restart_count"] = _count(os.environ.get("SLURM_RESTART_COUNT"))
    return me


def _count(value) -> int:
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError):
        return 0


def _same_process(holder: dict, me: dict) -> bool:
    return holder["pid"] == me["pid"] and holder["host"] == me["host"]


def _requeue_of(holder: dict, me: dict) -> bool:
    """Whether this process is a later start of the SLURM job (same user) that wrote the lock. The same
    start (another step of one allocation, e.g. two sruns) is not: that one may still run."""
    job = me.get("slurm_job_id")
    return (
        bool(job)
        and holder.get("slurm_job_id") == job
        and holder.get("user", me["user"]) == me["user"]
        and me["slurm_restart_count"] > holder.get("slurm_restart_count", 0)
    )


def _lock_holder(fd: int) -> dict | None:
    """What a lock file records (a bare pid: a process of this host), or None when it names none."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
        if isinstance(holder, int):
            return {"pid": holder, "host": socket.gethostname()}
        found = {"pid": int(holder["pid"]), "host": str(holder.get("host") or socket.gethostname())}
        if holder.get("user") is not None:
            found["user"] = str(holder["user"])
        if holder.get("slurm_job_id"):
            found["slurm_job_id"] = str(holder["slurm_job_id"])
            found["slurm_restart_count"] = _count(holder.get("slurm_restart_count"))
        return found
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process a lock names still runs; one on another host cannot be checked: alive."""
    if holder["host"] != socket.gethostname():
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
