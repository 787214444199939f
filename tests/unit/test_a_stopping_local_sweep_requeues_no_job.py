"""SIGTERM to a hydra/launcher=local sweep's process group reaches each job's submitit controller,
which passes it on as a preemption: a job stopping then is not requeued (it would train on after the
sweep said it stopped), while a SIGTERM to the job id alone still requeues it. Real submitit local
jobs whose trainer stand-in hands over as the run's callback does once its checkpoint is sealed; this
process is the sweep's parent. The end to end run with training:
tests/e2e/test_sigterm_to_a_local_sweep_stops_its_jobs_without_a_requeue.py."""

import os
import signal
import time
from pathlib import Path

import pytest

from qlora_recipes import interrupts
from qlora_recipes.integrations import cluster

# The trainer's part: it stops where it starts if its sweep is stopping (cli/train.py), records SIGTERM
# (PreemptionCallback), saves for SAVE_S seconds, then hands over (its on_train_end).
TRAINER = """
import os, signal, threading, time
from pathlib import Path
from qlora_recipes import interrupts
from qlora_recipes.integrations import cluster
root = Path(os.environ["SUBMITIT_FOLDER"]).parent
try:
    cluster.stop_with_local_controller()
except interrupts.Interrupted:
    root.joinpath(f"refused-{os.getpid()}").touch()
    raise SystemExit(143)
got = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: got.set())
root.joinpath(f"started-{os.getpid()}").touch()
got.wait(60)
time.sleep(SAVE_S)
cluster.hand_over(cluster.submitit_handler(signal.getsignal(cluster.preemption_signal())), "SIGTERM")
"""


@pytest.fixture
def local_job(tmp_path, monkeypatch):
    """A submitit local job running TRAINER: (the job, its controller's pid, the folder of the
    sweep's submitit folders)."""
    import submitit

    monkeypatch.setattr(cluster, "_STOPPING", [])
    monkeypatch.chdir(Path(__file__).parents[2])  # the job imports qlora_recipes from here
    folder = tmp_path / ".submitit" / "%j"
    executor = submitit.LocalExecutor(folder=str(folder))
    executor.update_parameters(timeout_min=60)  # under 10 min submitit counts every stop as timed out
    cluster.track_local_sweep(str(folder))
    job = executor.submit(exec, TRAINER, {"SAVE_S": 1.0})
    yield job, int(job.job_id), tmp_path / ".submitit"
    job.cancel()


def _trainers_started(root: Path, count: int) -> list[int]:
    deadline = time.monotonic() + 60
    while len(started := sorted(root.glob("started-*"))) < count:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    return [int(p.name.split("-")[1]) for p in started]


def test_sigterm_to_the_sweeps_group_stops_each_job_without_a_requeue(local_job):
    job, controller, root = local_job
    (trainer,) = _trainers_started(root, 1)
    for pid in (controller, trainer):  # what `kill -- -PGID` sends them; the parent's own handler:
        os.kill(pid, signal.SIGTERM)
    assert cluster.stop_local_jobs("SIGTERM", wait_s=60) == 1
    assert job.result() is None  # ended once, not started again
    assert len(list(root.glob("started-*"))) == 1
    assert "the sweep is stopping (SIGTERM): this job is not requeued" in job.stderr()
    assert not (root / cluster.STOP_MARK).exists()  # every job has ended: the mark goes


def test_sigterm_to_the_job_id_alone_still_requeues_it(local_job):
    job, controller, root = local_job
    _trainers_started(root, 1)
    os.kill(controller, signal.SIGTERM)  # the documented way to try a preemption on one machine
    (_, again) = _trainers_started(root, 2)  # requeued: the controller started the job anew
    os.kill(again, signal.SIGTERM)
    assert "submitit requeues this job" in job.stderr()


def test_a_job_starting_while_its_sweep_stops_does_not_start(tmp_path, monkeypatch):
    """A job requeued just before the parent marked the sweep: its new trainer stops where it starts."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("SUBMITIT_FOLDER", str(tmp_path / ".submitit" / "%j"))
    (tmp_path / ".submitit").mkdir()
    (tmp_path / ".submitit" / cluster.STOP_MARK).write_text("SIGTERM")
    with pytest.raises(interrupts.Interrupted) as stopped:
        cluster.stop_with_local_controller()
    assert interrupts.signal_name(stopped.value) == "SIGTERM"
