"""The run-dir lock under SLURM: a job requeued onto another node after a hard kill takes over the
lock its earlier start left; another job's (or another user's, or the same start's) live lock is refused.
The SLURM environment is SLURM's own variables set here; the earlier start's lock is written as it
would have been on node-a, whose processes this host cannot check."""

import getpass
import json
import logging

import pytest

from qlora_recipes.errors import UserError
from qlora_recipes.run.lock import LOCK, RunDirLock

NODE_A = "node-a.cluster.invalid"  # not this host: its pid cannot be checked from here


def _left_on_node_a(run_dir, job="777", restart=0, user=None):
    """The lock a hard-killed start of SLURM job `job` left on node-a (pid 4242, no flock any more);
    job=None: a lock of an older version, pid and host only."""
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {"pid": 4242, "host": NODE_A}
    if job:
        holder.update(user=user or getpass.getuser(), slurm_job_id=job, slurm_restart_count=restart)
    (run_dir / LOCK).write_text(json.dumps(holder) + "\n")
    return (run_dir / LOCK).read_text()


@pytest.fixture
def slurm(monkeypatch):
    """Set this process's SLURM job id and restart count, as SLURM does for a job (None: outside SLURM)."""

    def set_job(job, restart=None):
        for var, value in (("SLURM_JOB_ID", job), ("SLURM_RESTART_COUNT", restart)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, str(value))

    return set_job


def test_a_requeued_slurm_job_takes_over_the_lock_it_left_on_another_node(tmp_path, slurm, caplog):
    run_dir = tmp_path / "run"
    _left_on_node_a(run_dir, job="777", restart=0)
    slurm("777", restart=1)  # `scontrol requeue` (or a node failure with --requeue): same id, restart 1
    with caplog.at_level(logging.WARNING, logger="qlora_recipes.run.lock"):
        with RunDirLock(run_dir):
            mine = json.loads((run_dir / LOCK).read_text())
            assert mine["slurm_job_id"] == "777" and mine["slurm_restart_count"] == 1 and mine["host"] != NODE_A
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert f"held by SLURM job 777 on {NODE_A} (restart 0); this is that job requeued (restart 1)" in said[0]
    assert "taking the lock over" in said[0]
    assert not (run_dir / LOCK).exists()  # released at the end, as always


@pytest.mark.parametrize(
    "job,restart,user,why",
    [
        ("778", 1, None, "another SLURM job"),
        ("777", 0, None, "the same start of the job: another srun step of one allocation may still run"),
        ("777", 1, "someone-else", "the lock is another user's"),
        (None, None, None, "outside SLURM: a process on another host cannot be checked"),
    ],
)
def test_a_live_lock_of_another_job_user_or_start_is_refused(tmp_path, slurm, job, restart, user, why):
    run_dir = tmp_path / "run"
    before = _left_on_node_a(run_dir, job="777", restart=0, user=user)
    slurm(job, restart)
    with pytest.raises(UserError, match=rf"in use by process 4242 on {NODE_A} \(SLURM job 777\)"):
        RunDirLock(run_dir).__enter__()
    assert (run_dir / LOCK).read_text() == before, why  # the holder's lock is left as it was


def test_a_lock_from_before_slurm_was_recorded_is_not_taken_over(tmp_path, slurm):
    run_dir = tmp_path / "run"
    _left_on_node_a(run_dir, job=None)
    slurm("777", restart=3)
    with pytest.raises(
        UserError, match=rf"in use by process 4242 on {NODE_A} \(lock .*if that process is gone, delete"
    ):
        RunDirLock(run_dir).__enter__()


def test_ctrl_c_while_locking_leaves_no_lock_and_no_run_dir(tmp_path):
    """A Ctrl-C that lands while the lock is being made is held until it is whole, then raised out
    of `with RunDirLock(...)` - which then never calls __exit__: the lock and the dir go here."""
    import signal

    class CtrlCWhileLocking(RunDirLock):
        def _acquire(self):
            super()._acquire()
            signal.raise_signal(signal.SIGINT)  # arrives after run.lock was written

    # Ctrl-C as in a terminal: a suite started in the background inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    run_dir = tmp_path / "run"
    try:
        with pytest.raises(KeyboardInterrupt), CtrlCWhileLocking(run_dir):
            pytest.fail("the run must not start")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not run_dir.exists()
