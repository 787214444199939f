"""How a peak is measured: per tracker, falling back to the plan's device; the CPU peak is the kernel's
high-water mark; pinned malloc thresholds give freed tensors back."""

import subprocess
import sys

import pytest
import torch

from qlora_recipes.run import memory

GiB = 2**30


def _in_a_fresh_process(code: str) -> str:
    """A process's RSS high-water mark is what these read: measured in a process of its own, so that no
    earlier test's resident heap (which a new tensor may reuse) hides the peak."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_tracker_peak_is_per_tracker_and_falls_back_to_the_plan_device():
    if torch.cuda.is_available():
        pytest.skip("the CPU sampler")
    code = """
import torch
from qlora_recipes.run import memory
GiB = 2**30
with memory.PeakTracker(gpu=False) as first:
    held = torch.ones(GiB // 8)  # 512 MiB, touched
    held.add_(1)
    during = first.peak_gib()
    del held
with memory.PeakTracker(gpu=False) as second:
    after = second.peak_gib()
print(during, after, first.stop())
"""
    during, after, first_stop = map(float, _in_a_fresh_process(code).split())
    assert during > after + 0.4 and first_stop >= during
    assert memory.planned_peak_gib({"devices": [{"device": "cpu", "peak": GiB}], "peak_gib": 9.0}) == 1.0
    gpu_plan = {"devices": [{"device": "cuda:0", "peak": 9 * GiB}], "peak_gib": 9.0, "peak_allocated_gib": 7.5}
    assert memory.planned_peak_gib(gpu_plan) == 7.5 and memory.plan_on_gpu(gpu_plan)


def test_cpu_peak_is_the_kernels_high_water_mark_and_sees_a_spike_no_sampler_would():
    """A 256 MiB tensor that lives for microseconds: the tracker's peak has it (VmHWM, reset at
    start), while the RSS before and after does not."""
    if torch.cuda.is_available() or not memory.reset_rss_high_water_mark():
        pytest.skip("Linux CPU: /proc/self/clear_refs")
    code = """
import torch
from qlora_recipes.run import memory
GiB = 2**30
with memory.PeakTracker(gpu=False, interval_s=3600) as tracker:  # a sampler this slow sees nothing
    assert tracker.exact
    before = memory.rss_bytes()
    torch.ones(GiB // 16).add_(1)  # 256 MiB, touched, freed at once
    spike = tracker.peak_gib() * GiB - before
print(spike / GiB)
"""
    spike = float(_in_a_fresh_process(code))
    assert spike > 0.9 / 4, spike


def test_pinned_malloc_thresholds_give_freed_tensors_back():
    """After pin_malloc_thresholds, freeing tensors of many sizes (which would raise glibc's dynamic
    mmap threshold and leave them on the heap) returns their pages: RSS falls back to where it was.
    In a fresh process each way, so no earlier test's heap is measured."""
    code = """
import sys, torch
from qlora_recipes.run import memory
if sys.argv[1] == "pin" and not memory.pin_malloc_thresholds():
    print("unsupported"); raise SystemExit
torch.ones(2**10).add_(1)  # the first op's own set-up (thread pool, kernels) is not what is measured
before = memory.rss_bytes()
for mib in (2, 6, 16, 31, 10, 4, 24, 31, 8, 12):
    torch.ones(mib * 2**18).add_(1)
print((memory.rss_bytes() - before) / 2**20)
"""
    kept = {}
    for mode in ("pin", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True).stdout
        if out.strip() == "unsupported":
            pytest.skip("glibc only")
        kept[mode] = float(out.strip().splitlines()[-1])
    assert kept["pin"] < 8 < 24 < kept["default"], kept  # MiB still resident after the frees


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_the_cuda_allocator_is_left_alone_without_cuda(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert memory.configure_cuda_allocator(True) is None


def test_expandable_segments_are_set_unless_the_environment_sets_the_allocator(monkeypatch):
    """The choice of the run's own settings, with CUDA's presence and torch's setter stood in for."""
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", set_to.append)
    for var in memory.ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    assert memory.configure_cuda_allocator(True) == (
        "CUDA allocator: expandable_segments:True (trainer.expandable_segments)"
    )
    assert memory.configure_cuda_allocator(False).endswith("expandable_segments:False (trainer.expandable_segments)")
    assert set_to == ["expandable_segments:True", "expandable_segments:False"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    line = memory.configure_cuda_allocator(True)
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128" in line and "from the environment" in line
    assert len(set_to) == 2  # the user's setting is kept


def test_a_high_water_mark_that_does_not_reset_falls_back_to_sampling(monkeypatch):
    """A mark still holding an earlier peak after the reset would be reported as this run's own: the
    tracker samples the RSS instead, and its peak is the RSS it saw, not the stale mark."""
    if torch.cuda.is_available() or not memory.reset_rss_high_water_mark():
        pytest.skip("Linux CPU: /proc/self/clear_refs")
    stale = memory.rss_bytes() + 4 * GiB
    monkeypatch.setattr(memory, "rss_high_water_mark", lambda: stale)
    assert not memory.reset_rss_high_water_mark()
    with memory.PeakTracker(gpu=False, interval_s=0.01) as tracker:
        assert not tracker.exact and tracker._thread is not None
        peak = tracker.peak_gib()
    assert peak < stale / GiB - 3, peak
