"""`python train.py trainer=smoke` as a user runs it, from a directory that is not the repository: it
prints no warnings, the run dir first and the summary and next commands at the end, and writes a
whole run dir. One run, shared by the tests of this module."""

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import REPO


@pytest.fixture(scope="module")
def smoke_command(tmp_path_factory):
    """(the finished process, its run dir): started in a fresh directory, so repo paths must resolve
    from any cwd."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    run_dir = cwd / "runs" / "smoke"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "trainer=smoke", f"hydra.run.dir={run_dir}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir


def test_the_default_smoke_run_prints_no_warnings_and_ends_with_the_summary_and_next_commands(smoke_command):
    """No Warning line at all, the run dir at the start, the table and the commands with that run
    dir at the end; metrics.json as before."""
    proc, run_dir = smoke_command
    warned = [ln for ln in (proc.stderr + proc.stdout).splitlines() if re.search(r"warning", ln, re.IGNORECASE)]
    assert warned == []
    out = proc.stdout.splitlines()
    assert out.index("run dir: runs/smoke") < out.index("stack recipe=-")  # where it writes, first
    assert "optim: paged_adamw_8bit runs unpaged on this CPU" in proc.stdout
    assert "done: runs/smoke  (adapter/, metrics.json)" in out
    assert re.search(r"^  merge +python scripts/merge.py runs/smoke$", proc.stdout, re.MULTILINE)
    # trainer=smoke keeps no checkpoint: no resume line that would be refused, but a new run from its adapter
    assert "next (no checkpoint kept: train on starts a new run from this adapter):" in out
    assert "  train on  python train.py trainer=smoke init_from=runs/smoke" in out
    assert "resume=auto" not in proc.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and f"{metrics['train_loss_first']:.4g} -> " in proc.stdout


def test_smoke_run_from_another_directory_writes_a_run_dir(smoke_command):
    proc, out = smoke_command
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert "quant = nf4" in proc.stdout  # the composed stack printed as a tree


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU process baseline; a GPU run plans its allocations")
def test_the_plan_counts_the_process_footprint_the_run_measures(smoke_command):
    """On a CPU the plan's process baseline is the run's own RSS at its start (the shared libraries'
    resident pages vary with the venv and the page cache) plus a stated allowance for what follows;
    the measured peak then stays within 10 % of the plan. A library that grows what a run allocates
    after its start, or a baseline read at the wrong moment, fails here."""
    _, run_dir = smoke_command
    plan = json.loads((run_dir / "plan.json").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    source = plan["constants"]["cpu_process_baseline"]
    assert source["kind"] == "measured at the run's start"
    baseline = source["start_rss"] + source["after_start"]
    assert plan["components"]["process_baseline"] == {"cpu": baseline}
    assert 0.9 <= metrics["plan_ratio"] <= 1.1, (metrics["peak_mem_gib"], metrics["planned_peak_gib"])


def test_the_printed_train_on_line_runs_as_printed_and_starts_from_the_runs_adapter(smoke_command):
    proc, run_dir = smoke_command
    line = next(ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("train on "))
    words = shlex.split(line.removeprefix("train on").strip())
    assert words[:2] == ["python", "train.py"]
    cwd = run_dir.parent.parent  # where the first run was started: the printed paths are relative to it
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *words[2:], "trainer.max_steps=1", "hydra.run.dir=runs/next"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((cwd / "runs" / "next" / "metrics.json").read_text())
    assert metrics["init_from"]["path"] == str(run_dir.resolve())
