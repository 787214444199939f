"""Each vision-language family beyond LLaVA (tiny, built offline) trains through `python train.py` on image
rows with its language model in NF4 and LoRA, its vision parts unquantized: the loss falls, the adapter
adapts the language model only and the processor is saved beside it. Qwen-VL and SmolVLM processors need
torchvision: without it the run stops in one line before anything is written."""

import importlib.util
import json
import math

import helpers_vlm_families as fam
import pytest
from helpers_vision import write_colour_rows
from test_vision_language_model_trains import _train_py

LANGUAGE_MODEL = {"idefics3": "model.text_model", "smolvlm": "model.text_model"}  # the rest: model.language_model
NEEDS_TORCHVISION = ("qwen2_5_vl", "qwen3_vl", "smolvlm")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.mark.slow
@pytest.mark.parametrize("kind", fam.FAMILIES)
def test_each_vision_language_family_trains_on_image_rows_with_nf4_and_paged8bit(kind, tmp_path):
    model = getattr(fam, f"build_{kind}")(tmp_path / "model")
    rows = write_colour_rows(tmp_path / "data")
    wide = fam.add_wide_rows(rows)  # a second image shape: tiles, sub-images, a resize
    run_dir = tmp_path / "run"
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
    if kind in NEEDS_TORCHVISION and not HAS_TORCHVISION:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(errors) == 1 and "requires the Torchvision library" in errors[0], errors
        assert errors[0].endswith("install the torchvision built for your torch, then run again")
        assert not run_dir.exists() or not any(run_dir.iterdir())
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
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
