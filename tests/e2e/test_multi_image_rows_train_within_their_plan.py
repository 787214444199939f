"""A tiny LLaVA whose tower's forward is a large part of a CPU run's peak (1,025 patches an image, 256 wide)
trains a few steps through `python train.py` on rows of two and three images: data.images_per_row=auto
reads three from the rows, the plan counts three a row, and the run measures within [0.9, 1.1] of it (a plan
of one image a row is about 1.2 of it)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO
from helpers_vision import build_wide_llava, write_multi_image_rows


@pytest.mark.slow
def test_rows_of_several_images_train_within_a_tenth_of_their_plan(tmp_path):
    model = build_wide_llava(tmp_path / "model")
    rows = write_multi_image_rows(tmp_path / "data", (2, 3) * 6)
    run = tmp_path / "run"
    args = [f"model.name_or_path={model}", f"data.path={rows}", "quant=nf4", "optim=paged8bit", "trainer=smoke"]
    cmd = [sys.executable, str(REPO / "train.py"), *args, "data.metric=null", f"hydra.run.dir={run}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"data.images_per_row=auto -> 3 (the most images a row of the data holds: {rows} line 2)"
        in proc.stdout + proc.stderr
    )
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["images_per_row"] == 3
    plan = json.loads((run / "plan.json").read_text())
    assert any("planned for 3 images a row (data.images_per_row=3)" in n for n in plan["notes"])
    saved = json.loads((run / "metrics.json").read_text())
    assert 0.9 <= saved["plan_ratio"] <= 1.1, saved
