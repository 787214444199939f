"""A preempted sweep job saves a checkpoint, is requeued by submitit and resumes from it (on CPU through
submitit's local executor, the real signal and the real requeue)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMOKE

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.slow  # one job started twice (requeue): 5 min on the shared 2-core machine at load ~30
def test_preempted_sweep_job_saves_is_requeued_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    env = {**ENV, "QLORA_RECIPES_FAULTS": "preempt_at_step=2"}  # the job sends itself USR2 after step 2
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "hydra/launcher=local", *SMOKE,
         "trainer.max_steps=4", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = sweep / "0"
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 4 and len(metrics["train_losses"]) == 4
    assert Path(metrics["resumed_from"]) == job / "checkpoints" / "checkpoint-2"  # saved on the signal
    # the requeued job composed the same overrides plus resume=auto (cluster.hand_over)
    assert yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())[-1] == "resume=auto"
    (job_log,) = sweep.glob(".submitit/*/*_0_log.out")  # one submitit job, run twice
    log = job_log.read_text()
    assert "Caught signal SIGUSR2" in log and "checkpoint saved; submitit requeues" in log
    assert re.search(r"Requeued job \d+", log)
    assert log.index("checkpoint saved") < log.index("Requeued job")  # save first, then requeue
