"""peft.adapter_dtype=auto (the default) in a real run of the tiny NF4 model on CPU: under precision=bf16
the loaded model's adapters are bf16, the plan counts them at 2 bytes, and config.yaml records bfloat16;
under the fp32 this CPU picks, nothing changes (float32 adapters, as before)."""

import json

import torch
import yaml
from conftest import train_smoke

from qlora_recipes.model import loading


def _spy_on_the_loaded_adapters(monkeypatch) -> dict:
    """Wrap loading.make_trainable: the trained tensors of the model the run trains, as loaded."""
    seen: dict = {}
    real = loading.make_trainable

    def spy(cfg, model):
        model = real(cfg, model)
        trained = [p for p in model.parameters() if p.requires_grad]
        seen["dtypes"] = {p.dtype for p in trained}
        seen["bytes"] = sum(p.numel() * p.element_size() for p in trained)
        return model

    monkeypatch.setattr(loading, "make_trainable", spy)
    return seen


def _run(monkeypatch, run_dir, precision: str) -> tuple[dict, dict, str]:
    """(the loaded adapters, plan.json, config.yaml's peft.adapter_dtype) of a smoke run at `precision`."""
    seen = _spy_on_the_loaded_adapters(monkeypatch)
    m, run = train_smoke(run_dir, f"precision={precision}")
    assert m["steps"] == 3
    plan = json.loads((run / "plan.json").read_text())
    return seen, plan, yaml.safe_load((run / "config.yaml").read_text())["peft"]["adapter_dtype"]


def test_auto_adapters_follow_the_compute_dtype_as_planned_and_recorded(monkeypatch, tmp_path):
    seen, plan, recorded = _run(monkeypatch, tmp_path / "bf16", "bf16")
    assert seen["dtypes"] == {torch.bfloat16} and recorded == "bfloat16"
    assert plan["stack"]["adapter_dtype"] == "bfloat16"
    assert plan["components"]["lora_weights"]["cpu"] == seen["bytes"]  # 2 bytes an element, as loaded
    # fp32 compute (what this CPU's precision=auto picks): float32 adapters, as before
    seen, plan, recorded = _run(monkeypatch, tmp_path / "fp32", "fp32")
    assert seen["dtypes"] == {torch.float32} and recorded == "float32"
    assert "adapter_dtype" not in plan["stack"]
    assert plan["components"]["lora_weights"]["cpu"] == seen["bytes"]
