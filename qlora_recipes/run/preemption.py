"""How a training run stops on a signal, alone or as one of several ranks.

`PreemptionCallback`: SIGTERM (preemption), SLURM's time-limit warning or SIGINT (Ctrl-C) finish the
current step, save a checkpoint there and stop. Under several ranks a signal reaches one process (a
scheduler, `kill`, an OOM killer's warning): at every step end the ranks all-reduce (MAX) the signal
number each received, so every rank stops at the same step and they save the checkpoint together
(one rank stopping alone would leave the others waiting in their next collective for ever).
A further signal while the run stops is held until the run has ended: saving a large adapter with
its optimizer state shows nothing for a while, so a second Ctrl-C is likely, and raised as
KeyboardInterrupt it would land between the sealed checkpoint and the run's record (memory.png,
metrics.json). The first further Ctrl-C says so in one line on rank 0; the SIGTERM a launcher or a
sweep's controller adds says nothing. `kill -9` abandons the save: the checkpoint being written
never appears half-written, and those already sealed stay sound.
`RankLost`: another rank ended without that agreement (`kill -9`, a crash); the survivors' collective
fails, and the run ends with one line naming the last checkpoint instead of gloo's traceback.
`faults()`: fault injection for tests, read by lifecycle and this module.
"""

from __future__ import annotations

import os
import signal

from transformers import TrainerCallback

from .. import interrupts
from ..integrations import cluster


class Preempted(Exception):
    """A stop signal ended the run: during training at `step` (a checkpoint saved there), or after
    it, `phase` (e.g. "during the final evaluation"), with the trained `adapter` saved."""

    def __init__(self, signame: str, step: int, checkpoint: str | None, adapter: str | None = None, phase: str = ""):
        super().__init__(f"{signame} {phase or f'at step {step}'}")
        self.signame, self.step, self.checkpoint = signame, step, checkpoint
        self.adapter, self.phase = adapter, phase


class RankLost(Exception):
    """Another rank of the job ended mid-run (killed outright, or failed): this rank's collective
    failed at `step`; `checkpoint` is the newest one the job saved (None: none yet)."""

    def __init__(self, step: int, checkpoint: str | None, cause: str):
        super().__init__(f"another rank of this job ended at step {step} ({cause})")
        self.step, self.checkpoint, self.cause = step, checkpoint, cause


def faults() -> dict[str, int]:
    """QLORA_RECIPES_FAULTS="oom_above_micro_batch=2,nan_at_step=3,sigterm_at_step=4" makes the
    run fail on purpose, so the guards are tested on CPU through the real entry point
    (`eval_wait_s=N`: each evaluation waits N seconds in its first batch, for a signal to land in;
    `fault_rank=R`: the signals and `sigkill_at_step` hit rank R only, as a `kill` of one rank does)."""
    spec = os.environ.get("QLORA_RECIPES_FAULTS", "")
    return {k: int(v) for k, v in (item.split("=") for item in spec.split(",") if item)}


def _inject(step: int) -> None:
    injected = faults()
    if "fault_rank" in injected and injected["fault_rank"] != int(os.environ.get("RANK", 0)):
        return
    if injected.get("sigterm_at_step") == step:
        os.kill(os.getpid(), signal.SIGTERM)
    if injected.get("preempt_at_step") == step:  # what SLURM / submitit send
        os.kill(os.getpid(), cluster.preemption_signal())
    if injected.get("sigkill_at_step") == step:  # a rank killed outright: no handler runs
        os.kill(os.getpid(), signal.SIGKILL)


class PreemptionCallback(TrainerCallback):
    """SIGTERM (preemption), SLURM's time-limit warning (`--signal`, USR2: cluster.py) or SIGINT
    (Ctrl-C): finish the current step, save a checkpoint there, stop; every rank at the same step
    (the module docstring). The caller turns that into a resume hint; inside a submitit job,
    submitit then requeues the job (cluster.hand_over). Signals after the first are held until the
    run has ended, also once the callback is uninstalled after a stop (interrupts.raising puts the
    handlers from before the run back)."""

    def __init__(self):
        self.received: str | None = None  # this process's own signal, at once (a hanging GRPO reward reads it)
        self.agreed: str | None = None  # the signal every rank stops for, at the same step end
        self._several = False
        self._previous = {}
        self._step: int | None = None  # the step every rank stops at, once agreed
        self._saved = False  # the run stopped for a signal and its trainer has ended: the checkpoint is sealed
        self._told = False

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT, cluster.preemption_signal()):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        if not self.stop:  # no stop (or one after the ranks' last agreement, raised again by the caller)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            return
        self._saved = True
        for sig in self._previous:  # the run writes its record next: the signals wait, as during the save
            signal.signal(sig, self._hold)

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
        else:
            self._hold(signum, frame)

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

    @property
    def stop(self) -> str | None:
        """The signal the run stopped for: the ranks' agreed one; in one process also one that came
        after the last step end (its checkpoint is the newest there is)."""
        return self.agreed or (None if self._several else self.received)

    def on_step_end(self, args, state, control, **kwargs):
        _inject(state.global_step)
        self._several = args.world_size > 1
        self.agreed = agreed_signal(self.received, args.device)
        if self.agreed:
            control.should_save = True
            control.should_training_stop = True
            if self._step is None:
                self._step = state.global_step
        return control

    def on_train_end(self, args, state, control, **kwargs):
        # The checkpoint at the stopping step is sealed by now: submitit may requeue (and exit).
        requeue = cluster.submitit_handler(self._previous.get(cluster.preemption_signal()))
        if self.stop and self.stop != "SIGINT" and requeue is not None and args.should_save:
            cluster.hand_over(requeue, self.received)


def agreed_signal(received: str | None, device) -> str | None:
    """The stop signal any rank received (this one's first), the same on every rank: one tiny MAX
    all-reduce per step. One process: `received` as it is."""
    import torch
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() <= 1:
        return received
    mine = int(signal.Signals[received]) if received else 0
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    agreed = int(flag.item())  # one device->host read a step (each .item() on a GPU waits for its queue)
    return received or (signal.Signals(agreed).name if agreed else None)
