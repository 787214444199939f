"""Ctrl-C at any moment is a KeyboardInterrupt where our code can handle it: never inside an import,
never lost inside a finalizer. SIGTERM (a preemption, a scheduler's kill) is raised the same way, as
`Interrupted` (a KeyboardInterrupt that names its signal): every handler of Ctrl-C stops the run
cleanly for it too (run.lock released, one line), where Python's default would end the process at
once, mid-write, with no line.

A KeyboardInterrupt raised while a module is being imported leaves it half-initialised in the
libraries that import it lazily: numpy's `np.dtypes`, reached from accelerate through transformers,
then fails on next use with a RecursionError and a ModuleNotFoundError chain — a traceback instead
of the one "stopped by SIGINT" line. So a Ctrl-C that arrives while the main thread is inside an
import waits until that import has finished (imports take seconds at most), then raises as usual;
a second Ctrl-C meanwhile raises at once, whatever it cuts short. One that Python swallows in a finalizer (a `__del__`, a weakref callback: "Exception ignored in
...") is delivered again once the finalizer has returned. Handlers installed later (the trainer's
save-and-stop) replace this one; a delivery still waiting then reaches them.

Until the command holds anything (a run dir's lock, a group of files being written, a run under
way: `raising` and `sigint_deferred` mark it), a stop signal ends the process at once with the
entry point's one line: start-up is mostly one long import (transformers, torch), and a Ctrl-C
held until it ends would wait ten seconds, with nothing to clean up in exchange.

No dependency beyond the standard library: train.py installs this before anything heavy.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

_IMPORT_MACHINERY = ("<frozen importlib._bootstrap", "<frozen importlib._bootstrap_external")
_POLL_S = 0.02
_waiting = threading.Event()  # a delivery is scheduled: one watcher at a time
_received: list[str] = []  # the names of the stop signals our handler got
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_at_once: list[Callable[[str], str]] = []  # while nothing is held: the entry point's line for a signal
_before_exit_at_once: list[Callable[[], object]] = []  # undo what the command made so far (an empty run dir)


class Interrupted(KeyboardInterrupt):
    """A stop signal other than Ctrl-C (SIGTERM; SLURM's time-limit warning during a run), raised
    where and as Ctrl-C is; `signame` names it."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


def signal_name(err: BaseException) -> str:
    """The signal a KeyboardInterrupt stands for: SIGINT unless it is an `Interrupted`."""
    return getattr(err, "signame", "SIGINT")


def described(signame: str) -> str:
    return "SIGINT (Ctrl-C)" if signame == "SIGINT" else signame


def starting_line(signame: str) -> str:
    """The line for a stop signal before the command wrote anything."""
    return f"stopped by {described(signame)} while starting; nothing was written"


def exit_code(signame: str) -> int:
    """143 for SIGTERM (what the shell reports for a process it ended), 130 for the others."""
    return 143 if signame == "SIGTERM" else 130


def received() -> str | None:
    """The stop signal (SIGINT, SIGTERM) that came while our handler was in place, or None: an error
    that follows may be its doing (a KeyboardInterrupt inside a library's object set-up can surface
    as that library's error)."""
    return _received[-1] if _received else None


def install(starting_line: Callable[[str], str] | None = None) -> None:
    """Our handler for SIGINT and SIGTERM in place of Python's default ones (only those: a handler
    someone else installed, or a signal ignored as SIGINT is in a background job, is left as it is).
    `starting_line(signame)`: until the command holds anything, a stop signal prints it and exits."""
    if threading.current_thread() is not threading.main_thread():
        return
    if starting_line is not None:
        _at_once[:] = [starting_line]
    for sig in STOP_SIGNALS:
        _take_over(sig)
    sys.unraisablehook = _unraisable


def before_exit_at_once(undo: Callable[[], object]) -> None:
    """`undo()` runs first if a stop signal ends the process before it holds anything: e.g. the
    empty run dir Hydra made for this run is removed again, as "nothing was written" says."""
    _before_exit_at_once.append(undo)


def holding() -> None:
    """From here the command holds something a stop signal must let go of (a lock, files being
    written): signals raise where our code handles them, no longer end the process at once."""
    _at_once.clear()


def _exit_at_once(name: str) -> None:
    for undo in _before_exit_at_once:
        with contextlib.suppress(BaseException):
            undo()
    with contextlib.suppress(BaseException):  # the main thread may have been inside a write to stdout
        sys.stdout.flush()
    os.write(2, f"{_at_once[0](name)}\n".encode())
    os._exit(exit_code(name))


def _take_over(sig: signal.Signals):
    """Put our handler on `sig` where Python's default is (or ours already); returns the previous one."""
    previous = signal.getsignal(sig)
    if previous in (signal.default_int_handler, signal.SIG_DFL, _on_signal):
        signal.signal(sig, _on_signal)
    return previous


@contextlib.contextmanager
def raising(*signals: signal.Signals) -> Iterator[None]:
    """While a run lasts, these signals (default-handled ones only) raise as Ctrl-C does: a run
    called in-process (tests, a sweep) stops cleanly too. The handlers before are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    holding()
    previous = {sig: _take_over(sig) for sig in dict.fromkeys(signals)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    _received.append(name)
    if _at_once:
        _exit_at_once(name)
    if _unsafe(frame) and not _waiting.is_set():  # a second signal while one waits: now, whatever it cuts
        _deliver_when_safe(signum)
        return
    raise KeyboardInterrupt if name == "SIGINT" else Interrupted(name)


def _unsafe(frame) -> bool:
    """The main thread is inside an import or inside our unraisable hook (a finalizer's aftermath)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_IMPORT_MACHINERY) or code is _unraisable.__code__:
            return True
        frame = frame.f_back
    return False


def _deliver_when_safe(signum: int) -> None:
    _waiting.set()
    threading.Thread(target=_watch, args=(signum,), name="signal-after-import", daemon=True).start()


def _watch(signum: int) -> None:
    main = threading.main_thread()
    while main.is_alive() and _unsafe(sys._current_frames().get(main.ident)):
        time.sleep(_POLL_S)
    _waiting.clear()
    if main.is_alive():
        _thread.interrupt_main(signum)  # whatever handles the signal now runs; ours checks again


def _unraisable(unraisable) -> None:
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        name = signal_name(unraisable.exc_value) if unraisable.exc_value is not None else "SIGINT"
        _deliver_when_safe(signal.Signals[name])
        return
    sys.__unraisablehook__(unraisable)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a group of files is written, then deliver the first that came:
    the group is all or nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    holding()
    received = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)
    if received:
        signal.raise_signal(received[0])
