"""Sweeps: ready presets in conf/sweep launch exactly their jobs; the Optuna preset minimises the
eval loss train.py returns; stacks the planner says will not fit are recorded as skipped; the
summary (csv, md, png) marks the Pareto front; launchers that give each job its own process
(locally) or a SLURM job take their resources from the recipe's hardware node."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, compose_cfg
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from qlora_recipes.validate import validate

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
SMOKE = ["trainer=smoke", "data.metric=null"]
FAIL_FAST = ["trainer.max_steps=-1", "trainer.epochs=0"]  # every job stops in validation: counts launches only
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
    proc = run("-m", "+sweep=rank_lr", *FAIL_FAST, f"hydra.sweep.dir={sweep}")
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
    proc = run("-m", "+sweep=optuna", "hydra.sweeper.n_trials=2", *SMOKE, "trainer.max_steps=2",
               f"hydra.sweep.dir={sweep}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    assert len(metrics) == 2 and all(m["status"] == "ok" for m in metrics)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(m["eval_loss"] for m in metrics))
    assert set(best["best_params"]) == {"optim.lr", "peft.r", "peft.dropout"}
    assert (sweep / "summary.csv").is_file() and (sweep / "summary.png").is_file()


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
    assert [r["pareto"] for r in rows] == ["True", "True", "False", "False", "False"]
    assert (
        rows[3]["status"] == "skipped" and rows[3]["planned_peak_gib"] == "99.0" and "does not fit" in rows[3]["error"]
    )
    md = (sweep / "summary.md").read_text().splitlines()
    assert len(md) == 2 + 5 and md[2].split("|")[-3].strip() == "*"
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Pareto front: jobs 0, 1" in proc.stdout and "1 skipped" in proc.stdout


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
