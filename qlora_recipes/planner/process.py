"""The CPU process baseline a plan adds: this process's own footprint when a run measured it at its
start, else the stated constant (`qlora plan`, which has no training process to measure).

Part of a process's RSS is clean file-backed pages of the shared libraries (torch's alone are
hundreds of MiB), resident or not depending on the page cache and the kernel's fault-around, not on
anything the plan models: after the same imports, one venv measured 128 MiB of them and another of
the same packages 75 MiB. A run reads its own RSS once its libraries are imported (`train()`'s
start) and plans with that plus what a run adds after it (CPU_PROCESS_AFTER_START_BYTES), so the
planned and the measured peak count the same pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..config.devices import BF16_CPU_FLAGS, cpu_flags
from .constants import CPU_NATIVE_BF16_KERNELS_BYTES, CPU_PROCESS_AFTER_START_BYTES, CPU_PROCESS_BASELINE_BYTES

_start_rss: int | None = None


@contextmanager
def measured_start(rss: int) -> Iterator[None]:
    """Plans made inside use `rss` (this process's RSS at the run's start) for the process baseline."""
    global _start_rss
    previous, _start_rss = _start_rss, rss
    try:
        yield
    finally:
        _start_rss = previous


def kernel_bytes(dtype: str) -> int:
    """The bf16 kernels' workspace of a run that measured its start, where this CPU computes bf16
    natively: made by the first bf16 op, after loading (peaks.py leaves it out of the load phase)."""
    native_bf16 = dtype == "bfloat16" and any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)
    return CPU_NATIVE_BF16_KERNELS_BYTES if native_bf16 and _start_rss is not None else 0


def cpu_process_baseline() -> int:
    """Bytes of a CPU training process apart from what the plan models (its bf16 kernels: kernel_bytes)."""
    if _start_rss is None:
        return CPU_PROCESS_BASELINE_BYTES
    return _start_rss + CPU_PROCESS_AFTER_START_BYTES


def baseline_source(dtype: str) -> dict:
    """What the baseline is, for plan.json: the measured start RSS and the allowance, or the constant."""
    if _start_rss is None:
        return {"kind": "constant", "bytes": CPU_PROCESS_BASELINE_BYTES}
    return {
        "kind": "measured at the run's start",
        "start_rss": _start_rss,
        "after_start": CPU_PROCESS_AFTER_START_BYTES,
        "bf16_kernels": kernel_bytes(dtype),
    }
