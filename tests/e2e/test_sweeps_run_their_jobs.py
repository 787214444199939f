"""Sweeps run: a preset launches exactly its jobs, each in its own process (so each job's peak is its own);
stacks the planner says will not fit are skipped, not crashed; the Optuna preset minimises the eval loss
train.py returns and an interrupted study resumes."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMOKE, run_job

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
FAIL_FAST = ["trainer.max_steps=-1", "trainer.epochs=0"]  # every job stops in validation: counts launches only
IN_PROCESS = "hydra/launcher=basic"  # Hydra's one-process launcher: cheaper where a test counts jobs only


def run(*args: str, script: str = "train.py", cwd=REPO) -> subprocess.CompletedProcess:
    return run_job([sys.executable, str(REPO / script), *args], timeout=900, cwd=cwd, env=ENV)


def test_preset_launches_exactly_its_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run("-m", "+sweep=rank_lr", IN_PROCESS, *FAIL_FAST, f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.parent.parent for p in sweep.glob("*/.hydra/overrides.yaml"))
    assert [j.name for j in jobs] == [str(i) for i in range(9)]
    launched = set()
    for j in jobs:
        chosen = dict(o.split("=", 1) for o in yaml.safe_load((j / ".hydra/overrides.yaml").read_text()))
        launched.add((int(chosen["peft.r"]), float(chosen["optim.lr"])))
    assert launched == {(r, lr) for r in (8, 16, 64) for lr in (1e-4, 2e-4, 4e-4)}
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and {r["status"] for r in rows} == {"error"} and "set one of them" in rows[0]["error"]


def test_stacks_that_do_not_fit_are_skipped_not_crashed(tmp_path):
    sweep = tmp_path / "sweep"
    # job 0: a micro-batch no machine holds (planner: does not fit); job 1: invalid (validation error)
    proc = run("-m", *SMOKE, "trainer.micro_batch_size=1000000,0", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = json.loads((sweep / "0" / "metrics.json").read_text())
    assert skipped["status"] == "skipped" and "does not fit" in (skipped.get("reason") or skipped.get("error"))
    assert (sweep / "0" / "plan.json").is_file() and not (sweep / "0" / "adapter").exists()
    assert json.loads((sweep / "1" / "metrics.json").read_text())["status"] == "error"
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["skipped", "error"] and "does not fit" in rows[0]["error"]
    assert float(rows[0]["planned_peak_gib"]) > 24


@pytest.mark.slow  # e2e/test_readme.py runs `+sweep=optuna` in CI (3 trials, same checks, fresh processes)
def test_optuna_preset_minimises_the_returned_eval_loss(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run("-m", "+sweep=optuna", IN_PROCESS, "hydra.sweeper.n_trials=2", *SMOKE, "trainer.max_steps=2",
               f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    assert len(metrics) == 2 and all(m["status"] == "ok" for m in metrics)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(m["eval_loss"] for m in metrics))
    assert set(best["best_params"]) == {"optim.lr", "peft.r", "peft.dropout"}
    assert (sweep / "summary.csv").is_file() and (sweep / "summary.png").is_file()
    assert (sweep / "optuna.db").is_file()  # the study, in the sweep dir


def _trial_states(sweep: Path) -> list[str]:
    """The study's trials in order, read from its sqlite file (what optuna 2.10 stores)."""
    import sqlite3

    db = sweep / "optuna.db"
    if not db.is_file():
        return []
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            return [state for (state,) in con.execute("SELECT state FROM trials ORDER BY number")]
    except sqlite3.OperationalError:  # being created
        return []


@pytest.mark.slow  # four short trainings in two sweeps: 4 min on the shared 2-core machine at load ~25
def test_interrupted_optuna_study_resumes_where_it_stopped(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "+sweep=optuna", IN_PROCESS, "hydra.sweeper.n_trials=3", *SMOKE, "trainer.max_steps=1",
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:  # killed (SIGKILL: no cleanup at all) once trials 0 and 1 are done and trial 2 has started
        deadline = time.monotonic() + 900
        while _trial_states(sweep) != ["COMPLETE", "COMPLETE", "RUNNING"] or len(_trial_params(sweep).get(2, {})) < 3:
            assert first.poll() is None and time.monotonic() < deadline, _trial_states(sweep)
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finished = {n: (sweep / str(n) / "metrics.json").stat().st_mtime_ns for n in (0, 1)}
    proc = run(*args)  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 of 3 trials done, 1 to run" in proc.stdout + proc.stderr
    assert _trial_states(sweep) == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]  # 3 counted: n_trials
    assert {n: (sweep / str(n) / "metrics.json").stat().st_mtime_ns for n in (0, 1)} == finished  # not re-run
    assert json.loads((sweep / "3" / "metrics.json").read_text())["status"] == "ok"  # trial 3 in job dir 3
    assert _trial_params(sweep)[3] == _trial_params(sweep)[2]  # the cut-off trial's parameters, run anew
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    losses = [json.loads((sweep / str(n) / "metrics.json").read_text())["eval_loss"] for n in (0, 1, 3)]
    assert best["best_value"] == pytest.approx(min(losses))


