"""`python train.py trainer=smoke` as a user runs it prints no warnings, the run dir first and the summary
and next commands at the end."""

import json
import re
import subprocess
import sys

from conftest import REPO


def test_the_default_smoke_run_prints_no_warnings_and_ends_with_the_summary_and_next_commands(tmp_path):
    """`python train.py trainer=smoke` as a user runs it: no Warning line at all, the run dir at
    the start, the table and the commands with that run dir at the end; metrics.json as before."""
    run_dir = tmp_path / "runs" / "smoke"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "trainer=smoke", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [ln for ln in (proc.stderr + proc.stdout).splitlines() if re.search(r"warning", ln, re.IGNORECASE)]
    assert warned == []
    out = proc.stdout.splitlines()
    assert out.index("run dir: runs/smoke") < out.index("stack recipe=-")  # where it writes, first
    assert "optim: paged_adamw_8bit runs unpaged on this CPU" in proc.stdout
    assert "done: runs/smoke  (adapter/, metrics.json)" in out
    assert re.search(r"^  merge +python scripts/merge.py runs/smoke$", proc.stdout, re.MULTILINE)
    assert "trainer=smoke resume=auto hydra.run.dir=runs/smoke trainer.max_steps=6" in proc.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and f"{metrics['train_loss_first']:.4g} -> " in proc.stdout
