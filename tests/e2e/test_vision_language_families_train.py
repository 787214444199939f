"""Each vision-language family beyond LLaVA (tiny, built offline) trains through `python train.py` on image
rows with its language model in NF4 and LoRA, its vision parts unquantized: the loss falls, the adapter
adapts the language model only and the processor is saved beside it. Qwen-VL and SmolVLM processors build a
video processor, which needs torchvision: without it they train image-only, and such a run merges and
answers `qlora generate --image` from the run dir and the merged dir alike."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import helpers_vlm_families as fam
import pytest
from conftest import REPO
from helpers_vision import write_colour_rows
from test_vision_language_model_trains import _train_py

LANGUAGE_MODEL = {"idefics3": "model.text_model", "smolvlm": "model.text_model"}  # the rest: model.language_model
BUILDS_VIDEO = ("qwen2_5_vl", "qwen3_vl", "smolvlm")  # processors that build a video processor
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
_RUNS: dict[str, tuple] = {}  # kind -> (train.py's process, run dir, images, wide rows): one run a kind


def _trained(kind: str, tmp_path_factory) -> tuple:
    if kind not in _RUNS:
        folder = tmp_path_factory.mktemp(kind)
        model = getattr(fam, f"build_{kind}")(folder / "model")
        rows = write_colour_rows(folder / "data")
        wide = fam.add_wide_rows(rows)  # a second image shape: tiles, sub-images, a resize
        run_dir = folder / "run"
        proc = _train_py(
            f"model.name_or_path={model}",
            f"data.path={rows}",
            "quant=nf4",
            "optim=paged8bit",
            "trainer=smoke",
            "trainer.max_steps=20",
            "data.metric=null",
            f"hydra.run.dir={run_dir}",
        )
        _RUNS[kind] = proc, run_dir, rows.parent / "images", wide
    return _RUNS[kind]


@pytest.mark.slow
@pytest.mark.parametrize("kind", fam.FAMILIES)
def test_each_vision_language_family_trains_on_image_rows_with_nf4_and_paged8bit(kind, tmp_path_factory):
    proc, run_dir, _, wide = _trained(kind, tmp_path_factory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if kind in BUILDS_VIDEO and not HAS_TORCHVISION:
        assert "built without its video processor" in proc.stdout + proc.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    losses = metrics["train_losses"]
    assert metrics["steps"] == 20 and all(math.isfinite(x) for x in losses)
    assert sum(metrics["data"]["rows"].values()) == 4 * 8 + wide  # every row trained or held out, none dropped
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2, losses  # it learns
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "processor_config.json").is_file()
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    lm = LANGUAGE_MODEL.get(kind, "model.language_model")
    assert targets.startswith(lm.replace(".", r"\.") + r"\.")  # LoRA on the language model only
    plan = json.loads((run_dir / "plan.json").read_text())
    assert any(n.startswith("vision: the vision tower and projector") for n in plan["notes"])


def _run(*argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=900, env=ENV)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_a_qwen2_5_vl_run_merges_and_answers_with_an_image_from_both_dirs(tmp_path_factory):
    proc, run_dir, images, _ = _trained("qwen2_5_vl", tmp_path_factory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _run("-m", "qlora_recipes", "merge", str(run_dir), "--dtype", "bfloat16")
    merged = run_dir / "merged"
    saved = json.loads((merged / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2_5_VLProcessor" and "image_processor" in saved
    answers = {}
    for folder in (run_dir, merged):
        ask = ("-m", "qlora_recipes", "generate", str(folder), "colour?", "--jsonl", "--image", str(images / "red.png"))
        answers[folder.name] = json.loads(_run(*ask).stdout.strip())
    assert answers["run"] == answers["merged"] and answers["run"]["images"] == [str(images / "red.png")], answers
