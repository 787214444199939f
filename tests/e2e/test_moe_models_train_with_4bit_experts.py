"""MoE models train with their experts stored in 4 bits (quant.experts=4bit, the default under nf4/fp4):
tiny Qwen3-MoE, gpt-oss and Mixtral models, built from transformers' own config classes (helpers_models.py,
helpers_families.py) and saved as a user's model dir, load with every fused expert weight quantized as it
lands (never more than one of them in 16 bits), routers and gpt-oss's expert biases in the compute dtype,
and train under the default stack (LoRA on the attention linears and the 4-bit experts) with a falling
loss; Mixtral's run measures within a tenth of its plan."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMOKE, compose_cfg, train_smoke
from helpers_families import build_family
from helpers_models import build_moe

from qlora_recipes.model import loading, moe_experts


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {family: build_moe(family, root / family) for family in ("qwen3_moe", "gpt_oss")}


def _experts(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts4bit")]


def _weights_16bit(model) -> int:
    return sum(
        len(moe_experts.expert_weights(m))
        for m in model.modules()
        if all(p.device.type != "meta" for p in m.parameters(recurse=False))
    )


def test_experts_are_quantized_one_at_a_time_while_loading(models, tmp_path, monkeypatch):
    """Each expert weight is quantized right after transformers sets it: at no point while loading do
    two of them exist in 16 bits. Routers stay in the compute dtype; the logits move a little."""
    import transformers.core_model_loading as core

    most = []
    setter = core.set_param_for_module

    def counting(model, *args, **kwargs):  # the function quantized_while_loading wraps
        setter(model, *args, **kwargs)
        most.append(_weights_16bit(model))

    monkeypatch.setattr(core, "set_param_for_module", counting)
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={models['qwen3_moe']}")
    model = loading.load_model(cfg, tmp_path)
    assert most and max(most) == 1  # the one just set, quantized before the next arrives
    assert core.set_param_for_module is counting  # restored after loading
    experts = _experts(model)
    assert len(experts) == 2 and all(moe_experts.is_4bit(p) for m in experts for p in m.parameters())
    dtype = getattr(torch, cfg.quant.compute_dtype)
    routers = [m.weight for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    assert len(routers) == 2 and all(w.dtype == dtype for w in routers)

    full = loading.load_model(
        compose_cfg(*SMOKE, f"model.name_or_path={models['qwen3_moe']}", "quant.experts=16bit"), tmp_path
    )
    assert not _experts(full) and _weights_16bit(full) == 4
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        gap = (model(input_ids=ids).logits - full(input_ids=ids).logits).abs().max().item()
    assert 0 < gap < 0.05, gap


@pytest.fixture
def trained_model(monkeypatch) -> list:
    """The model each run trained (make_trainable's result), kept for the test to look into."""
    seen = []
    make = loading.make_trainable
    monkeypatch.setattr(loading, "make_trainable", lambda cfg, model: seen.append(make(cfg, model)) or seen[-1])
    return seen


def test_qwen3_moe_trains_with_4bit_experts_and_its_loss_falls(models, tmp_path, trained_model):
    out, run_dir = train_smoke(tmp_path / "run", f"model.name_or_path={models['qwen3_moe']}", "trainer.max_steps=12")
    losses = out["train_losses"]
    assert out["status"] == "ok" and len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    experts = _experts(trained_model[0])
    assert len(experts) == 2 and all(
        moe_experts.is_4bit(p) and not p.requires_grad for m in experts for p in m.parameters()
    )
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]  # peft.experts=lora


def test_gpt_oss_trains_with_4bit_expert_weights_and_its_biases_as_they_were(models, tmp_path, trained_model):
    out, _ = train_smoke(tmp_path / "run", f"model.name_or_path={models['gpt_oss']}")
    assert out["status"] == "ok" and all(math.isfinite(x) for x in out["train_losses"])
    experts = _experts(trained_model[0])
    assert len(experts) == 2
    for module in experts:
        assert moe_experts.is_4bit(module.gate_up_proj) and moe_experts.is_4bit(module.down_proj)
        assert module.gate_up_proj_bias.is_floating_point() and module.down_proj_bias.dim() == 2


@pytest.mark.slow  # ~60 s on 2 cores: a load here, then a run in a process of its own
def test_mixtral_loads_its_experts_in_4bit_trains_and_measures_within_a_tenth_of_its_plan(tmp_path):
    """Mixtral is planned from its figures (Mistral's layer, fused 3-D experts behind a softmax top-k
    router), loads with both layers' experts in NF4 and its routers in the compute dtype, and trains
    under trainer=smoke in a process of its own (an earlier test's heap would set the RSS high-water
    mark) within [0.9, 1.1] of the planned peak."""
    from qlora_recipes.families import traits

    folder = build_family("mixtral", tmp_path / "mixtral")
    assert traits("mixtral").known and traits("mixtral").moe
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={folder}")
    model = loading.load_model(cfg, tmp_path)
    experts = _experts(model)
    assert len(experts) == 2 and all(moe_experts.is_4bit(p) for m in experts for p in m.parameters())
    routers = [m.weight for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"]
    assert len(routers) == 2 and all(w.dtype == getattr(torch, cfg.quant.compute_dtype) for w in routers)
    del model, experts, routers
    run = tmp_path / "run"
    args = [*SMOKE, f"model.name_or_path={folder}", "quant=nf4", "optim=paged8bit", f"hydra.run.dir={run}"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["status"] == "ok" and all(math.isfinite(x) for x in saved["train_losses"])
    assert 0.9 <= saved["plan_ratio"] <= 1.1, saved
