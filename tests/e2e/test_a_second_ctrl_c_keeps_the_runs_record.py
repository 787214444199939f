"""Ctrl-C pressed again and again while a plain run is stopping (after the first it finishes its step,
seals a checkpoint there, then writes metrics.json): the run stops exactly as after one Ctrl-C, with
its record, a sealed checkpoint and one line saying the further presses wait for the save. A second
Ctrl-C used to land after the checkpoint as a KeyboardInterrupt, and the run ended with no
metrics.json."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, SMOKE
from test_ctrl_c_in_a_local_sweep_stops_its_jobs_at_a_checkpoint import _sealed, _sigint_as_in_a_terminal

from qlora_recipes.run.checkpoints import STAGING

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.slow  # loads and trains the tiny default: ~1 min on the shared 2-core machine
def test_ctrl_c_pressed_again_while_the_run_stops_keeps_its_metrics_and_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, str(REPO / "train.py"), *SMOKE, "trainer.max_steps=200", f"hydra.run.dir={run}"]
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=_sigint_as_in_a_terminal)  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not (run / "memory.jsonl").is_file():  # a step has been logged: training
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        while proc.poll() is None and not (run / "metrics.json").exists():  # pressed again until the record is in
            time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130, (tmp_path / "err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    metrics = json.loads((run / "metrics.json").read_text())
    step = metrics["steps"]
    assert metrics["status"] == "preempted" and metrics["signal"] == "SIGINT", metrics
    assert metrics["checkpoint"] == str(run / "checkpoints" / f"checkpoint-{step}")
    assert _sealed(run)[-1:] == [f"checkpoint-{step}"] and not (run / "checkpoints" / STAGING).exists()
    assert not (run / "run.lock").exists()
    err = (tmp_path / "err").read_text()
    assert "Traceback" not in err
    held = [line for line in err.splitlines() if line.startswith("already stopping for SIGINT (Ctrl-C): ")]
    assert len(held) == 1 and "Ctrl-C again is ignored" in held[0], err[-3000:]
    assert err.splitlines()[-1].startswith(f"stopped by SIGINT at step {step}; checkpoint {metrics['checkpoint']}")