def _trial_params(sweep: Path) -> dict[int, dict[str, float]]:
    """Each trial's parameters, read from the study's sqlite file."""
    import sqlite3

    query = "SELECT t.number, p.param_name, p.param_value FROM trial_params p JOIN trials t USING (trial_id)"
    try:
        with closing(sqlite3.connect(f"file:{sweep / 'optuna.db'}?mode=ro", uri=True)) as con:
            rows = con.execute(query).fetchall()
    except sqlite3.OperationalError:  # not there yet, or being created
        return {}
    out: dict[int, dict[str, float]] = {}
    for number, name, value in rows:
        out.setdefault(number, {})[name] = value
    return out


@pytest.mark.slow  # a trial and a half, then the cut-off trial again, each in a fresh process: ~3 min
def test_ctrl_c_in_an_optuna_sweep_says_what_it_kept_and_the_cut_off_trial_runs_again(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "+sweep=optuna", "hydra.sweeper.n_trials=2", *SMOKE, "trainer.max_steps=2",
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=ENV, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:  # Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while trial 1 runs
        deadline = time.monotonic() + 900
        while _trial_states(sweep) != ["COMPLETE", "RUNNING"] or not (sweep / "1" / ".hydra").is_dir():
            assert first.poll() is None and time.monotonic() < deadline, _trial_states(sweep)
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGINT)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("stopped by")]
    assert lines == [
        f"stopped by SIGINT (Ctrl-C) during the sweep in {sweep}: 1 finished job(s) kept, the study in "
        f"{sweep / 'optuna.db'}; run the same command again to resume it (the cut-off trial is run anew)"
    ], err[-3000:]
    proc = run(*args)  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _trial_states(sweep) == ["COMPLETE", "FAIL", "COMPLETE"]
    params = _trial_params(sweep)
    assert params[2] == params[1] and set(params[1]) == {"optim.lr", "peft.r", "peft.dropout"}  # trial 1's, again
    assert json.loads((sweep / "2" / "metrics.json").read_text())["status"] == "ok"


def _long_rows(path: Path, rows: int = 64, letters: int = 120) -> Path:
    """Sample-style rows of the tiny model's 256 positions (characters: tokens), so micro-batch x seq_len
    sets the peak."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(letters))
            f.write(json.dumps({"prompt": f"order: {word}\n", "completion": "".join(sorted(word))}) + "\n")
    return path


@pytest.mark.slow  # four short trainings in fresh processes: 10 min on the shared 2-core machine at load ~25
def test_each_sweep_job_reports_its_own_peak(tmp_path):
    """Micro-batch 64, then 1, then 16, each job in its own process: each reports its own peak, in
    the order of its micro-batch (not a running maximum), and job 1 equals the same stack trained
    alone."""
    stack = ["trainer=smoke", f"data.path={_long_rows(tmp_path / 'long.jsonl')}", "trainer.seq_len=256",
             "trainer.eval_batch_size=1", "trainer.max_steps=1"]  # fmt: skip
    proc = run("-m", "hydra/launcher=local", "hydra/sweeper=sequential", *stack, "trainer.micro_batch_size=64,1,16",
               f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = [json.loads((tmp_path / "sweep" / str(n) / "metrics.json").read_text())["peak_mem_gib"] for n in range(3)]
    assert peaks[1] < peaks[2] < peaks[0] and peaks[0] - peaks[1] > 0.1  # GiB: the activations of 63 more rows
    alone = run(*stack, "trainer.micro_batch_size=1", f"hydra.run.dir={tmp_path / 'alone'}")
    assert alone.returncode == 0, alone.stderr[-3000:]
    measured_alone = json.loads((tmp_path / "alone" / "metrics.json").read_text())["peak_mem_gib"]
    # Both are fresh processes running the same code on the same data and VmHWM is exact: what is
    # left is what the allocator and thread pools happen to touch, 0.1% apart when this was
    # written. Run in one process (hydra/launcher=basic, VmHWM reset per job) job 1 read 4.8% high:
    # memory the earlier job left mapped. 2% tells the two apart.
    assert peaks[1] == pytest.approx(measured_alone, rel=0.02)


@pytest.mark.slow  # ~35 s (2 cores): two fresh processes; keeps this file near its 60 s budget
def test_local_launcher_runs_each_job_in_a_fresh_process(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run("-m", "hydra/launcher=local", "hydra/sweeper=sequential", *SMOKE, "trainer.max_steps=1",
               "peft.r=4,8", f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    assert len(metrics) == 2 and all(m["status"] == "ok" for m in metrics)
    job_ids = {p.parent.name for p in sweep.glob(".submitit/*/*_result.pkl")}
    assert len(job_ids) == 2 and str(os.getpid()) not in job_ids  # two processes, neither this one
    with open(sweep / "summary.csv") as f:
        assert len(list(csv.DictReader(f))) == 2


def test_a_finished_sweep_run_again_into_its_dir_says_each_job_was_refused(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", IN_PROCESS, *SMOKE, "trainer.max_steps=1", "peft.r=4,8", f"hydra.sweep.dir={sweep}"]
    first = run(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = {n: (sweep / n / "metrics.json").read_bytes() for n in ("0", "1")}
    again = run(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    console = again.stdout + again.stderr
    assert console.count("refused: run dir") == 2 and "already holds a finished run" in console
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["refused", "refused"] and "overwrite=true" in rows[0]["error"]
    assert {n: (sweep / n / "metrics.json").read_bytes() for n in ("0", "1")} == kept  # the earlier runs stay
