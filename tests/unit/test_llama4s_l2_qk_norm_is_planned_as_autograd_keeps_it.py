"""Llama 4's text layers put q and k through a weightless L2 norm (Llama4TextL2Norm, use_qk_norm) on
their RoPE layers only: it keeps the fp32 input its `.float()` makes and an rsqrt per head for backward,
what the planner counts for those layers (and nothing for a NoPE layer, or with use_qk_norm off),
measured on CPU as the tensors autograd saves inside the norm."""

import json
import weakref

import pytest
import torch
from conftest import compose_cfg

from qlora_recipes.planner import components
from qlora_recipes.planner.spec import spec_from_cfg

B, S = 2, 32
# layer 0 rotates (and L2-norms q and k), layer 1 is a NoPE layer
SHAPES = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=64,
    intermediate_size_mlp=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    attention_chunk_size=8,
    max_position_embeddings=256,
    no_rope_layers=[1, 0],
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    out = tmp_path_factory.mktemp("llama4") / "llama4_text"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Llama4TextConfig(**SHAPES)).save_pretrained(str(out))
    return out


def _planned(folder, precision: str) -> dict[str, int]:
    overrides = ("quant=none", f"precision={precision}", f"trainer.micro_batch_size={B}", f"trainer.seq_len={S}")
    st = spec_from_cfg(compose_cfg(f"model.name_or_path={folder}", *overrides), world_size=1)
    return {blk.name: bb.head_norms * B * S for blk, bb in components.block_bytes(st) if blk.is_layer}


def _measured(folder, dtype: torch.dtype) -> dict[str, int]:
    """Bytes autograd keeps from inside each layer's L2 norm (called for q, then for k), parameters aside."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).train()
    model.requires_grad_(False)
    model.get_input_embeddings().weight.requires_grad_(True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, kept = [None], {}

    def pack(t):
        if inside[0] is not None and t.untyped_storage().data_ptr() not in params:
            kept.setdefault(inside[0], []).append((weakref.ref(t), t.untyped_storage()))
        return t

    hooks = []
    for i, layer in enumerate(model.model.layers):
        norm = getattr(layer.self_attn, "qk_norm", None)
        if norm is not None:
            hooks.append(norm.register_forward_pre_hook(lambda *_, i=i: inside.__setitem__(0, f"model.layers.{i}")))
            hooks.append(norm.register_forward_hook(lambda *_: inside.__setitem__(0, None)))
    ids = torch.randint(3, 100, (B, S), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    measured = {f"model.layers.{i}": 0 for i in range(len(model.model.layers))}
    for name, saved in kept.items():
        alive = {s.data_ptr(): s.nbytes() for ref, s in saved if ref() is not None}
        measured[name] = sum(alive.values())
    for hook in hooks:
        hook.remove()
    del out
    return measured


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_rope_layers_l2_norm_keeps_what_the_planner_counts(folder, precision, dtype):
    measured, planned = _measured(folder, dtype), _planned(folder, precision)
    # q (4 heads) and k (2 heads) of 16 dims as fp32, an fp32 rsqrt per head, per token
    assert measured["model.layers.0"] == B * S * 6 * (4 * 16 + 4)
    assert planned == measured
    assert planned["model.layers.1"] == 0  # the NoPE layer has no norm


def test_use_qk_norm_off_plans_no_l2_norm(folder, tmp_path):
    off = tmp_path / "off"
    off.mkdir()
    for f in folder.iterdir():
        (off / f.name).write_bytes(f.read_bytes())
    cj = json.loads((off / "config.json").read_text())
    (off / "config.json").write_text(json.dumps({**cj, "use_qk_norm": False}))
    on = _planned(folder, "fp32")
    assert on["model.layers.0"] > 0 and set(_planned(off, "fp32").values()) == {0}
