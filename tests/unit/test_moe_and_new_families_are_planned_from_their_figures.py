"""The families people fine-tune now (Qwen3, Qwen3-MoE, gpt-oss, Gemma 3, SmolLM3) are planned from their
figures alone: each block as transformers builds it (q/k norms, sinks, routers, fused 3-D experts),
the experts stored NF4 under quant.experts=4bit and 16-bit otherwise, and the real shapes of conf/model
planned without a meta model: gpt-oss-20b fits a 16 GB card, Qwen3-30B-A3B a 24 GB one."""

import pytest
from conftest import compose_cfg
from helpers_families import build_family

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.families import traits
from qlora_recipes.planner import figures

GiB = 2**30
FAMILIES = ("qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "smollm3")


def _summary(blocks):
    return {
        b.name: (
            sorted((lin.name, lin.in_features, lin.out_features, lin.bias) for lin in b.linears),
            sorted((name, n) for name, n in b.params if not name.endswith("_proj.bias")),
            sorted(b.experts),
            sorted(b.buffers),
            b.tied_to,
        )
        for b in blocks
    }


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_known_familys_figure_inventory_is_the_module_tree_transformers_builds(tmp_path, model_type):
    folder = build_family(model_type, tmp_path / model_type)
    fig = figures.model_figures(compose_cfg(f"model.name_or_path={folder}").model)
    assert traits(model_type).known
    assert _summary(figures._analytic_inventory(fig)) == _summary(figures._meta_inventory(fig))


@pytest.fixture
def no_meta_model(monkeypatch):
    """A plan that reaches for the meta model fails: the known families are inventoried from figures."""

    def refuse(*_):
        raise AssertionError("planned from a meta model")

    monkeypatch.setattr(figures, "_meta_inventory", refuse)
    monkeypatch.setattr(figures, "meta_model", refuse)


def _plan(*overrides, gpus):
    cfg = compose_cfg("precision=bf16", *overrides)
    return planner.plan(cfg, gpus=devices.parse_gpus(gpus), host_ram=32 * GiB, world_size=1, ladder=False)


def test_gpt_oss_20b_fits_16gb_and_qwen3_30b_a3b_fits_24gb_from_their_figures(no_meta_model):
    oss = _plan("recipe=gpt-oss-20b-16gb", "trainer.seq_len=2048", gpus="16GB")
    qwen = _plan("model=qwen3-30b-a3b", "trainer=standard", "trainer.seq_len=2048", gpus="24GB")
    assert oss["fits"] and qwen["fits"]
    assert oss["peak_allocated_gib"] < 12.8 / 1.024**3 * 1.05  # unsloth's 12.8 GB, within 5 %
    # every expert weight is 4-bit: the quantized params are the experts plus the attention linears
    assert oss["counts"]["params_quantized"] > 0.95 * (oss["counts"]["params_total"] - 2 * 201088 * 2880)


def test_experts_are_nf4_under_quant_experts_4bit_and_16bit_otherwise(no_meta_model):
    four = _plan("model=qwen3-30b-a3b", "trainer=standard", gpus="80GB")
    sixteen = _plan("model=qwen3-30b-a3b", "trainer=standard", "quant.experts=16bit", gpus="80GB")
    experts = 48 * 128 * 3 * 768 * 2048  # layers x experts x (gate, up, down) x I x H
    extra = sixteen["counts"]["params_total"] - sixteen["counts"]["params_quantized"]
    assert extra - (four["counts"]["params_total"] - four["counts"]["params_quantized"]) == experts
    assert four["counts"]["quantized_bytes_per_param"] == pytest.approx(0.5159, abs=2e-4)
    # 16-bit experts are frozen params that k-bit prep upcasts: 4 B each beside the 4-bit ones' ~0.516
    grew = sum(sixteen["components"]["other_params"].values()) - sum(four["components"]["other_params"].values())
    assert grew == 4 * experts
    # the dequant scratch: one layer's whole gate_up_proj in bf16
    assert four["components"]["dequant_scratch"]["cuda:0"] == 128 * 2 * 768 * 2048 * 2


def test_an_moe_entry_without_its_expert_figures_is_one_line():
    from qlora_recipes.errors import UserError

    with pytest.raises(UserError, match=r"model.figures.*num_experts"):
        _plan("model=qwen3-30b-a3b", "model.figures=null", gpus="24GB")
