"""A job of 2 CPU ranks (torchrun, gloo) never hangs and never lies when one rank is signalled or
killed: a SIGTERM to one rank stops both at the same step with a checkpoint there, one line and exit
143 per rank (it used to leave both ranks waiting in their next collective for ever, printing
nothing); a rank killed outright ends the other with one line naming the last checkpoint and the
resume command, not gloo's traceback. Each rank writes its own metrics file. The printed resume is
torchrun with the same ranks and, run as printed, finishes the run; a resume on one process is
refused, since the global batch would change. (torchrun itself then reports the ranks' exit codes
in its own words and exits 1.)"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SMOKE, run_job, sample_subset

ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # torchrun, as printed
}
STEPS = ("trainer.max_steps=6", "trainer.save_steps=2")


def _launch(cmd: list[str] | str, cwd: Path, faults: str = "", timeout: int = 400) -> subprocess.CompletedProcess:
    """Run the job; a hang past `timeout` is ended with every rank (conftest.run_job)."""
    env = {**ENV, "QLORA_RECIPES_FAULTS": faults} if faults else ENV
    return run_job(cmd, timeout=timeout, merge_output=True, cwd=cwd, env=env, shell=isinstance(cmd, str))


def _torchrun(run: Path, data: list[str], faults: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "train.py"), *SMOKE, *STEPS, *data, f"hydra.run.dir={run}"]  # fmt: skip
    return _launch(cmd, run.parent, faults)


def _metrics(run: Path) -> list[dict]:
    return [json.loads((run / name).read_text()) for name in ("metrics.json", "metrics.rank1.json")]


def _lines(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The job, rank 1 sent SIGTERM at the end of step 3: (torchrun's process, run dir, data overrides)."""
    tmp = tmp_path_factory.mktemp("stopped")
    data = sample_subset(tmp, "", 64, 8)
    run = tmp / "run"
    return _torchrun(run, data, faults="sigterm_at_step=3,fault_rank=1"), run, data


def test_sigterm_to_one_rank_stops_both_at_that_step_with_one_line_and_exit_143(stopped):
    proc, run, _ = stopped
    lines = _lines(proc.stdout, "stopped by ")
    assert len(lines) == 1, proc.stdout[-4000:]
    expected = f"stopped by SIGTERM at step 3; checkpoint {run}/checkpoints/checkpoint-3; resume with: torchrun "
    assert lines[0].startswith(expected), lines
    assert proc.stdout.count("exitcode  : 143 (pid") == 2, proc.stdout[-3000:]  # torchrun's report: both ranks
    for m in _metrics(run):
        assert m == {"status": "preempted", "signal": "SIGTERM", "steps": 3, "checkpoint": m["checkpoint"]}
        assert m["checkpoint"].endswith("checkpoint-3")
    assert (run / "checkpoints" / "checkpoint-3" / "qlora_state.json").is_file()
    assert not (run / "run.lock").exists() and not list(run.glob("*.tmp")) and not list(run.glob(".*.tmp"))


def test_a_one_process_resume_of_the_two_rank_checkpoint_is_refused_in_one_line(stopped):
    _, run, data = stopped
    before = sorted(p.name for p in run.iterdir())
    cmd = [sys.executable, str(REPO / "train.py"), *SMOKE, *STEPS, *data, "resume=auto", f"hydra.run.dir={run}"]
    proc = _launch(cmd, run.parent)
    assert proc.returncode == 2, proc.stdout[-3000:]
    errors = _lines(proc.stdout, "error: ")
    assert len(errors) == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert errors[0].startswith(
        "error: resume: checkpoint-3 was trained on 2 ranks (global batch 4) and this run is 1 process (global batch 2)"
    ), errors
    assert "resume.allow_changes=true" in errors[0]
    assert sorted(p.name for p in run.iterdir()) == before


@pytest.fixture(scope="module")
def resumed(stopped):
    """The printed resume line, run as printed (from the repository, where `train.py` is)."""
    proc, run, data = stopped
    line = _lines(proc.stdout, "stopped by ")[0].split("resume with: ", 1)[1]
    assert shlex.split(line)[:4] == ["torchrun", "--standalone", "--nproc_per_node", "2"], line
    return _launch(line, REPO), run, data


def test_the_printed_resume_runs_as_printed_and_finishes_the_run_on_two_ranks(resumed):
    proc, run, _ = resumed
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = _metrics(run)
    for m in ranks:
        assert m["status"] == "ok" and m["steps"] == 6 and m["resumed_from"].endswith("checkpoint-3"), m
    assert ranks[0]["train_losses"] == ranks[1]["train_losses"]
    assert json.loads((run / "plan.json").read_text())["dist"]["world_size"] == 2


def test_a_rank_killed_outright_ends_the_other_with_one_line_naming_the_checkpoint(tmp_path):
    data = sample_subset(tmp_path, "", 64, 8)
    run = tmp_path / "run"
    proc = _torchrun(run, data, faults="sigkill_at_step=3,fault_rank=1")
    errors = _lines(proc.stdout, "error: ")
    assert len(errors) == 1, proc.stdout[-4000:]
    assert errors[0].startswith("error: rank 0: another rank of this job ended at step 3 (Connection"), errors
    assert f"its last checkpoint is {run}/checkpoints/checkpoint-2; resume with: torchrun --standalone" in errors[0]
    assert "pair.cc" not in proc.stdout and "Traceback" not in proc.stdout.split(errors[0])[0]  # gloo's words: gone
    # torchrun's own report names the killed rank; rank 0's exit 1 too when it ends before torchrun's SIGTERM
    assert "(SIGKILL)" in proc.stdout or "exitcode: -9" in proc.stdout, proc.stdout[-3000:]
    assert not (run / "run.lock").exists()


@pytest.mark.slow
def test_the_resumed_job_ends_as_an_uninterrupted_two_rank_run(resumed, tmp_path):
    """Bit-exact: the same losses and the same adapter as the same job never stopped. Then a resume
    on one process that accepts the change (resume.allow_changes=true) leaves no metrics.rank1.json."""
    _, run, data = resumed
    whole = _torchrun(tmp_path / "whole", data)
    assert whole.returncode == 0, whole.stdout[-4000:]
    expected, got = _metrics(tmp_path / "whole")[0], _metrics(run)[0]
    assert got["train_losses"] == expected["train_losses"]
    assert got["adapter_sha256"] == expected["adapter_sha256"]
    cmd = [sys.executable, str(REPO / "train.py"), *SMOKE, *STEPS, *data, "trainer.max_steps=8",
           "resume=auto", "resume.allow_changes=true", f"hydra.run.dir={run}"]  # fmt: skip
    one = _launch(cmd, run.parent)
    assert one.returncode == 0, one.stdout[-4000:]
    assert json.loads((run / "metrics.json").read_text())["steps"] == 8
    assert not (run / "metrics.rank1.json").exists()
