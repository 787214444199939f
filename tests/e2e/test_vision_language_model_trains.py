"""A tiny LLaVA (built offline) trains through `python train.py` on image rows with its language model in
NF4 and LoRA, its vision tower unquantized: the loss falls, the adapter and the processor are saved, the
plan is written; a bad image row stops the run in one line before anything is written."""

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO
from helpers_vision import build_llava, colour_row, write_colour_rows


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


def _train_py(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


@pytest.mark.slow
def test_a_tiny_llava_trains_on_image_rows_with_nf4_and_paged8bit(tmp_path, llava):
    rows = write_colour_rows(tmp_path / "data")
    run_dir = tmp_path / "run"
    proc = _train_py(
        f"model.name_or_path={llava}",
        f"data.path={rows}",
        "quant=nf4",
        "optim=paged8bit",
        "trainer=smoke",
        "trainer.max_steps=20",
        "data.metric=null",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    losses = metrics["train_losses"]
    assert metrics["steps"] == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses  # it learns
    assert metrics["data"]["images"] and metrics["data"]["rows"]["train"] == 29
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "processor_config.json").is_file()
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert targets.startswith(r"model\.language_model\.")  # LoRA on the language model only
    plan = json.loads((run_dir / "plan.json").read_text())
    assert any(n.startswith("vision: the vision tower and projector") for n in plan["notes"])


@pytest.mark.slow
def test_a_missing_image_is_one_line_naming_the_row_before_anything_is_written(tmp_path, llava):
    rows = write_colour_rows(tmp_path / "data", repeats=2)
    with rows.open("a") as f:
        f.write(json.dumps(colour_row("red", "images/gone.png")) + "\n")
    run_dir = tmp_path / "run"
    proc = _train_py(f"model.name_or_path={llava}", f"data.path={rows}", "trainer=smoke", f"hydra.run.dir={run_dir}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors == [
        f"error: {rows} line 9: images[0] '{rows.parent / 'images' / 'gone.png'}' does not exist; relative paths "
        "are read from the data file's folder"
    ]
    assert not (run_dir / "plan.json").exists() and not (run_dir / "config.yaml").exists()
