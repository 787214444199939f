"""Trainer callbacks: memory timeline (memory.jsonl, TensorBoard scalars, memory.png drawn by
outputs/memory_chart.py), and how far an evaluation has got."""

import json
import logging
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..outputs import memory_chart
from .memory import GiB, PeakTracker, rss_bytes

log = logging.getLogger("train")
EVAL_PROGRESS_S = 30.0  # a line about an evaluation this often, however it is displayed


class EvalProgress(TrainerCallback):
    """A long evaluation is not silent: every EVAL_PROGRESS_S seconds one line with the batches done
    of all, and the time so far (the progress bar, when shown, is no log: trainer.progress_bar=false
    and batch jobs show none)."""

    def __init__(self, every_s: float = EVAL_PROGRESS_S):
        self.every_s, self.started, self.last, self.done = every_s, None, 0.0, 0

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        now = time.monotonic()
        if self.started is None:
            self.started, self.last, self.done = now, now, 0
        self.done += 1
        if state.is_world_process_zero and now - self.last >= self.every_s:
            total = len(eval_dataloader) if eval_dataloader is not None and hasattr(eval_dataloader, "__len__") else "?"
            log.info("evaluation: batch %d of %s, %.0f s so far", self.done, total, now - self.started)
            self.last = now

    def on_evaluate(self, args, state, control, **kwargs):
        self.started = None


class EvalBeforeTraining(TrainerCallback):
    """The objective's eval figures before the first step, for sharded runs: under FSDP2 accelerate
    prepares the model only together with its optimizer (an evaluate() before train() is refused:
    "a model and optimizer must be passed together"), and ZeRO builds its engine once, in train().
    So the evaluation runs as training begins, on the prepared model and before any update; a
    resumed run (past step 0) has no before figures. Its log entry is dropped, as one process's
    evaluate() before train() leaves none in the run's history."""

    def __init__(self, trainer, into: dict):
        self.trainer, self.into = trainer, into

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and not self.into:
            logged = len(state.log_history)
            self.into.update(self.trainer.evaluate())
            del state.log_history[logged:]


def memory_sample(tracker: PeakTracker | None = None) -> dict:
    """GPU: allocated / reserved / peak allocated (since the run's start when its tracker reset the
    counter). CPU: current RSS of this process and the run's peak RSS (its tracker's; without one,
    the current RSS)."""
    if torch.cuda.is_available():
        return {
            "allocated_gib": torch.cuda.memory_allocated() / GiB,
            "reserved_gib": torch.cuda.memory_reserved() / GiB,
            "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        }
    rss = rss_bytes() / GiB
    return {"rss_gib": rss, "peak_gib": max(rss, tracker.peak_gib()) if tracker is not None else rss}


class MemoryLogger(TrainerCallback):
    """Every `every` steps and at the end: a memory sample into memory.jsonl and TensorBoard. memory.png
    (draw_png) is drawn after the timed part of the run, so that training time and tokens/s leave it out."""

    def __init__(self, run_dir: Path, every: int, tb_writer=None, tracker: PeakTracker | None = None, planned=None):
        self.path, self.every, self.tb = run_dir / "memory.jsonl", max(1, every), tb_writer
        self.png = run_dir / "memory.png"
        self.tracker, self.planned = tracker, planned  # planned: (GiB, quantity name) or None
        self.started = time.time()

    def _record(self, step: int) -> None:
        sample = {"step": step, "t_s": round(time.time() - self.started, 3), **memory_sample(self.tracker)}
        with open(self.path, "a") as f:
            f.write(json.dumps(sample) + "\n")
        if self.tb is not None:
            for key, value in sample.items():
                if key.endswith("_gib"):
                    self.tb.add_scalar(f"memory/{key}", value, step)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step % self.every == 0:
            self._record(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._record(state.global_step)

    def draw_png(self) -> memory_chart.Drawing | None:
        """Begins drawing memory.png from the samples in a child process (none on a rank other than 0,
        or before the first step); the caller waits for it before listing the run's files."""
        if self.path.exists():
            return memory_chart.start(self.path, self.png, self.planned)
        return None


class RunDirKept(TrainerCallback):
    """Tells the run dir's RunDirChanges (run/reuse.py) that training started and when the first
    checkpoint is saved: from then on a failure keeps what the run wrote, and a run it replaced goes."""

    def __init__(self, changes):
        self.changes = changes

    def on_train_begin(self, args, state, control, **kwargs):
        self.changes.started()

    def on_save(self, args, state, control, **kwargs):
        self.changes.keep()
