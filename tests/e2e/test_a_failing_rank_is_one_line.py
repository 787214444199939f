"""A job of 2 CPU ranks that fails on a user's mistake says it in one line, with exit code 2.

`qlora launch` (scripts/launch.py) checks what every rank would check before it loads anything
(the data files, the model dir, a run already in the run dir) in its own process first, and starts
no rank for a mistake there. A mistake only the ranks can find (the rows of a data file) is said by
rank 0 once; the launcher adds no report of its own (torch's elastic agent would print some 30
lines of ChildFailedError and exit 1) and exits with the rank's code. Under a bare `torchrun
train.py` the ranks still say it once, and each exits 2 (torchrun's own report follows: not ours)."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO, SMOKE, run_job

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
RECIPE = ("llama3.1-70b-2x24gb", "model=tiny", "data=order", *SMOKE)  # FSDP on 2 ranks, started by accelerate


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    proc = run_job(cmd, timeout=600, cwd=cwd, env=ENV)
    return proc.returncode, proc.stdout + proc.stderr


def _launch(tmp_path: Path, *args: str) -> tuple[int, str]:
    return _run([sys.executable, str(REPO / "scripts" / "launch.py"), "--cpu", *args], tmp_path)


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error: ")]


def test_qlora_launch_refuses_a_missing_data_file_before_any_rank_starts(tmp_path):
    run = tmp_path / "run"
    code, out = _launch(tmp_path, *RECIPE, f"data.path={tmp_path / 'missing.jsonl'}", f"hydra.run.dir={run}")
    assert code == 2, out[-3000:]
    assert out.strip().splitlines() == _errors(out), out[-3000:]  # that one line and nothing else
    assert _errors(out)[0].startswith(f"error: data.path: {tmp_path / 'missing.jsonl'} does not exist")
    assert not run.exists()


def test_qlora_launch_refuses_a_run_dir_holding_a_run_before_any_rank_starts(tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"status": "ok"}))
    code, out = _launch(tmp_path, *RECIPE, f"hydra.run.dir={run}")
    assert code == 2, out[-3000:]
    assert out.strip().splitlines() == _errors(out), out[-3000:]
    assert "already holds a finished run" in _errors(out)[0] and "resume=auto" in _errors(out)[0]
    assert sorted(p.name for p in run.iterdir()) == ["adapter", "metrics.json"]


@pytest.mark.parametrize("launcher", [pytest.param("accelerate", marks=pytest.mark.slow), "torchrun"])  # the same path
def test_a_mistake_the_ranks_find_is_one_line_and_the_rank_exit_code(launcher, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "2+2", "answer": "4"}) + "\n")  # no format the reader knows
    code, out = _launch(tmp_path, *RECIPE, f"dist.launcher={launcher}", f"data.path={rows}",
                        f"hydra.run.dir={tmp_path / 'run'}")  # fmt: skip
    assert code == 2, out[-3000:]
    errors = _errors(out)
    assert len(errors) == 1 and "cannot detect the data format" in errors[0], out[-3000:]
    for noise in ("Traceback", "ChildFailedError", "FAILED", "exitcode"):
        assert noise not in out, out[-3000:]


def test_under_a_bare_torchrun_a_mistake_is_said_once_and_every_rank_exits_2(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "train.py"), *SMOKE, "trainer.max_steps=-1", "trainer.epochs=0",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    code, out = _run(cmd, tmp_path)
    assert code != 0
    assert _errors(out) == ["error: trainer.max_steps and trainer.epochs are both <= 0: set one of them"], out[-3000:]
    # torchrun's report of the ranks: each exits 2, unless torchrun stops it (SIGTERM) as the first one exits
    codes = set(re.findall(r"exitcode\s*: (-?\d+) \(pid", out))
    assert "2" in codes and codes <= {"2", "-15"}, out[-3000:]
