"""The line of a sweep whose local jobs were stopped names each job by what it left: finished (kept),
a sound checkpoint (resumes), or none to resume from, a torn one included (runs anew). The end to end
run: tests/e2e/test_ctrl_c_in_a_local_sweep_stops_its_jobs_at_a_checkpoint.py."""

import json
from pathlib import Path

import yaml

from qlora_recipes.integrations.sweep import stopped_line
from qlora_recipes.run.checkpoints import RECORD


def _job(sweep: Path, num: int, metrics: dict | None) -> Path:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"peft.r={4 * (num + 1)}"]))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))
    return job


def _checkpoint(job: Path, step: int, torn: bool = False) -> None:
    """A checkpoint dir as a save seals it: its files listed in RECORD with their sizes (one cut short: torn)."""
    folder = job / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * (10 if torn else 100))
    files = {"trainer_state.json": {"bytes": (folder / "trainer_state.json").stat().st_size}}
    files["adapter_model.safetensors"] = {"bytes": 100}
    (folder / RECORD).write_text(json.dumps({"step": step, "files": files}))


def test_stopped_jobs_are_named_by_whether_they_can_resume(tmp_path):
    sweep = tmp_path / "sweep"
    _job(sweep, 0, {"status": "ok", "steps": 40})
    _checkpoint(_job(sweep, 1, {"status": "preempted", "steps": 7, "signal": "SIGINT"}), 7)
    _checkpoint(_job(sweep, 2, None), 3, torn=True)  # cut short mid-save: not resumable
    _job(sweep, 3, None)  # stopped while starting
    _job(sweep, 4, {"status": "skipped", "reason": "does not fit"})  # its own record: not a stopped job
    line = stopped_line(sweep, "stopped by SIGINT (Ctrl-C)", jobs_stopped=3)
    assert line == (
        f"stopped by SIGINT (Ctrl-C) during the sweep in {sweep}: 1 finished job(s) kept, job(s) 1 stopped at a "
        "checkpoint, job(s) 2 3 stopped with no checkpoint to resume from (run anew); continue with the same "
        "command plus resume=auto (finished jobs are skipped, stopped ones resume)"
    )


def test_a_sweep_that_stopped_no_job_of_its_own_says_what_it_kept_only(tmp_path):
    sweep = tmp_path / "sweep"
    _job(sweep, 0, {"status": "ok", "steps": 40})
    _job(sweep, 1, None)
    assert stopped_line(sweep, "stopped by SIGTERM", jobs_stopped=0) == (
        f"stopped by SIGTERM during the sweep in {sweep}: 1 finished job(s) kept; continue with the same command "
        "plus resume=auto (finished jobs are skipped, stopped ones resume)"
    )
