"""trainer.tiled_mlp on an MoE model (model/tiled_moe.py): the smoke run of the tiny gpt-oss (4-bit experts
with expert LoRA, its (hidden, router_scores) block output, TRL's load-balancing loss on) over 16-token
tiles runs the tiled Function in each checkpointed layer's forward and backward, and its loss falls."""

import math

import pytest
from helpers_families import build_family

from qlora_recipes.model.tiled_moe import TiledMoEFunction


@pytest.mark.slow
def test_gpt_oss_trains_with_its_moe_blocks_tiled(monkeypatch, smoke_run, tmp_path):
    calls = {"forward": 0, "backward": 0}
    forward, backward = TiledMoEFunction.forward, TiledMoEFunction.backward

    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)

        return staticmethod(wrapper)

    monkeypatch.setattr(TiledMoEFunction, "forward", counted("forward", forward))
    monkeypatch.setattr(TiledMoEFunction, "backward", counted("backward", backward))
    base = build_family("gpt_oss", tmp_path / "gpt_oss")
    steps = 12
    m, run = smoke_run(
        f"model.name_or_path={base}",
        "trainer.tiled_mlp=true",
        "trainer.tiled_mlp_tile=16",
        f"trainer.max_steps={steps}",
    )
    losses = m["train_losses"]
    assert m["status"] == "ok" and len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    layers = 2  # the tiny model's; checkpointing recomputes each forward once in backward
    assert calls["backward"] == steps * layers and calls["forward"] == 2 * calls["backward"]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
