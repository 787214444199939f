"""Sweeps: ready presets in conf/sweep launch exactly their jobs, each in its own process (so each
job's peak is its own); the Optuna preset minimises the eval loss train.py returns and keeps its
study in the sweep dir, so an interrupted study resumes; stacks the planner says will not fit are
recorded as skipped; the summary (csv, md, png) labels jobs by the overrides that set them apart
and marks the Pareto front; launchers that give each job its own process (locally) or a SLURM job
take their resources from the recipe's hardware node."""

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
from conftest import REPO, compose_cfg
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from qlora_recipes.run.validate import validate

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
SMOKE = ["trainer=smoke", "data.metric=null"]
FAIL_FAST = ["trainer.max_steps=-1", "trainer.epochs=0"]  # every job stops in validation: counts launches only
IN_PROCESS = "hydra/launcher=basic"  # Hydra's one-process launcher: cheaper where a test counts jobs only
PRESETS = {"rank_lr": 9, "optim_quant": 9, "peft_method": 6, "batch_memory": 8}


def run(*args: str, script: str = "train.py", cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def hydra_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


def jobs_of(preset: str, *extra: str) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper makes of a preset (its own expansion code)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = hydra_cfg(f"+sweep={preset}").hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(extra))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def test_every_preset_is_tested():
    on_disk = {p.stem for p in (REPO / "conf" / "sweep").glob("*.yaml")}
    assert on_disk == set(PRESETS) | {"optuna"}


@pytest.mark.parametrize("preset,count", PRESETS.items())
def test_preset_expands_to_valid_jobs(preset, count):
    jobs = jobs_of(preset)
    assert len(jobs) == count and len({tuple(j) for j in jobs}) == count
    assert hydra_cfg(f"+sweep={preset}").hydra.sweeper.max_batch_size == 1  # one job at a time
    for job in jobs:  # every combination is a stack that composes and validates
        validate(compose_cfg(*job), gpu_available=False, world_size=1)


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


@pytest.mark.parametrize("preset", [*PRESETS, "optuna"])
def test_every_preset_runs_its_jobs_one_at_a_time_each_in_its_own_process(preset):
    hydra = hydra_cfg(f"+sweep={preset}").hydra
    assert hydra.launcher._target_.endswith("submitit_launcher.LocalLauncher")  # a fresh process per job
    assert hydra.sweeper.get("max_batch_size", hydra.sweeper.get("n_jobs")) == 1


def test_optuna_preset_keeps_its_study_in_the_sweep_dir_named_after_it():
    sweeper = hydra_cfg("+sweep=optuna", "hydra.sweeper.study_name=lr_search").hydra
    assert sweeper.sweep.dir == "runs/optuna/lr_search"  # the same command finds the same study
    assert sweeper.sweeper.storage == "sqlite:///runs/optuna/lr_search/optuna.db"
    assert sweeper.sweeper._target_ == "hydra_plugins.qlora_recipes_sweeper.ResumableOptunaSweeper"


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


