"""Per-family traits live in one table (qlora_recipes/families.py) that the planner and the loader both ask:
every family conf/model knows has an entry, and a trait set there (Gemma 2's soft-capping, its eager
attention, its extra norms, its tied-embeddings default) reaches the planner's sizes and the loader's
attention choice through that one lookup, not through a string compared here and there."""

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, compose_cfg

from qlora_recipes import families
from qlora_recipes.config.schema import ModelConfig
from qlora_recipes.families import FAMILIES, KNOWN_ARCHITECTURES, UNKNOWN, traits
from qlora_recipes.planner import components, loss
from qlora_recipes.planner.figures import inventory, model_figures
from qlora_recipes.planner.spec import spec_from_cfg

CONF_FAMILIES = {yaml.safe_load(p.read_text())["architecture"] for p in (REPO / "conf" / "model").glob("*.yaml")}


def test_every_family_of_conf_model_has_traits():
    assert CONF_FAMILIES <= set(FAMILIES), "add the new family to qlora_recipes/families.py FAMILIES"
    assert traits("Gemma2") is FAMILIES["gemma2"]  # config.json's model_type, any case


def test_a_family_not_in_the_table_assumes_nothing():
    unknown = traits("gpt_neox")
    assert unknown is UNKNOWN and not unknown.known
    assert unknown.attention == "sdpa" and not unknown.final_logit_softcap and not unknown.sandwich_norms


def test_the_table_imports_nothing_heavy():
    code = "import sys, qlora_recipes.families; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def _stack(*overrides: str):
    return spec_from_cfg(compose_cfg("trainer.seq_len=512", "trainer.micro_batch_size=1", *overrides), 1)


def test_gemma2_soft_capping_reaches_the_planner():
    gemma, llama = _stack("model=gemma2-9b"), _stack("model=llama3.1-8b")
    assert components.eager(gemma) and not components.eager(llama)
    assert loss._head(gemma, 1, on_cpu=True).softcap and not loss._head(llama, 1, on_cpu=True).softcap
    names = {p for block in inventory(gemma.fig) for p, _ in block.params}
    assert "model.layers.0.pre_feedforward_layernorm.weight" in names
    assert any(b[0].endswith("embed_scale") for block in inventory(gemma.fig) for b in block.buffers)


def test_the_planner_asks_the_table(monkeypatch):
    """Llama given Gemma 2's traits is sized as Gemma 2 is: eager attention with the soft-cap's tanh
    output, four norms per layer, the soft-capped loss fold on CPU. In fp32: with 16-bit compute the
    backward's fp32 copy of the 8B's lm_head chunk outgrows the fold at 512 positions (loss.py's
    _cpu_tile_bytes), so there the cap's temporaries do not move the loss's peak."""
    plain = _stack("model=llama3.1-8b", "precision=fp32")
    layer = next(bb for block, bb in components.block_bytes(plain) if block.is_layer)
    before = components.layer_saved_bytes(plain, layer, 1, on_cpu=True), loss.train_loss_bytes(plain, 1, on_cpu=True)
    capped = dataclasses.replace(FAMILIES["gemma2"], tie_embeddings=False)
    monkeypatch.setitem(families.FAMILIES, "llama", capped)
    assert components.eager(plain) and loss._head(plain, 1, on_cpu=True).softcap
    after = components.layer_saved_bytes(plain, layer, 1, on_cpu=True), loss.train_loss_bytes(plain, 1, on_cpu=True)
    assert after[0] > before[0] and after[1] > before[1]


def test_tied_embeddings_default_of_a_config_json_comes_from_the_table(tmp_path):
    for arch, tied in [("gemma2", True), ("llama", False), ("qwen2", False), ("gpt_neox", True)]:
        folder = tmp_path / arch
        folder.mkdir()
        figures = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
        (folder / "config.json").write_text(json.dumps({"model_type": arch, "vocab_size": 100, **figures}))
        fig = model_figures(ModelConfig(name_or_path=str(folder), architecture=arch))
        assert fig.tie_embeddings is tied, arch


def test_the_loader_asks_the_table(monkeypatch, caplog):
    """The shipped tiny Llama loads with sdpa; told by the table that Llama needs eager, the loader
    picks eager for it: Gemma 2 dirs get eager through this same lookup."""
    from qlora_recipes.model import loading

    cfg = compose_cfg()
    assert loading.attention_for(cfg.model) == "sdpa"
    monkeypatch.setitem(families.FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], attention="eager"))
    with caplog.at_level("INFO", logger="qlora_recipes.model.loading"):
        assert loading.attention_for(cfg.model) == "eager"
    assert "attention: eager for LlamaForCausalLM" in caplog.text
    assert loading.attention_for(compose_cfg("model.attn_implementation=flex_attention").model) == "flex_attention"


@pytest.mark.parametrize("arch", sorted(KNOWN_ARCHITECTURES))
def test_analytic_families_build_from_a_typed_model_config(arch):
    fig = model_figures(
        ModelConfig(
            name_or_path="org/none",
            hub_id="org/none",  # the figures below are that model's (no config.json offline)
            architecture=arch,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=100,
            figures={"num_experts": 4, "num_experts_per_tok": 2} if FAMILIES[arch].moe else None,
        )
    )
    assert fig.traits is FAMILIES[arch] and fig.qkv_bias is (arch == "qwen2")
