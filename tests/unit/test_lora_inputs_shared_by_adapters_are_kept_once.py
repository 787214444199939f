"""q, k and v read one normed hidden state, gate and up another: without LoRA dropout (peft's nn.Identity)
their adapters keep that tensor once, unless a cast to the adapters' or the compute dtype copies it per
adapter; with dropout each keeps its own dropped copy and mask. What autograd keeps for one decoder layer
of the tiny Llama (NF4, LoRA on every linear), with checkpointing off (the forward's saved tensors) and on
(the recompute's), against layer_saved_bytes."""

import weakref

import pytest
import torch
import torch.utils.checkpoint as ckpt
from conftest import compose_cfg

from qlora_recipes.model import loading
from qlora_recipes.planner import components, lora_inputs
from qlora_recipes.planner.spec import spec_from_cfg

B, S = 2, 64


def _kept(tmp_path, monkeypatch, *overrides) -> tuple[int, int]:
    """(bytes autograd keeps for layer 1, bytes layer_saved_bytes plans for it) on this CPU."""
    cfg = compose_cfg("trainer=smoke", f"trainer.seq_len={S}", f"trainer.micro_batch_size={B}", "quant=nf4", *overrides)
    torch.manual_seed(0)
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    model.train()
    st = spec_from_cfg(cfg, world_size=1)
    layer_bytes = next(bb for blk, bb in components.block_bytes(st) if blk.name == "model.layers.1")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, kept = [-1], []

    def record(t):
        if current[0] == 1 and t.untyped_storage().data_ptr() not in params:
            kept.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))

    # layer 0's input needs no grad: not typical. A layer's own hooks run outside its checkpoint, its first
    # norm's in the recompute too.
    for i, layer in enumerate(model.base_model.model.model.layers):
        layer.input_layernorm.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, -1))
    monkeypatch.setattr(ckpt, "_recomputation_hook", _spying(record))  # the recompute's saved tensors
    ids = torch.randint(4, 100, (B, S), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision.name == "bf16")
    with autocast, torch.autograd.graph.saved_tensors_hooks(lambda t: record(t) or t, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    if st.checkpointing:  # the recompute holds the layer's saved tensors at once before backward uses them
        kept.clear()
        with autocast:
            loss.backward()
        measured = sum({ptr: n for _, ptr, n in kept}.values())
    else:
        measured = sum({ptr: n for ref, ptr, n in kept if ref() is not None}.values())
    return measured, components.layer_saved_bytes(st, layer_bytes, B, on_cpu=True)


def _spying(record):
    """torch.utils.checkpoint's recompute hook, each tensor it stores for backward also recorded."""

    class Spy(ckpt._recomputation_hook):
        def __init__(self, *args):
            super().__init__(*args)
            pack = self.pack_hook
            self.pack_hook = lambda t: record(t) or pack(t)

    return Spy


@pytest.mark.parametrize("checkpointing", ["false", "true"])
@pytest.mark.parametrize(
    "precision,upcast,adapters",
    [
        ("bf16", "true", "float32"),  # every cast copies: nothing shared
        ("bf16", "true", "bfloat16"),  # fp32 residual cast per adapter; o_proj reads SDPA's bf16 output
        ("bf16", "false", "bfloat16"),  # bf16 end to end: q/k/v, gate/up, o_proj with SDPA share
        ("bf16", "false", "float32"),  # a bf16 residual cast to fp32 adapters per adapter
        ("fp32", "true", "float32"),  # no autocast, no cast: shared
    ],
)
def test_a_layer_keeps_the_lora_inputs_the_plan_counts(
    tmp_path, monkeypatch, precision, upcast, adapters, checkpointing
):
    stack = (f"precision={precision}", f"precision.upcast_frozen={upcast}", f"peft.adapter_dtype={adapters}")
    stack += (f"trainer.gradient_checkpointing={checkpointing}",)
    off = _kept(tmp_path / "off", monkeypatch, *stack, "peft.dropout=0")
    on = _kept(tmp_path / "on", monkeypatch, *stack, "peft.dropout=0.05")
    print(f"{stack}: dropout 0 keeps {off[0]} B, plans {off[1]}; dropout 0.05 keeps {on[0]} B, plans {on[1]}")
    for measured, planned in (off, on):
        assert planned == pytest.approx(measured, rel=0.025)
    # the LoRA inputs are exact: what the plan leaves over is the same with and without dropout
    assert off[1] - off[0] == on[1] - on[0]


def test_sixteen_bit_hidden_states_without_dropout_keep_one_input_for_q_k_and_v():
    """The GPU's side (bitsandbytes linears under CUDA autocast, no peft cast): Llama-3.1-8B's q/k/v and
    gate/up keep their 16-bit input once and o_proj adds nothing to SDPA's output; fp32 hidden states
    are cast per adapter, and dropout gives each adapter its own copy and bool mask."""
    h, f, qd = 4096, 14336, 4096

    def per_token(*overrides):
        st = spec_from_cfg(compose_cfg("model=llama3.1-8b", "trainer.seq_len=2048", *overrides), world_size=1)
        bb = next(bb for blk, bb in components.block_bytes(st) if blk.is_layer)
        attention = lora_inputs.kept_per_token(st, bb.lora_reads, 1, False, False, output_kept=True)
        return attention, lora_inputs.kept_per_token(st, bb.lora_reads, 1, False, True)

    lean = ("precision=bf16", "precision.upcast_frozen=false", "peft.target_modules=all-linear")
    assert per_token(*lean, "peft.dropout=0") == (2 * h, 2 * h + 2 * f)
    assert per_token(*lean, "peft.dropout=0.05") == (3 * (3 * h + qd), 3 * (2 * h + f))
    assert per_token("precision=bf16", "peft.dropout=0", "peft.target_modules=all-linear") == (
        2 * 3 * h,
        2 * (2 * h + f),
    )
