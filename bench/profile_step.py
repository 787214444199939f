"""One optimizer step of a training script under torch.profiler, ours or the plain script alike:

    python -m bench.profile_step STEP OUT_DIR train.py ARGS...          # ours
    python -m bench.profile_step STEP OUT_DIR -m bench.baseline ARGS... # the plain TRL script

Every transformers Trainer the script builds gets a callback that profiles optimizer step STEP
(1-based) from its start to the next step's start, so its logging and the next batch's fetch are in
it: the step's whole cost. CUDA activity is recorded where a GPU is, CPU activity always (a CPU run
profiles the same code path on a tiny model). OUT_DIR gets profile.json (the top ops of the
key-averages table by device time, or by CPU time without a GPU, and the step's wall time) and
trace.json.gz (the chrome trace: chrome://tracing, ui.perfetto.dev).
"""

from __future__ import annotations

import gzip
import json
import runpy
import shutil
import sys
import time
from pathlib import Path

TOP = 25  # rows of the key-averages table kept


def _ms(us: float) -> float:
    return round(us / 1000, 3)


def summary(prof, step: int, wall_s: float, cuda: bool) -> dict:
    """The key-averages table's top rows by total device time (CPU time without a GPU)."""
    key = "device_time_total" if cuda else "cpu_time_total"
    averages = list(prof.key_averages())
    averages.sort(key=lambda e: getattr(e, key), reverse=True)
    rows = [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_ms": _ms(e.self_cpu_time_total),
            "cpu_total_ms": _ms(e.cpu_time_total),
            "self_device_ms": _ms(e.self_device_time_total),
            "device_total_ms": _ms(e.device_time_total),
        }
        for e in averages[:TOP]
    ]
    return {
        "step": step,
        "step_wall_s": round(wall_s, 4),
        "activities": ["cpu", "cuda"] if cuda else ["cpu"],
        "sort_by": key,
        # all ops' own time: on a GPU the device's busy time in the step, against its wall time
        "self_device_ms_all": _ms(sum(e.self_device_time_total for e in averages)),
        "self_cpu_ms_all": _ms(sum(e.self_cpu_time_total for e in averages)),
        "rows": rows,
    }


class _Window:
    """Profiles optimizer step `step` of the first Trainer that reaches it."""

    def __init__(self, step: int, out: Path):
        self.step, self.out = step, out
        self.prof = None
        self.started = 0.0
        self.done = False

    def begin(self, global_step: int) -> None:
        """At a step's start: stop the profiled step (the one before), or start it."""
        if self.prof is not None:
            self.stop()
        elif not self.done and global_step == self.step - 1:
            self.start()

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self.prof = profile(activities=activities)
        self.prof.start()
        self.started = time.perf_counter()

    def stop(self) -> None:
        import torch

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()  # the step's kernels are in its window
        wall = time.perf_counter() - self.started
        self.prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        raw = self.out / "trace.json"
        self.prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(self.out / "trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        (self.out / "profile.json").write_text(json.dumps(summary(self.prof, self.step, wall, cuda), indent=1) + "\n")
        print(f"[bench] profiled step {self.step}: {wall:.3f} s, written to {self.out}", flush=True)
        self.prof, self.done = None, True


def install(step: int, out: Path) -> _Window:
    """Give every Trainer built from now on the profiling callback."""
    from transformers import Trainer, TrainerCallback

    window = _Window(step, out)

    class ProfileStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            window.begin(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if window.prof is not None:  # the profiled step was the last
                window.stop()

    init = Trainer.__init__

    def profiled_init(trainer, *args, **kwargs):
        init(trainer, *args, **kwargs)
        trainer.add_callback(ProfileStep())

    Trainer.__init__ = profiled_init
    return window


def main(argv: list[str]) -> None:
    step, out, rest = int(argv[0]), Path(argv[1]), argv[2:]
    if step < 1 or not rest:
        raise SystemExit("usage: python -m bench.profile_step STEP OUT_DIR (SCRIPT | -m MODULE) ARGS...")
    install(step, out)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(rest)
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
