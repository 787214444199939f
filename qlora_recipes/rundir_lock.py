"""One run per run dir: `RunDirLock` holds `run.lock` while a run uses the dir; a second run on a
busy run dir is refused, naming the pid that holds it.
"""

import json
import logging
import os
import socket
from pathlib import Path

from .errors import UserError

log = logging.getLogger(__name__)
LOCK = "run.lock"  # in the run dir while a run uses it


# ---------------------------------------------------------------- one run per run dir
class RunDirLock:
    """`run.lock` in the run dir while a run uses it: the owner's pid and host, under an flock that
    the kernel drops when the owner dies. Busy (the flock is held, or the file names a live process
    of this host, or any process of another host) -> UserError naming the pid. Left by a process that
    is gone -> taken over, saying so. `enabled=False` (ranks other than 0): no lock."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir, self.enabled, self.fd = Path(run_dir), enabled, None
        self.path = self.run_dir / LOCK
        self.created = False  # the run dir did not exist: removed again if the run wrote nothing

    def __enter__(self):
        if not self.enabled:
            return self
        import fcntl

        self.created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
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
                if not locked or (holder and holder != me and _alive(holder)):
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
            if holder and holder != me:
                log.warning(
                    "run dir lock %s was left by process %s, which is gone; taking it over", self.path, holder["pid"]
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            self.fd = fd
            return self
        raise UserError(f"could not lock the run dir {self.run_dir} ({self.path} keeps changing); try again")

    def _busy(self, holder: dict | None) -> str:
        who = f"process {holder['pid']} on {holder['host']}" if holder else "another process"
        hint = "wait for it to finish or stop it, or choose another hydra.run.dir"
        if holder and holder["host"] != socket.gethostname():
            hint += f"; if that process is gone, delete {self.path}"
        return f"run dir {self.run_dir} is in use by {who} (lock {self.path}); {hint}"

    def __exit__(self, *exc):
        if self.fd is None:
            return False
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
        return False


def _lock_holder(fd: int) -> dict | None:
    """The pid and host a lock file names (a bare pid: this host), or None when it names none."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
        if isinstance(holder, int):
            return {"pid": holder, "host": socket.gethostname()}
        return {"pid": int(holder["pid"]), "host": str(holder.get("host") or socket.gethostname())}
    except (ValueError, KeyError, TypeError):
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
