"""`make shapes`, as a user runs it: it builds the tiny vision-language model at first use
(scripts/make_tiny_vlm.py), trains it on the shipped image sample and measures exact match on the
held-out images; the second run finds the model built."""

import json
import os
import subprocess

import pytest
from conftest import REPO

MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")
ENV = {**{k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES}, "HF_HUB_OFFLINE": "1"}


def _make_shapes(tiny_vlm, run_dir) -> subprocess.CompletedProcess:
    args = f"ARGS=trainer=smoke data.metric_examples=8 hydra.run.dir={run_dir}"
    cmd = ["make", "--no-print-directory", "-o", ".venv/.installed", "shapes", f"TINY_VLM={tiny_vlm}", args]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1500)


@pytest.mark.slow
def test_make_shapes_builds_the_tiny_vlm_and_trains_on_the_sample(tmp_path):
    tiny_vlm = tmp_path / "tiny-llava"
    proc = _make_shapes(tiny_vlm, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "make_tiny_vlm.py" in proc.stdout and (tiny_vlm / "processor_config.json").is_file()
    config = json.loads((tiny_vlm / "config.json").read_text())
    assert config["model_type"] == "llava" and config["text_config"]["hidden_size"] == 128  # the tiny base's
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["data"]["images"] and metrics["data"]["rows"] == {"train": 384, "eval": 64}
    assert 0.0 <= metrics["eval_exact_match"] <= 1.0 and "exact match" in metrics["data"]["metric"]
    again = _make_shapes(tiny_vlm, tmp_path / "run2")  # the model is built once
    assert again.returncode == 0 and "make_tiny_vlm.py" not in again.stdout, again.stderr[-3000:]
