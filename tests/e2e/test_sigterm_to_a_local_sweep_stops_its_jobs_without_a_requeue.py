"""SIGTERM to a hydra/launcher=local sweep's whole process group (what `timeout`, systemd, a
container's stop or `kill -- -PGID` send) stops every running job at a sealed checkpoint, as Ctrl-C
does: each job's submitit controller passes the signal on as a preemption, and a job used to be
requeued and train on while the sweep stopped. The parent says so in one line, exit 143. Resuming
them is tests/e2e/test_ctrl_c_in_a_local_sweep_stops_its_jobs_at_a_checkpoint.py's part."""

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, SMOKE
from test_ctrl_c_in_a_local_sweep_stops_its_jobs_at_a_checkpoint import _alive, _sealed, _wait_until_both_jobs_train

from qlora_recipes.integrations.cluster import STOP_MARK

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
STEPS = 60


@pytest.mark.slow  # two jobs in fresh processes: ~3 min on the shared 2-core machine
def test_sigterm_to_a_local_sweeps_group_stops_its_jobs_at_a_checkpoint_without_a_requeue(tmp_path):
    sweep = tmp_path / "sweep"
    args = [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=local", *SMOKE, f"trainer.max_steps={STEPS}",
            "peft.r=4,8", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    with open(tmp_path / "err", "w") as err, open(tmp_path / "out", "w") as out:
        parent = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=out, stderr=err, start_new_session=True)
    try:
        _wait_until_both_jobs_train(sweep, parent)
        os.killpg(parent.pid, signal.SIGTERM)  # every process of the sweep: parent, controllers, trainers
        assert parent.wait(timeout=300) == 143, (tmp_path / "err").read_text()[-3000:]
        assert not _alive(parent.pid), "a job trains on after the sweep stopped"
    finally:
        if _alive(parent.pid):
            os.killpg(parent.pid, signal.SIGKILL)
    metrics = {job: json.loads((sweep / job / "metrics.json").read_text()) for job in ("0", "1")}
    stopped = [job for job, m in metrics.items() if m["status"] == "preempted"]
    assert stopped, metrics  # at least one job was cut off (the other may have finished meanwhile)
    for job in stopped:  # each at its step, a sealed checkpoint there, and not requeued
        assert metrics[job]["signal"] == "SIGTERM" and metrics[job]["steps"] < STEPS
        assert _sealed(sweep / job)[-1:] == [f"checkpoint-{metrics[job]['steps']}"]
        assert not (sweep / job / "run.lock").exists()
        assert "resume=auto" not in yaml.safe_load((sweep / job / ".hydra" / "overrides.yaml").read_text())
    logs = [p.read_text() for p in sweep.glob(".submitit/*/*_0_log.out")]  # a folder per job's controller
    assert sum("this job is not requeued" in log for log in logs) == len(stopped), logs
    assert not any("Requeued job" in log for log in logs)
    for job_err in sweep.glob(".submitit/*/*_0_log.err"):  # a stopped job's own log: its one line, no traceback
        assert "Traceback" not in job_err.read_text(), job_err.read_text()[-3000:]
    assert not (sweep / ".submitit" / STOP_MARK).exists()  # every job ended: the mark is gone
    finished = len(metrics) - len(stopped)
    assert "Traceback" not in (tmp_path / "err").read_text()
    assert (tmp_path / "err").read_text().splitlines() == [
        f"stopped by SIGTERM during the sweep in {sweep}: {finished} finished job(s) kept, job(s) "
        f"{' '.join(stopped)} stopped at a checkpoint; continue with the same command plus resume=auto (finished "
        "jobs are skipped, stopped ones resume)"
    ]
