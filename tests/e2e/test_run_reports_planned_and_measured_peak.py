"""What a run reports about memory: the measured peak and the planned peak are the same quantity
(GPU: torch.cuda.max_memory_allocated vs plan.json peak_allocated_gib; CPU: process RSS vs the
plan's cpu-device peak), each run's peak is its own within one process, memory.png shows both."""

import json
import resource
import subprocess
import sys

import pytest
import torch
from conftest import REPO, SMOKE, train_smoke
from omegaconf import OmegaConf

from qlora_recipes.integrations import sweep

GiB = 2**30


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two jobs in one process, as a Hydra multirun runs them, with a 1 GiB high-water mark between
    them: the footprint of a bigger job than the tiny model can make (its activations are a few MiB
    over a ~0.6 GiB interpreter baseline). ru_maxrss would hand that mark to the second job."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    first, _ = train_smoke(sweep_dir / "0")
    big = torch.ones(GiB // 4, dtype=torch.float32)  # 1 GiB, every page touched
    big.add_(1)
    del big  # a large block goes back to the OS: the process's RSS falls, ru_maxrss stays
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    second, _ = train_smoke(sweep_dir / "1", "peft.r=4")
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


def test_rows_much_shorter_than_seq_len_are_planned_as_the_batches_they_make(tmp_path):
    """64 rows of the shipped sample (22 tokens at most) per micro-batch at seq_len 256: planned as if
    every row were seq_len long, the run measures ~0.74 of its plan; planned at the data's longest row,
    within 10 %. Its own process, as a user runs it: the RSS of a process that trained before is not a
    first run's."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), *SMOKE, "trainer.micro_batch_size=64", "trainer.seq_len=256"]
    proc = subprocess.run([*cmd, f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    saved = json.loads((run / "metrics.json").read_text())
    assert plan["stack"]["seq_len"] == plan["data_longest_row"] < 64
    assert any("longest tokenized row" in note for note in plan["notes"])
    assert 0.9 <= saved["plan_ratio"] <= 1.1, saved
