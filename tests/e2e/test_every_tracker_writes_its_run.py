"""Every tracker of the `logger` group trains the default offline and writes its run with the real
package; logger=none writes none; a resumed run goes on in the same tracker runs."""

import json
import sqlite3
from pathlib import Path

from conftest import SMOKE, compose_cfg
from helpers_trackers import needs
from helpers_trackers import train_process as _train

from qlora_recipes.integrations import trackers

ALL = ("wandb", "mlflow", "trackio")


def _wandb_run(run_dir: Path) -> Path:
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    return runs[0]


def _mlflow_runs(db: Path) -> dict:
    """{run name: (status, {metric keys})} from the MLflow store in the run dir."""
    with sqlite3.connect(db) as con:
        runs = con.execute("select run_uuid, name, status from runs").fetchall()
        found = {}
        for uuid, name, status in runs:
            keys = {k for (k,) in con.execute("select distinct key from metrics where run_uuid = ?", (uuid,))}
            found[name] = (status, keys)
    return found


def _trackio_logged(store: Path, project: str, run: str) -> set[str]:
    """The metric keys trackio's local store holds for this run."""
    with sqlite3.connect(store / f"{project}.db") as con:
        rows = con.execute("select metrics from metrics where run_name = ?", (run,)).fetchall()
    return {key for (blob,) in rows for key in json.loads(blob)}


@needs(*ALL)
def test_every_backend_trains_the_default_offline_and_writes_its_run(tmp_path):
    out = tmp_path / "run"
    store = tmp_path / "trackio"
    proc = _train(
        *SMOKE,
        "peft.r=8",
        "logger=[tensorboard,wandb,mlflow,trackio]",
        "logger.wandb.mode=offline",
        f"hydra.run.dir={out}",
        env={"TRACKIO_DIR": str(store), "WANDB_SILENT": "true"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the run dir's last two parts and the overrides that shape the stack (not logger=, not hydra.run.dir=)
    name = f"{tmp_path.name}/run trainer=smoke,data.metric=null,peft.r=8"
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3

    assert list((out / "tb").glob("events.out.tfevents.*"))  # TensorBoard as before

    wandb_run = _wandb_run(out)  # W&B offline, in the run dir, named after it
    log_file = next(wandb_run.glob("run-*.wandb"))
    assert name.encode() in log_file.read_bytes()
    assert b"eval/loss" in log_file.read_bytes()  # the final evaluation went into the same run

    runs = _mlflow_runs(out / "mlflow.db")  # one MLflow run, ended, with the training and eval metrics
    assert list(runs) == [name]
    status, keys = runs[name]
    assert status == "FINISHED" and {"loss", "eval_loss"} <= keys

    assert {"train/loss", "eval/loss"} <= _trackio_logged(store, "qlora-recipes", name)  # trackio's local store


def test_logger_none_writes_no_tensorboard_dir(smoke_run):
    metrics, out = smoke_run("logger=none")
    assert metrics["steps"] == 3 and (out / "memory.jsonl").is_file()
    assert not (out / "tb").exists()
    assert not (out / "checkpoints" / "runs").exists()  # the trainer's own TensorBoard default stays off too


@needs("wandb", "mlflow")
def test_a_resumed_run_goes_on_in_the_same_tracker_runs(tmp_path):
    cfg = compose_cfg("logger=[wandb,mlflow]", "logger.wandb.mode=offline")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trackers.start(cfg.logger, run_dir).close(failed=True)  # e.g. preempted
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}  # run ids only (a tracking URI may hold credentials)
    trackers.start(cfg.logger, run_dir).close()  # resume=auto in the same run dir
    assert json.loads((run_dir / "trackers.json").read_text()) == ids
    assert len(_mlflow_runs(run_dir / "mlflow.db")) == 1
    assert {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")} == {ids["wandb"]}
