"""The families people fine-tune now (Qwen3, Qwen3-MoE, gpt-oss, Gemma 3, SmolLM3) are planned from their
figures alone: each block as transformers builds it (q/k norms, sinks, routers, fused 3-D experts),
the experts stored NF4 under quant.experts=4bit and 16-bit otherwise, and the real shapes of conf/model
planned without a meta model: gpt-oss-20b fits a 16 GB card, Qwen3-30B-A3B a 24 GB one."""

import subprocess
import sys

import pytest
from conftest import compose_cfg
from helpers_families import build_family

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.families import traits
from qlora_recipes.planner import figures

GiB = 2**30
FAMILIES = ("qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "smollm3", "qwen3_5_text", "qwen3_5_moe_text")
FAMILIES += ("gemma4_text", "llama4_text", "mixtral")


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
    # the recipe trains the experts too (as unsloth does): their A/B on top of the linears' adapters
    linears_only = _plan("recipe=gpt-oss-20b-16gb", "trainer.seq_len=2048", "peft.experts=none", gpus="16GB")
    assert oss["counts"]["trainable_params"] > linears_only["counts"]["trainable_params"]
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


_VARIANTS = {
    # Gemma 4 as its larger checkpoints are built: global layers with their own head_dim and kv heads, keys
    # as values there, the last layers reusing earlier k/v with double-wide MLPs, an MoE block beside the MLP
    "gemma4_text": {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 50,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    },
    # Llama 4 as Maverick interleaves it: dense layers (intermediate_size_mlp) between the MoE ones
    "llama4_text": {
        "interleave_moe_layer_step": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 96,
    },
    # Qwen3.5 by its config class's defaults: every 4th layer full attention, its linear heads' defaults
    "qwen3_5_moe_text": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen3_5_text": {"full_attention_interval": 2},
}


@pytest.mark.parametrize("model_type", sorted(_VARIANTS))
def test_a_config_json_of_the_new_families_is_inventoried_as_transformers_builds_it(tmp_path, model_type):
    """A config.json as the hub serves it (keys left out take their config class's defaults): the figure
    inventory is the module tree transformers builds from it."""
    import json

    from helpers_families import COMMON

    cfg = {**COMMON, "num_hidden_layers": 4, "model_type": model_type, **_VARIANTS[model_type]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    fig = figures._figures_from_config_json(tmp_path, trust=False)
    assert _summary(figures._analytic_inventory(fig)) == _summary(figures._meta_inventory(fig))


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    """A tiny Qwen3.5 of two Gated DeltaNet layers and a gated full-attention one, wide enough that its
    activations are not all rounding."""
    import shutil

    import torch
    import transformers
    from helpers_families import COMMON, TINY, tiny_config

    out = tmp_path_factory.mktemp("qwen3_5")
    layers = {"layer_types": ["linear_attention", "linear_attention", "full_attention"], "num_hidden_layers": 3}
    cfg = tiny_config("qwen3_5_text").to_dict() | {**COMMON, **layers, "hidden_size": 128, "vocab_size": 1000}
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**cfg)).save_pretrained(str(out))
    for f in [*TINY.glob("tokenizer*"), TINY / "chat_template.jinja"]:
        shutil.copy(f, out)
    return out


@pytest.mark.parametrize("b,s", [(2, 128), (1, 100)])  # two whole chunks per row; one padded chunk
def test_gated_deltanet_and_gated_attention_keep_what_autograd_keeps_on_cpu(qwen3_5_dir, b, s):
    """What autograd keeps for a Gated DeltaNet layer (the torch chunked kernel, its conv, its gated norm)
    and for a full-attention layer with its output gate (NF4 base, LoRA with dropout, fp32 as this CPU
    computes), against layer_saved_bytes: the attention terms alone planned 0.57 of the DeltaNet's."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from qlora_recipes.planner import components
    from qlora_recipes.planner.spec import spec_from_cfg

    overrides = ("quant=nf4", "peft=lora", "peft.r=16", "peft.dropout=0.05", f"trainer.micro_batch_size={b}")
    cfg = compose_cfg("precision=fp32", f"model.name_or_path={qwen3_5_dir}", *overrides, f"trainer.seq_len={s}")
    st = spec_from_cfg(cfg, world_size=1)
    planned = {blk.name: bb for blk, bb in components.block_bytes(st)}
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_5_dir), quantization_config=bnb, dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    ids = torch.randint(4, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    for i, mixer in ((1, "linear_attention"), (2, "full_attention")):
        bb = planned[f"model.layers.{i}"]
        assert bb.mixer == mixer
        measured = _kept_by_layer(model, model.base_model.model.model.layers[i], ids)
        assert components.layer_saved_bytes(st, bb, b, on_cpu=True) == pytest.approx(measured, rel=0.08)


def _kept_by_layer(model, layer, ids) -> int:
    """Bytes of the tensors autograd keeps alive from `layer`'s forward (parameters aside)."""
    import weakref

    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, kept = [False], []

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params:
            kept.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    hooks = [layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))]
    hooks.append(layer.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    measured = sum({ptr: n for ref, ptr, n in kept if ref() is not None}.values())
    for hook in hooks:
        hook.remove()
    del out
    return measured


@pytest.mark.parametrize(
    "entry,published",
    [("qwen3.5-27b", 27e9), ("qwen3.5-35b-a3b", 35e9), ("gemma4-31b", 31e9), ("llama4-scout-17b-16e", 109e9)],
)
def test_the_new_families_entries_are_planned_from_their_figures(no_meta_model, entry, published):
    """Each new conf/model entry is planned without a meta model, to within 3 % of the parameters its name
    publishes (the vision towers of these multimodal checkpoints are the rest)."""
    plan = _plan(f"model={entry}", "trainer=standard", "trainer.seq_len=2048", gpus="80GB")
    assert plan["fits"] and plan["counts"]["params_total"] == pytest.approx(published, rel=0.03)
    fig = figures.model_figures(compose_cfg(f"model={entry}").model)
    mixers = [b.mixer for b in figures._analytic_inventory(fig) if b.is_layer]
    if traits(fig.architecture).linear_attention:  # 3 of 4 layers Gated DeltaNet
        assert mixers.count("linear_attention") == 3 * len(mixers) // 4


PLAN_IN_A_FRESH_PROCESS = """
import sys
from qlora_recipes.cli import main
sys.argv = ["qlora", "plan", sys.argv[1]]
try:
    main()
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("recipe", ["gpt-oss-20b-16gb", "qwen3-30b-a3b-24gb"])
def test_planning_an_moe_recipe_imports_no_torch(tmp_path, recipe):
    """`qlora plan` of a known MoE family stays analytic and light: no torch (whose import alone takes
    seconds), no meta model."""
    out = subprocess.run(
        [sys.executable, "-c", PLAN_IN_A_FRESH_PROCESS, f"recipe={recipe}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "FITS" in out.stdout, out.stdout + out.stderr
    assert out.stdout.strip().endswith("torch imported: False")
