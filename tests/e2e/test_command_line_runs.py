"""The command line as a user meets it, real processes that train: Ctrl-C while loading and while
training. A multirun and its summary: test_readme.py (the documented 4-job sweep); the plain smoke command:
test_the_smoke_command_as_a_user_runs_it.py."""

import json
import os
import shlex
import signal
import subprocess
import sys

import pytest
from conftest import REPO, SMOKE

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def run(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


def _interrupt_when(marker: str, run_dir, *args: str) -> tuple[subprocess.Popen, str]:
    """Start a run, send SIGINT (Ctrl-C) once `marker` appears on stdout; (process, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-u", str(REPO / "train.py"), *SMOKE, *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if marker in line:
            proc.send_signal(signal.SIGINT)
            break
    _, stderr = proc.communicate(timeout=600)
    return proc, stderr


@pytest.mark.slow
def test_ctrl_c_while_loading_the_model_keeps_only_whole_files(tmp_path):
    run_dir = tmp_path / "run"
    proc, stderr = _interrupt_when("quant = nf4", run_dir, "trainer.max_steps=200")  # the tree: checks passed
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert len([ln for ln in stderr.splitlines() if ln.startswith("stopped by SIGINT")]) == 1, stderr[-2000:]
    if not run_dir.exists():  # the signal came before the run's files were written: none are
        assert "stopped by SIGINT (Ctrl-C) before anything was written" in stderr
        return
    assert {p.name for p in run_dir.iterdir()} <= {".hydra", "config.yaml", "plan.json", "tb"}
    assert json.loads((run_dir / "plan.json").read_text())["fits"] and "quant:" in (run_dir / "config.yaml").read_text()
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()  # the group is whole


@pytest.mark.slow
def test_ctrl_c_while_training_saves_and_prints_a_resume_command_that_pastes(tmp_path):
    run_dir = tmp_path / "my runs" / "run"  # a space: the hint must quote it
    proc, stderr = _interrupt_when("'loss'", run_dir, "trainer.max_steps=200")
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    line = next(ln for ln in stderr.splitlines() if ln.startswith("stopped by SIGINT at step"))
    argv = shlex.split(line.split("resume with: ", 1)[1])
    assert argv[:2] == ["python", "train.py"] and f"hydra.run.dir={run_dir}" in argv and "resume=auto" in argv
    assert (run_dir / "checkpoints").is_dir()
