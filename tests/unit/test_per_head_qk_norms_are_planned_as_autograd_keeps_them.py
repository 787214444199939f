"""Qwen3's per-head q/k RMSNorms keep their input (an fp32 copy; under trainer.lean_rmsnorm the
projection's output as it is) and an rsqrt per head for backward: what a Qwen3 decoder layer keeps beyond
a Llama layer of the same shapes, measured on CPU as the tensors autograd saves (NF4 base, LoRA with
dropout, bf16 autocast), is what the planner adds for them (1,560 bytes a token at q 4x64, kv 2x64); and
Qwen3-MoE's, Gemma 3's and Gemma 4's norms keep what it counts for each layer."""

import warnings
import weakref

import pytest
import torch
from conftest import compose_cfg

from qlora_recipes.planner import components
from qlora_recipes.planner.spec import spec_from_cfg

SHAPES = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
B, S = 2, 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qk-norms")
    for kind in ("llama", "qwen3"):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **SHAPES)).save_pretrained(root / kind)
    return root


def _planned(folder, quant: str, lean: bool) -> int:
    overrides = (f"model.name_or_path={folder}", f"quant={quant}", "peft=lora", "peft.r=16", "peft.dropout=0.05")
    overrides += (f"trainer.micro_batch_size={B}", f"trainer.seq_len={S}", f"trainer.lean_rmsnorm={lean}")
    st = spec_from_cfg(compose_cfg("precision=bf16", "peft.adapter_dtype=float32", *overrides), world_size=1)
    bb = next(bb for blk, bb in components.block_bytes(st) if blk.name == "model.layers.1")
    return components.layer_saved_bytes(st, bb, B, on_cpu=True)


def _model(folder, quant: str, lean: bool):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from qlora_recipes.model.lean_rmsnorm import lean_rmsnorms

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if quant == "nf4":
            bnb = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
            model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, dtype=torch.bfloat16)
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        if lean:
            lean_rmsnorms(model)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
        return get_peft_model(model, lora).train()


def _kept_by_layer_1(model) -> int:
    """Bytes of the tensors autograd keeps alive from the second decoder layer's forward, parameters aside."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _kept_inside(model, [model.base_model.model.model.layers[1]], vocab=1000, first_id=4)


@pytest.mark.parametrize("quant,lean", [("nf4", False), ("none", True)])
def test_qwen3s_qk_norms_keep_what_the_planner_adds_for_them(models, quant, lean):
    measured = {kind: _kept_by_layer_1(_model(models / kind, quant, lean)) for kind in ("llama", "qwen3")}
    planned = {kind: _planned(models / kind, quant, lean) for kind in ("llama", "qwen3")}
    norms = measured["qwen3"] - measured["llama"]
    # fp32 inputs of q (4x64) and k (2x64) and an rsqrt per head; lean: the 16-bit projections' outputs
    assert norms == B * S * ((2 if lean else 4) * 6 * 64 + 4 * 6)
    assert planned["qwen3"] - planned["llama"] == norms
    assert planned["qwen3"] == pytest.approx(measured["qwen3"], rel=0.03)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma3_text", "gemma4_text"])
def test_each_familys_head_norms_keep_what_the_planner_counts(tmp_path, model_type):
    """What autograd saves inside each layer's q/k norms (Gemma 4's weightless v_norm too: its pow-based
    norm keeps the mean square and its power, 8 bytes a head) on a tiny fp32 model; Gemma 3's (1 + weight)
    adds a head_dim-wide fp32 tensor per norm and layer, whatever the tokens."""
    from helpers_families import build_family
    from transformers import AutoModelForCausalLM

    folder = build_family(model_type, tmp_path / model_type)
    overrides = ("quant=none", "precision=fp32", f"trainer.micro_batch_size={B}", f"trainer.seq_len={S}")
    st = spec_from_cfg(compose_cfg(f"model.name_or_path={folder}", *overrides), world_size=1)
    planned = {blk.name: bb.head_norms * B * S for blk, bb in components.block_bytes(st) if blk.is_layer}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()
    model.requires_grad_(False)
    model.get_input_embeddings().weight.requires_grad_(True)
    for i, layer in enumerate(model.model.layers):
        norms = [m for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] in ("q_norm", "k_norm", "v_norm")]
        measured = _kept_inside(model, norms)
        assert planned[f"model.layers.{i}"] <= measured <= planned[f"model.layers.{i}"] + 4 * st.fig.head_dim * 2


def _kept_inside(model, modules, vocab: int = 100, first_id: int = 3) -> int:
    """Bytes of the tensors autograd keeps from inside `modules`' forwards, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, kept = [False], []

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params:
            kept.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    hooks = [m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)) for m in modules]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__(0, False)) for m in modules]
    ids = torch.randint(first_id, vocab, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    measured = sum({ptr: n for ref, ptr, n in kept if ref() is not None}.values())
    for hook in hooks:
        hook.remove()
    del out
    return measured
