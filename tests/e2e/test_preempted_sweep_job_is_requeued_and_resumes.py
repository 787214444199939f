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


@pytest.mark.slow  # one job, stopped after its first checkpoint: ~2 min on the shared 2-core machine
def test_a_signal_to_the_job_id_submitit_shows_stops_its_trainer_and_the_sweep_in_one_line(tmp_path):
    """Under hydra/launcher=local the job id submitit prints is its controller's pid, which dies of
    USR2: the trainer under it saves a checkpoint and stops (it is not left training, orphaned), and
    the sweep ends with one line saying how to go on, not submitit's UncompletedJobError."""
    import signal
    import time

    sweeper, err, job, controller = _signal_the_controller(tmp_path, 200, signal.SIGUSR2)
    sweep = job.parent
    assert sweeper.returncode == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith(f"error: sweep job {controller} ended without a result") and "resume=auto" in errors[0]
    deadline = time.monotonic() + 120  # the trainer stops at a checkpoint instead of training on
    while (job / "run.lock").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (job / "run.lock").exists() and not (job / "adapter").exists()
    log = next(sweep.glob(f".submitit/{controller}/*_0_log.out")).read_text()
    assert "SIGTERM: checkpoint saved" in log, log[-3000:]  # at the step it was at, well before step 200


@pytest.mark.slow  # one job started twice (requeue): ~3 min on the shared 2-core machine
def test_sigterm_to_the_job_id_submitit_shows_is_passed_on_saved_requeued_and_resumed(tmp_path):
    """The documented way to try a preemption on one machine: `kill -TERM JOBID` (the id submitit
    shows under hydra/launcher=local) reaches the trainer, which saves, is requeued and finishes."""
    import signal

    sweeper, err, job, controller = _signal_the_controller(tmp_path, 6, signal.SIGTERM)
    assert sweeper.returncode == 0, err[-3000:]
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 6 and metrics["resumed_from"], metrics
    log = next(job.parent.glob(f".submitit/{controller}/*_0_log.out")).read_text()
    assert "SIGTERM: checkpoint saved" in log and f"Requeued job {controller}" in log


def _signal_the_controller(tmp_path, max_steps: int, sig) -> tuple:
    """A one-job local sweep signalled, at its first checkpoint, through the job id submitit shows (its
    controller): (the sweep process, its stderr, the job dir, the controller's pid)."""
    import signal
    import time

    sweep = tmp_path / "sweep"
    sweeper = subprocess.Popen(
        [sys.executable, "train.py", "-m", "hydra/launcher=local", *SMOKE, f"trainer.max_steps={max_steps}",
         "trainer.save_steps=1", f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    job = sweep / "0"
    try:
        deadline = time.monotonic() + 600
        while not (job / "checkpoints" / "checkpoint-1").is_dir():
            assert sweeper.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        (controller,) = [int(p.name) for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]
        os.kill(controller, sig)
        _, err = sweeper.communicate(timeout=600)
    finally:
        if sweeper.poll() is None:
            os.killpg(sweeper.pid, signal.SIGKILL)
    return sweeper, err, job, controller
