"""What a run reports about memory: the measured peak and the planned peak are the same quantity
(GPU: torch.cuda.max_memory_allocated vs plan.json peak_allocated_gib; CPU: process RSS vs the
plan's cpu-device peak), each run's peak is its own within one process, memory.png shows both."""

import json
import resource
import subprocess
import sys

import pytest
import torch
from conftest import compose_cfg
from omegaconf import OmegaConf

from qlora_recipes.integrations import sweep
from qlora_recipes.run import memory
from qlora_recipes.run.training import train

GiB = 2**30
SMOKE = ("trainer=smoke", "data.metric=null")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two jobs in one process, as a Hydra multirun runs them, with a 1 GiB high-water mark between
    them: the footprint of a bigger job than the tiny model can make (its activations are a few MiB
    over a ~0.6 GiB interpreter baseline). ru_maxrss would hand that mark to the second job."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    first = train(compose_cfg(*SMOKE), sweep_dir / "0")
    big = torch.ones(GiB // 4, dtype=torch.float32)  # 1 GiB, every page touched
    big.add_(1)
    del big  # a large block goes back to the OS: the process's RSS falls, ru_maxrss stays
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    second = train(compose_cfg(*SMOKE, "peft.r=4"), sweep_dir / "1")
    for job, overrides in (("0", []), ("1", ["peft.r=4"])):
        (sweep_dir / job / ".hydra").mkdir()
        OmegaConf.save(OmegaConf.create(overrides), sweep_dir / job / ".hydra" / "overrides.yaml")
    return sweep_dir, first, second, high_water


def test_metrics_report_planned_and_measured_of_one_quantity(two_runs):
    sweep_dir, first, _, _ = two_runs
    saved = json.loads((sweep_dir / "0" / "metrics.json").read_text())
    plan = json.loads((sweep_dir / "0" / "plan.json").read_text())
    gpu = torch.cuda.is_available()
    assert saved["peak_quantity"] == ("cuda max_memory_allocated" if gpu else "process RSS")
    if gpu:
        assert saved["planned_peak_gib"] == plan["peak_allocated_gib"]
        assert saved["measured_peak_allocated_gib"] == saved["peak_mem_gib"]
    else:  # the plan predicts the process's RSS on the cpu device
        (cpu,) = [d for d in plan["devices"] if d["device"] == "cpu"]
        assert saved["planned_peak_gib"] == pytest.approx(cpu["peak"] / GiB, abs=1e-3)
    assert saved["planned_device_peak_gib"] == plan["peak_gib"]
    assert saved["plan_ratio"] == pytest.approx(saved["peak_mem_gib"] / saved["planned_peak_gib"])
    assert saved["peak_mem_gib"] == first["peak_mem_gib"] > 0
    assert 0.3 < saved["plan_ratio"] < 3, saved  # a plan of the right quantity, not of another one


def test_memory_png_shows_the_timeline_and_the_plan(two_runs):
    sweep_dir = two_runs[0]
    assert (sweep_dir / "0" / "memory.png").stat().st_size > 1000
    rows = [json.loads(line) for line in (sweep_dir / "0" / "memory.jsonl").read_text().splitlines()]
    assert rows and all(0 < r["peak_gib"] <= two_runs[1]["peak_mem_gib"] + 1e-9 for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU sampler; on GPU the counter is reset")
def test_second_run_in_a_process_reports_its_own_peak(two_runs):
    sweep_dir, first, second, high_water = two_runs
    assert high_water > first["peak_mem_gib"] + 0.8  # the process's cumulative maximum
    assert second["peak_mem_gib"] < high_water - 0.5, (second["peak_mem_gib"], high_water)
    assert second["peak_mem_gib"] == pytest.approx(first["peak_mem_gib"], abs=0.25)
    # the sweep summary reads each job's own peak and its plan's figure of the same quantity
    rows = sweep.collect(sweep_dir)
    assert [r["peak_mem_gib"] for r in rows] == [first["peak_mem_gib"], second["peak_mem_gib"]]
    assert [r["plan_ratio"] for r in rows] == [first["plan_ratio"], second["plan_ratio"]]
    assert {r["peak_quantity"] for r in rows} == {"process RSS"}


def test_tracker_peak_is_per_tracker_and_falls_back_to_the_plan_device():
    if torch.cuda.is_available():
        pytest.skip("the CPU sampler")
    with memory.PeakTracker(gpu=False) as first:
        held = torch.ones(GiB // 8)  # 512 MiB, touched
        held.add_(1)
        during = first.peak_gib()
        del held
    with memory.PeakTracker(gpu=False) as second:
        after = second.peak_gib()
    assert during > after + 0.4 and first.stop() >= during
    assert memory.planned_peak_gib({"devices": [{"device": "cpu", "peak": GiB}], "peak_gib": 9.0}) == 1.0
    gpu_plan = {"devices": [{"device": "cuda:0", "peak": 9 * GiB}], "peak_gib": 9.0, "peak_allocated_gib": 7.5}
    assert memory.planned_peak_gib(gpu_plan) == 7.5 and memory.plan_on_gpu(gpu_plan)


def test_cpu_peak_is_the_kernels_high_water_mark_and_sees_a_spike_no_sampler_would():
    """A 256 MiB tensor that lives for microseconds: the tracker's peak has it (VmHWM, reset at
    start), while the RSS before and after does not."""
    if torch.cuda.is_available() or not memory.reset_rss_high_water_mark():
        pytest.skip("Linux CPU: /proc/self/clear_refs")
    with memory.PeakTracker(gpu=False, interval_s=3600) as tracker:  # a sampler this slow sees nothing
        assert tracker.exact
        before = memory.rss_bytes()
        torch.ones(GiB // 16).add_(1)  # 256 MiB, touched, freed at once
        spike = tracker.peak_gib() * GiB - before
    assert spike > 0.9 * GiB / 4, spike / GiB


def test_pinned_malloc_thresholds_give_freed_tensors_back():
    """After pin_malloc_thresholds, freeing tensors of many sizes (which would raise glibc's dynamic
    mmap threshold and leave them on the heap) returns their pages: RSS falls back to where it was.
    In a fresh process each way, so no earlier test's heap is measured."""
    code = """
import sys, torch
from qlora_recipes import peak
if sys.argv[1] == "pin" and not memory.pin_malloc_thresholds():
    print("unsupported"); raise SystemExit
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