def test_resumed_study_counts_finished_trials_and_reruns_a_cut_off_one(tmp_path):
    import optuna
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl

    from qlora_recipes.integrations import study

    url = f"sqlite:///{tmp_path}/sweep/optuna.db"
    earlier = optuna.create_study(study_name="s", storage=study.open_storage(url))
    for value in (1.0, 0.5):
        trial = earlier.ask()
        trial.suggest_float("x", 0.0, 1.0)
        earlier.tell(trial, value)
    earlier.ask()  # trial 2: running when the sweep was killed

    def sweeper(name: str):
        return OptunaSweeperImpl(optuna.samplers.TPESampler(seed=0), "minimize", url, name, 5, 1, 1.0, None, None, None)

    resumed = sweeper("s")
    study.resume(resumed)
    assert (resumed.n_trials, resumed.job_idx) == (3, 3)  # 2 of 5 done; the next job dir is trial 3's
    trials = optuna.load_study(study_name="s", storage=resumed.storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL"]
    assert trials[2].system_attrs == {study.INTERRUPTED: True} and not study.counted(trials[2])
    # the seeded sampler got a new seed: it would otherwise propose trial 0's parameters again
    draws = [s._random_sampler._rng.uniform() for s in (resumed.sampler, optuna.samplers.TPESampler(seed=0))]
    assert draws[0] != draws[1]
    fresh = sweeper("other")  # another study in the same file starts from nothing
    study.resume(fresh)
    assert (fresh.n_trials, fresh.job_idx) == (5, 0)


@pytest.mark.slow  # four short trainings in two sweeps: 4 min on the shared 2-core machine at load ~25
def test_interrupted_optuna_study_resumes_where_it_stopped(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "+sweep=optuna", IN_PROCESS, "hydra.sweeper.n_trials=3", *SMOKE, "trainer.max_steps=1",
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    first = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:  # killed (SIGKILL: no cleanup at all) once trials 0 and 1 are done and trial 2 has started
        deadline = time.monotonic() + 900
        while _trial_states(sweep) != ["COMPLETE", "COMPLETE", "RUNNING"]:
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
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    losses = [json.loads((sweep / str(n) / "metrics.json").read_text())["eval_loss"] for n in (0, 1, 3)]
    assert best["best_value"] == pytest.approx(min(losses))


def _long_rows(path: Path, rows: int = 64, letters: int = 480) -> Path:
    """Sample-style rows ~1000 characters (tokens) long, so micro-batch x seq_len sets the peak."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(letters))
            f.write(json.dumps({"prompt": f"order: {word}\n", "completion": "".join(sorted(word))}) + "\n")
    return path


@pytest.mark.slow  # four short trainings in fresh processes: 10 min on the shared 2-core machine at load ~25
def test_each_sweep_job_reports_its_own_peak(tmp_path):
    """Micro-batch 16, then 1, then 4, each job in its own process: each reports its own peak, in
    the order of its micro-batch (not a running maximum), and job 1 equals the same stack trained
    alone."""
    stack = ["trainer=smoke", f"data.path={_long_rows(tmp_path / 'long.jsonl')}", "trainer.seq_len=1024",
             "trainer.eval_batch_size=1", "trainer.max_steps=1"]  # fmt: skip
    proc = run("-m", "hydra/launcher=local", "hydra/sweeper=sequential", *stack, "trainer.micro_batch_size=16,1,4",
               f"hydra.sweep.dir={tmp_path / 'sweep'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = [json.loads((tmp_path / "sweep" / str(n) / "metrics.json").read_text())["peak_mem_gib"] for n in range(3)]
    assert peaks[1] < peaks[2] < peaks[0] and peaks[0] - peaks[1] > 0.1  # GiB: the activations of 15 more rows
    alone = run(*stack, "trainer.micro_batch_size=1", f"hydra.run.dir={tmp_path / 'alone'}")
    assert alone.returncode == 0, alone.stderr[-3000:]
    measured_alone = json.loads((tmp_path / "alone" / "metrics.json").read_text())["peak_mem_gib"]
    # Both are fresh processes running the same code on the same data and VmHWM is exact: what is
    # left is what the allocator and thread pools happen to touch, 0.1% apart when this was
    # written. Run in one process (hydra/launcher=basic, VmHWM reset per job) job 1 read 4.8% high:
    # memory the earlier job left mapped. 2% tells the two apart.
    assert peaks[1] == pytest.approx(measured_alone, rel=0.02)


def test_labels_name_what_differs_between_jobs():
    from qlora_recipes.integrations.sweep import labels

    jobs = {
        "0": ["+sweep=optuna", "optim.lr=0.00044303752452182633", "peft.r=8", "trainer=smoke"],
        "1": ["+sweep=optuna", "optim.lr=0.004734989304499477", "peft.r=8", "trainer=smoke", "resume=auto"],
        "2": ["+sweep=optuna", "optim.lr=0.001", "peft.r=16", "trainer=smoke", "hydra.sweep.dir=x"],
    }
    assert labels(jobs) == {
        "0": "optim.lr=0.000443 peft.r=8",
        "1": "optim.lr=0.00473 peft.r=8",
        "2": "optim.lr=0.001 peft.r=16",
    }
    assert labels({"0": ["peft.r=8", "trainer=smoke"]}) == {"0": "peft.r=8 trainer=smoke"}  # one job: all it sets
    assert labels({"0": [], "1": []}) == {"0": "job 0", "1": "job 1"}


def _job(sweep: Path, num: int, overrides: list[str], metrics: dict, planned: float | None = None) -> None:
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / "metrics.json").write_text(json.dumps(metrics))
    if planned is not None:
        (d / "plan.json").write_text(json.dumps({"peak_gib": planned, "fits": False}))


def test_summarize_sweep_writes_csv_md_png_and_marks_the_pareto_front(tmp_path):
    sweep = tmp_path / "sweep"
    ok = {"status": "ok", "train_loss_last": 1.5, "planned_peak_gib": 12.0, "wall_s": 10.0}
    _job(sweep, 0, ["peft.r=8"], {**ok, "eval_loss": 1.0, "peak_mem_gib": 10.0, "tokens_per_s": 100.0})
    _job(sweep, 1, ["peft.r=64"], {**ok, "eval_loss": 0.9, "peak_mem_gib": 20.0, "tokens_per_s": 50.0})
    _job(sweep, 2, ["peft.r=16"], {**ok, "eval_loss": 1.1, "peak_mem_gib": 15.0, "tokens_per_s": 80.0})  # dominated
    _job(
        sweep,
        3,
        ["trainer.micro_batch_size=64"],
        {"status": "skipped", "reason": "stack does not fit: peak 99.0 GiB > budget 79.0 GiB"},
        planned=99.0,
    )
    _job(sweep, 10, ["quant=int8"], {"status": "error", "error": "quant=int8: something"})
    proc = run(str(sweep), script="scripts/summarize_sweep.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "10"]  # by job number, none dropped
    labels = ["peft.r=8", "peft.r=64", "peft.r=16", "trainer.micro_batch_size=64", "quant=int8"]
    assert [r["label"] for r in rows] == labels  # what sets each job apart
    assert [r["pareto"] for r in rows] == ["True", "True", "False", "False", "False"]
    assert (
        rows[3]["status"] == "skipped" and rows[3]["planned_peak_gib"] == "99.0" and "does not fit" in rows[3]["error"]
    )
    md = (sweep / "summary.md").read_text().splitlines()
    assert len(md) == 2 + 5 and md[2].split("|")[-3].strip() == "*"
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Pareto front: jobs 0 (peft.r=8), 1 (peft.r=64)" in proc.stdout and "1 skipped" in proc.stdout


@pytest.mark.parametrize("arg,needle", [("/nonexistent/sweep", "no such directory"), (".", "no job dirs")])
def test_summarize_sweep_bad_input_is_one_line(arg, needle, tmp_path):
    proc = run(arg, script="scripts/summarize_sweep.py", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr


def test_launchers_take_their_resources_from_the_hardware_node():
    slurm = hydra_cfg("recipe=llama2-70b-a100", "hydra/launcher=slurm").hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher")
    assert (slurm.gpus_per_node, slurm.timeout_min, slurm.mem_gb, slurm.tasks_per_node) == (1, 1440, 128, 1)
    local = hydra_cfg("recipe=llama3.1-8b-24gb", "hydra/launcher=local").hydra.launcher
    assert local._target_.endswith("LocalLauncher") and local.gpus_per_node == 1
    assert hydra_cfg("hydra/launcher=local").hydra.launcher.gpus_per_node == 0  # CPU default
    assert hydra_cfg("hydra/sweeper=sequential").hydra.sweeper.max_batch_size == 1


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
