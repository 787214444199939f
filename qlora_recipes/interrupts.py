"""Ctrl-C at any moment is a KeyboardInterrupt where our code can handle it: never inside an import,
never lost inside a finalizer.

A KeyboardInterrupt raised while a module is being imported leaves it half-initialised in the
libraries that import it lazily: numpy's `np.dtypes`, reached from accelerate through transformers,
then fails on next use with a RecursionError and a ModuleNotFoundError chain — a traceback instead
of the one "stopped by SIGINT" line. So a Ctrl-C that arrives while the main thread is inside an
import waits until that import has finished (imports take seconds at most), then raises as usual;
a second Ctrl-C meanwhile raises at once, whatever it cuts short. One that Python swallows in a finalizer (a `__del__`, a weakref callback: "Exception ignored in
...") is delivered again once the finalizer has returned. Handlers installed later (the trainer's
save-and-stop) replace this one; a delivery still waiting then reaches them.

No dependency beyond the standard library: train.py installs this before anything heavy.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator

_IMPORT_MACHINERY = ("<frozen importlib._bootstrap", "<frozen importlib._bootstrap_external")
_POLL_S = 0.02
_waiting = threading.Event()  # a delivery is scheduled: one watcher at a time
_received = threading.Event()


def received() -> bool:
    """A Ctrl-C came while our handler was in place: an error that follows may be its doing (a
    KeyboardInterrupt inside a library's object set-up can surface as that library's error)."""
    return _received.is_set()


def install() -> None:
    """Our SIGINT handler in place of Python's default one (only that: a handler someone else
    installed, or SIGINT ignored as in a background job, is left as it is)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable


def _on_sigint(signum, frame) -> None:
    _received.set()
    if _unsafe(frame) and not _waiting.is_set():  # a second Ctrl-C while one waits: now, whatever it cuts
        _deliver_when_safe()
        return
    raise KeyboardInterrupt


def _unsafe(frame) -> bool:
    """The main thread is inside an import or inside our unraisable hook (a finalizer's aftermath)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_IMPORT_MACHINERY) or code is _unraisable.__code__:
            return True
        frame = frame.f_back
    return False


def _deliver_when_safe() -> None:
    _waiting.set()
    threading.Thread(target=_watch, name="sigint-after-import", daemon=True).start()


def _watch() -> None:
    main = threading.main_thread()
    while main.is_alive() and _unsafe(sys._current_frames().get(main.ident)):
        time.sleep(_POLL_S)
    _waiting.clear()
    if main.is_alive():
        _thread.interrupt_main()  # whatever handles SIGINT now runs; ours checks again


def _unraisable(unraisable) -> None:
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        _deliver_when_safe()
        return
    sys.__unraisablehook__(unraisable)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C while a group of files is written, then deliver it: the group is all or nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        signal.raise_signal(signal.SIGINT)
