"""One run's own memory peak, the quantity the plan predicts for the device it runs on.

GPU: `torch.cuda.max_memory_allocated`, its counter reset when the run starts (the plan's
`peak_allocated_gib`). CPU: the process's resident set (RSS), sampled by a background thread from
the run's start (so the load-time peak counts) to its end (the plan's cpu-device peak).
`ru_maxrss` is not used: it never resets within a process, so in an in-process multirun every job
would report the cumulative maximum of the jobs before it. Light on imports: the sweep summary
reads `planned_peak_gib` without torch.
"""

from __future__ import annotations

import os
import threading

from .units import GiB

GPU_QUANTITY = "cuda max_memory_allocated"
CPU_QUANTITY = "process RSS"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """This process's resident set now: /proc/self/statm where there is one, psutil elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def quantity(gpu: bool) -> str:
    return GPU_QUANTITY if gpu else CPU_QUANTITY


def plan_on_gpu(plan: dict) -> bool:
    """Whether a plan was made for GPUs (a cuda device in it)."""
    return any(str(d.get("device", "")).startswith("cuda") for d in plan.get("devices") or [])


def planned_peak_gib(plan: dict, gpu: bool | None = None) -> float | None:
    """The plan's prediction of the measured quantity: on GPU the allocated peak
    (`peak_allocated_gib`), on CPU the cpu device's peak (process RSS). `gpu=None`: whichever the
    plan was made for (a cuda device in it)."""
    devices = plan.get("devices") or []
    if gpu is None:
        gpu = plan_on_gpu(plan)
    if gpu:
        return plan.get("peak_allocated_gib")
    cpu = [d["peak"] for d in devices if d.get("device") == "cpu" and d.get("peak") is not None]
    return round(cpu[0] / GiB, 3) if cpu else plan.get("peak_gib")


class PeakTracker:
    """The peak of one run. `start()` at the run's start, `peak_gib()` any time, `stop()` at its end.

    CPU: a daemon thread samples the RSS every `interval_s` seconds (also at start, at each read and
    at stop); a spike shorter than the interval between samples can be missed. GPU: resets torch's
    peak counter at start and reads it back (the device's allocations only, not host RSS)."""

    def __init__(self, gpu: bool | None = None, interval_s: float = 0.02):
        if gpu is None:
            import torch

            gpu = torch.cuda.is_available()
        self.gpu, self.interval_s = gpu, interval_s
        self.quantity = quantity(gpu)
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakTracker:
        if self.gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
            return self
        self._peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="rss-peak", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, rss_bytes())

    def peak_gib(self) -> float:
        """The peak since start(), in GiB."""
        if self.gpu:
            import torch

            return torch.cuda.max_memory_allocated() / GiB
        self._peak = max(self._peak, rss_bytes())
        return self._peak / GiB

    def stop(self) -> float:
        """Stops the sampler; returns the run's peak in GiB."""
        peak = self.peak_gib()
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return peak

    def __enter__(self) -> PeakTracker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
