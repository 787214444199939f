"""One run's own memory peak, the quantity the plan predicts for the device it runs on.

GPU: `torch.cuda.max_memory_allocated`, its counter reset when the run starts (the plan's
`peak_allocated_gib`). CPU: the process's peak resident set (RSS) from the run's start (so the
load-time peak counts) to its end (the plan's cpu-device peak). On Linux that is the kernel's own
high-water mark (VmHWM in /proc/self/status), reset to the current RSS at the start by writing 5 to
/proc/self/clear_refs: exact, however short the spike. Elsewhere (or where clear_refs is not
writable) a background thread samples the RSS, which can miss a spike shorter than its interval.
`ru_maxrss` is not used: it never resets within a process, so in an in-process multirun every job
would report the cumulative maximum of the jobs before it. Light on imports: the sweep summary
reads `planned_peak_gib` without torch.
"""

from __future__ import annotations

import os
import threading

from ..units import GiB

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


# How far above the RSS read just before a reset the mark may read just after it (the allocations of
# the reset's own reads, the interpreter's other threads) and still count as reset.
RESET_SLACK_BYTES = 64 * 2**20


def reset_rss_high_water_mark() -> bool:
    """Sets this process's VmHWM to its current RSS (Linux >= 4.0); False where that cannot be done,
    or where the mark still reads above the RSS after two tries: a mark that kept an earlier run's peak
    would hand it to this one (seen once in an in-process multirun: the second job reported the
    process's cumulative maximum), so the caller samples instead."""
    for _ in range(2):
        before = rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        mark = rss_high_water_mark()
        if mark is None:
            return False
        if mark <= max(before, rss_bytes()) + RESET_SLACK_BYTES:
            return True
    return False


def rss_high_water_mark() -> int | None:
    """The kernel's peak RSS of this process since start or the last reset (VmHWM), or None."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# glibc mallopt parameters (malloc.h) and the threshold this project pins on CPU runs.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_malloc_thresholds() -> bool:
    """Makes a CPU process's RSS follow its live tensors (glibc only; False elsewhere).

    glibc serves allocations of at least M_MMAP_THRESHOLD bytes with their own mmap, returned to
    the OS on free; but each time such a block is freed it raises the threshold to that block's
    size (up to 32 MiB), so later tensors of that size come from the heap, whose freed pages stay
    resident. A CPU training step frees and allocates tensors of many sizes: RSS then creeps up
    step after step and depends on the order of past allocations (the same step measured twice
    differed by 40 %). Setting the thresholds explicitly turns the adjustment off: every tensor
    of 128 KiB or more is mmapped and gone from RSS when freed, as the memory plan counts it."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES)
        )
    except (OSError, AttributeError):
        return False


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


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's name, and its newer one


def configure_cuda_allocator(expandable: bool) -> str | None:
    """trainer.expandable_segments on a CUDA run, before its first allocation: the caching allocator
    maps segments that grow and shrink (torch.cuda.memory._set_allocator_settings, the runtime form
    of PYTORCH_CUDA_ALLOC_CONF, which vLLM also toggles at run time) instead of caching fixed blocks
    that one step's sizes split and the next step's cannot reuse. A user's own setting in the
    environment wins. Returns what the allocator runs with, for the run's log; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    own = next((f"{v}={os.environ[v]}" for v in ALLOC_CONF_VARS if os.environ.get(v)), None)
    if own:
        return f"CUDA allocator: {own} (from the environment; trainer.expandable_segments left it as set)"
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")
    return f"CUDA allocator: expandable_segments:{expandable} (trainer.expandable_segments)"


class PeakTracker:
    """The peak of one run. `start()` at the run's start, `peak_gib()` any time, `stop()` at its end.

    CPU: the kernel's high-water mark, reset at start; where it cannot be reset, a daemon thread
    samples the RSS every `interval_s` seconds (also at start, at each read and at stop), and a
    spike shorter than the interval can be missed. GPU: resets torch's peak counter at start and
    reads it back (the device's allocations only, not host RSS)."""

    def __init__(self, gpu: bool | None = None, interval_s: float = 0.02):
        if gpu is None:
            import torch

            gpu = torch.cuda.is_available()
        self.gpu, self.interval_s = gpu, interval_s
        self.quantity = quantity(gpu)
        self.exact = False  # CPU: the kernel's high-water mark (else sampled)
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeakTracker:
        if self.gpu:
            import torch

            torch.cuda.reset_peak_memory_stats()
            return self
        self._peak = rss_bytes()
        self.exact = reset_rss_high_water_mark()
        if self.exact:
            return self
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
        self._peak = max(self._peak, rss_bytes(), (self.exact and rss_high_water_mark()) or 0)
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
