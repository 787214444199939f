"""overwrite=true never costs the run it replaces until the new run has something of its own: a
replacement refused while loading, or one whose training fails before its first checkpoint, leaves the
old run's files byte for byte; one killed before its first checkpoint is put back by the next run
there. A fresh run refused while loading leaves no run dir at all."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SMOKE, compose_cfg, train_smoke

from qlora_recipes.errors import UserError
from qlora_recipes.run.reuse import ASIDE, RunDirChanges
from qlora_recipes.run.training import train

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def snapshot(run_dir: Path) -> dict:
    """Every file under the run dir with its bytes, and every folder."""
    return {str(p.relative_to(run_dir)): p.read_bytes() if p.is_file() else None for p in sorted(run_dir.rglob("*"))}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 3-step run with its checkpoints, adapter, metrics and manifest."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    metrics, _ = train_smoke(run_dir, "trainer.save_steps=1")
    assert metrics["status"] == "ok" and (run_dir / "manifest.json").is_file()
    return run_dir


def run_train_py(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *SMOKE, *overrides],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


# Refused only once transformers builds the model: a hub attention kernel without the `kernels` package
LOAD_REFUSAL = "model.attn_implementation=kernels-community/flash-attn"


def test_an_overwrite_refused_while_loading_leaves_the_old_run_byte_for_byte(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = snapshot(run_dir)
    proc = run_train_py(LOAD_REFUSAL, "overwrite=true", f"hydra.run.dir={run_dir}")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("precision=auto")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("error: model.attn_implementation=kernels-community/flash-attn"), lines
    assert snapshot(run_dir) == before


def test_a_fresh_run_refused_while_loading_leaves_no_run_dir(tmp_path):
    run_dir = tmp_path / "fresh"
    proc = run_train_py(LOAD_REFUSAL, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


def test_an_overwrite_whose_training_fails_before_its_first_checkpoint_puts_the_old_run_back(
    finished, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = snapshot(run_dir)
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "nan_at_step=1")
    with pytest.raises(UserError, match="loss became nan at step 1"):
        train(compose_cfg(*SMOKE, "peft.r=4", "trainer.save_steps=0", "overwrite=true"), run_dir)
    assert snapshot(run_dir) == before


def test_an_overwrite_keeps_the_old_run_until_its_first_checkpoint_then_replaces_it(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    metrics = train(compose_cfg(*SMOKE, "peft.r=4", "trainer.save_steps=2", "overwrite=true"), run_dir)
    assert metrics["status"] == "ok"
    assert not (run_dir / ASIDE).exists()
    checkpoints = sorted((run_dir / "checkpoints").glob("checkpoint-*"))
    assert checkpoints and all(json.loads((c / "adapter_config.json").read_text())["r"] == 4 for c in checkpoints)


def test_a_replacement_killed_before_its_first_checkpoint_is_undone_by_the_next_run_there(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = snapshot(run_dir)
    # what a kill -9 right after the new run set the old one aside and wrote its own files leaves
    RunDirChanges(compose_cfg(*SMOKE, "overwrite=true"), run_dir).begin()
    (run_dir / "config.yaml").write_text("the new run's config\n")
    (run_dir / "memory.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="already holds a finished run"):  # the next run sees the old run again
        train(compose_cfg(*SMOKE, "peft.r=4"), run_dir)
    assert snapshot(run_dir) == before
