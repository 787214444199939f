"""Sweeps without training: ready presets in conf/sweep expand to valid jobs, run one at a time; the
Optuna preset keeps its study in the sweep dir and a resumed study counts its finished trials; the
summary (csv, md, png) labels jobs by the overrides that set them apart and marks the Pareto front;
launchers that give each job its own process (locally) or a SLURM job
take their resources from the recipe's hardware node."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, compose_cfg, compose_hydra_cfg

from qlora_recipes.run.validate import validate

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
PRESETS = {"rank_lr": 9, "optim_quant": 9, "peft_method": 6, "batch_memory": 8}


def run(*args: str, script: str = "train.py", cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def jobs_of(preset: str, *extra: str) -> list[list[str]]:
    """The job override lists Hydra's basic sweeper makes of a preset (its own expansion code)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = compose_hydra_cfg(f"+sweep={preset}").hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(extra))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def test_every_preset_is_tested():
    on_disk = {p.stem for p in (REPO / "conf" / "sweep").glob("*.yaml")}
    assert on_disk == set(PRESETS) | {"optuna"}


@pytest.mark.parametrize("preset,count", PRESETS.items())
def test_preset_expands_to_valid_jobs(preset, count):
    jobs = jobs_of(preset)
    assert len(jobs) == count and len({tuple(j) for j in jobs}) == count
    assert compose_hydra_cfg(f"+sweep={preset}").hydra.sweeper.max_batch_size == 1  # one job at a time
    for job in jobs:  # every combination is a stack that composes and validates
        validate(compose_cfg(*job), gpu_available=False, world_size=1)


@pytest.mark.parametrize("preset", [*PRESETS, "optuna"])
def test_every_preset_runs_its_jobs_one_at_a_time_each_in_its_own_process(preset):
    hydra = compose_hydra_cfg(f"+sweep={preset}").hydra
    assert hydra.launcher._target_.endswith("submitit_launcher.LocalLauncher")  # a fresh process per job
    assert hydra.sweeper.get("max_batch_size", hydra.sweeper.get("n_jobs")) == 1


def test_optuna_preset_keeps_its_study_in_the_sweep_dir_named_after_it():
    sweeper = compose_hydra_cfg("+sweep=optuna", "hydra.sweeper.study_name=lr_search").hydra
    assert sweeper.sweep.dir == "runs/optuna/lr_search"  # the same command finds the same study
    assert sweeper.sweeper.storage == "sqlite:///runs/optuna/lr_search/optuna.db"
    assert sweeper.sweeper._target_ == "hydra_plugins.qlora_recipes_sweeper.ResumableOptunaSweeper"


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
    earlier.ask().suggest_float("x", 0.0, 1.0)  # trial 2: running when the sweep was killed

    def sweeper(name: str):
        return OptunaSweeperImpl(optuna.samplers.TPESampler(seed=0), "minimize", url, name, 5, 1, 1.0, None, None, None)

    resumed = sweeper("s")
    study.resume(resumed)
    assert (resumed.n_trials, resumed.job_idx) == (3, 3)  # 2 of 5 done; the next job dir is trial 3's
    trials = optuna.load_study(study_name="s", storage=resumed.storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL", "WAITING"]
    assert trials[2].system_attrs == {study.INTERRUPTED: True} and not study.counted(trials[2])
    # the cut-off trial's parameters come first, as trial 3 in job dir 3
    again = optuna.load_study(study_name="s", storage=resumed.storage).ask()
    assert again.number == resumed.job_idx and again.suggest_float("x", 0.0, 1.0) == trials[2].params["x"]
    # the seeded sampler got a new seed: it would otherwise propose trial 0's parameters again
    draws = [s._random_sampler._rng.uniform() for s in (resumed.sampler, optuna.samplers.TPESampler(seed=0))]
    assert draws[0] != draws[1]
    fresh = sweeper("other")  # another study in the same file starts from nothing
    study.resume(fresh)
    assert (fresh.n_trials, fresh.job_idx) == (5, 0)


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
    slurm = compose_hydra_cfg("recipe=llama2-70b-a100", "hydra/launcher=slurm").hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher")
    assert (slurm.gpus_per_node, slurm.timeout_min, slurm.mem_gb, slurm.tasks_per_node) == (1, 1440, 128, 1)
    local = compose_hydra_cfg("recipe=llama3.1-8b-24gb", "hydra/launcher=local").hydra.launcher
    assert local._target_.endswith("LocalLauncher") and local.gpus_per_node == 1
    assert compose_hydra_cfg("hydra/launcher=local").hydra.launcher.gpus_per_node == 0  # CPU default
    assert compose_hydra_cfg("hydra/sweeper=sequential").hydra.sweeper.max_batch_size == 1
