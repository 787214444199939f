"""Ctrl-C to a hydra/launcher=local sweep, from a terminal (every process of the group) or to the
parent alone: its jobs (each a process of its own) stop at a checkpoint at that step instead of
training on without the sweep or being killed mid-save by their submitit controllers (which printed
tracebacks), and the parent says so in one line, exit 130; the same command plus resume=auto
finishes them from there."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SMOKE, run_job

from qlora_recipes.run.checkpoints import CHECKPOINT, checkpoint_problem

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
STEPS = 40


def _sigint_as_in_a_terminal() -> None:
    """A suite started in the background passes SIGINT on as ignored; a terminal's is not."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_until_both_jobs_train(sweep: Path, parent: subprocess.Popen) -> None:
    """Until each job has logged a training step (memory.jsonl): its trainer is past start-up."""
    deadline = time.monotonic() + 600
    while not all((sweep / job / "memory.jsonl").is_file() for job in ("0", "1")):
        assert parent.poll() is None and time.monotonic() < deadline, (sweep, parent.returncode)
        time.sleep(0.1)


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _sealed(job_dir: Path) -> list[str]:
    folder = job_dir / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if CHECKPOINT.match(p.name) and checkpoint_problem(p) is None)


@pytest.mark.slow  # two jobs in fresh processes (trained twice from a terminal): ~3 min on the shared 2-core machine
@pytest.mark.parametrize("to", ["terminal", "parent"])
def test_ctrl_c_to_a_local_sweep_stops_its_jobs_at_a_checkpoint_and_they_resume(tmp_path, to):
    sweep = tmp_path / "sweep"
    args = [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=local", *SMOKE, f"trainer.max_steps={STEPS}",
            "peft.r=4,8", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    with open(tmp_path / "err", "w") as err, open(tmp_path / "out", "w") as out:  # files: the jobs inherit them
        parent = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=out, stderr=err, start_new_session=True,
                                  preexec_fn=_sigint_as_in_a_terminal)  # fmt: skip
    try:
        _wait_until_both_jobs_train(sweep, parent)
        if to == "terminal":  # Ctrl-C in a terminal: SIGINT to every process of the foreground group
            os.killpg(parent.pid, signal.SIGINT)
        else:  # the parent alone: its jobs hear of it from it
            parent.send_signal(signal.SIGINT)
        assert parent.wait(timeout=300) == 130, (tmp_path / "err").read_text()[-3000:]
        assert not _alive(parent.pid), "a job trains on after the sweep stopped"
    finally:
        if _alive(parent.pid):
            os.killpg(parent.pid, signal.SIGKILL)
    metrics = {job: json.loads((sweep / job / "metrics.json").read_text()) for job in ("0", "1")}
    stopped = [job for job, m in metrics.items() if m["status"] == "preempted"]
    assert stopped, metrics  # at least one job was cut off (the other may have finished meanwhile)
    for job in stopped:  # each stopped at its step, with a sealed checkpoint there
        assert _sealed(sweep / job)[-1:] == [f"checkpoint-{metrics[job]['steps']}"] and metrics[job]["steps"] < STEPS
        assert not (sweep / job / "run.lock").exists()
    finished = len(metrics) - len(stopped)
    assert "Traceback" not in (tmp_path / "err").read_text()
    assert (tmp_path / "err").read_text().splitlines() == [
        f"stopped by SIGINT (Ctrl-C) during the sweep in {sweep}: {finished} finished job(s) kept, job(s) "
        f"{' '.join(stopped)} stopped at a checkpoint; continue with the same command plus resume=auto (finished "
        "jobs are skipped, stopped ones resume)"
    ]
    if to == "parent":  # the jobs left the same as from a terminal: resumed once, below
        return
    resumed = run_job([*args, "resume=auto"], timeout=900, cwd=REPO, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for job in stopped:
        again = json.loads((sweep / job / "metrics.json").read_text())
        assert again["status"] == "ok" and again["steps"] == STEPS, again
        assert again["resumed_from"] == str(sweep / job / "checkpoints" / f"checkpoint-{metrics[job]['steps']}")
