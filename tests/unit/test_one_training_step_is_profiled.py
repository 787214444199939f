"""`python -m bench.profile_step` puts one optimizer step of a training script under torch.profiler,
ours (train.py) and the plain TRL script (bench/baseline.py) alike, as gpu-check's part 1 records
them: on a CPU it profiles CPU activity (the tiny model here), and the results' markdown shows each
run's top ops."""

import gzip
import json
import subprocess
import sys

import pytest
from conftest import REPO

from bench import report
from bench.profile_step import TOP
from bench.runner import baseline_argv, child_env
from bench.trace.syncs import JOB
from qlora_recipes.config.loader import load

STEPS = ["trainer.max_steps=2", "trainer.gradient_checkpointing=false"]


def _argv(side: str, tmp_path) -> list[str]:
    prof = ["-m", "bench.profile_step", "2", str(tmp_path / "profile")]
    if side == "ours":
        return [sys.executable, *prof, "train.py", *JOB, *STEPS, f"hydra.run.dir={tmp_path / 'run'}"]
    argv = baseline_argv(load([*JOB, *STEPS]), tmp_path / "run", tmp_path / "metrics.json")
    return [argv[0], *prof, *argv[1:]]


@pytest.mark.slow  # a training process each: ~25 s of CPU, minutes on a busy machine
@pytest.mark.parametrize("side", ["ours", "baseline"])
def test_step_two_is_profiled_and_its_top_ops_are_shown(side, tmp_path):
    done = subprocess.run(_argv(side, tmp_path), cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    prof = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert prof["step"] == 2 and prof["activities"] == ["cpu"] and prof["sort_by"] == "cpu_time_total"
    totals = [r["cpu_total_ms"] for r in prof["rows"]]
    assert len(totals) == TOP and totals == sorted(totals, reverse=True) and totals[-1] > 0
    assert any(r["op"] in ("aten::mm", "aten::addmm", "aten::linear") for r in prof["rows"])
    assert 0 < prof["step_wall_s"] and 0 < prof["self_cpu_ms_all"] <= prof["step_wall_s"] * 1000 * 1.05
    with gzip.open(tmp_path / "profile" / "trace.json.gz") as f:
        assert json.load(f)["traceEvents"]
    stack = {"name": "tiny", side: {"runs": [{"status": "ok"}, {"status": "ok", "profile": prof}]}}
    lines = report.render_markdown({"device": {"kind": "cpu", "name": "cpu"}, "stacks": [stack]}).splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith(f"torch.profiler, tiny ({side}), step 2"))
    rows = lines[title + 4 : title + 4 + TOP]
    assert [r.split(" | ")[0].strip("| `") for r in rows] == [r["op"] for r in prof["rows"]]
