"""A further stop signal while a run is already stopping for one.

The first SIGINT / SIGTERM / SLURM warning during training makes the run finish its step, seal a
checkpoint there and write metrics.json marked preempted (preemption.PreemptionCallback). Saving a
large adapter with its optimizer state takes a while and shows nothing, so a second Ctrl-C is
likely; raised as KeyboardInterrupt it would land after the checkpoint and before the record (the
run's memory.png, then metrics.json) and the run would end with no metrics.json. Here a further
signal is held instead, from the first one until the run has ended (interrupts.raising puts the
handlers from before the run back): the run stops exactly as it would have. The first further
Ctrl-C says so in one line on rank 0 (the SIGTERM a launcher or a sweep's controller adds says
nothing). `kill -9` abandons the save: the checkpoint being written never appears half-written, and
those already sealed stay sound.
"""

from __future__ import annotations

import os
import signal

from .. import interrupts
from .preemption import PreemptionCallback as _Preemption


class PreemptionCallback(_Preemption):
    """preemption.PreemptionCallback, stopping for the first signal it gets: later ones are held
    until the run has ended, also once the callback is uninstalled after a stop."""

    def __init__(self):
        super().__init__()
        self._step: int | None = None  # the step every rank stops at, once agreed
        self._saved = False  # the run stopped for a signal and its trainer has ended: the checkpoint is sealed
        self._told = False

    def _handle(self, signum, frame):
        if self.received is None:
            super()._handle(signum, frame)
        else:
            self._hold(signum, frame)

    def on_step_end(self, args, state, control, **kwargs):
        control = super().on_step_end(args, state, control, **kwargs)
        if self.agreed and self._step is None:
            self._step = state.global_step
        return control

    def uninstall(self):
        if not self.stop:  # no stop (or one after the ranks' last agreement, raised again by the caller)
            super().uninstall()
            return
        self._saved = True
        for sig in self._previous:  # the run writes its record next: the signals wait, as during the save
            signal.signal(sig, self._hold)

    def _hold(self, signum, frame) -> None:
        if signum != signal.SIGINT or self._told or int(os.environ.get("RANK", 0)) != 0:
            return
        self._told = True
        os.write(2, f"{self.stopping_line()}\n".encode())  # not print: the main thread may be inside one

    def stopping_line(self) -> str:
        """What the run is doing while it stops, and that a further Ctrl-C changes nothing."""
        at = f" at step {self._step}" if self._step is not None else ""
        if self._saved:
            doing = f"the checkpoint{at} is sealed; writing metrics.json"
        elif at:
            doing = f"saving the checkpoint{at}"
        else:
            doing = "finishing this step to save a checkpoint there"
        return (
            f"already stopping for {interrupts.described(self.received or 'SIGINT')}: {doing}, then the run ends "
            "(Ctrl-C again is ignored; kill -9 would abandon the save, the checkpoints already sealed stay sound)"
        )
