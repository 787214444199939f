"""trainer.tiled_mlp: the MLP over tiles of tokens gives the untiled MLP's output and gradients (inputs
and LoRA parameters) within fp32 tolerance, on the tiny model with NF4 + LoRA and gradient
checkpointing; LoRA dropout's masks are replayed in the recompute; the plan's MLP terms shrink to one
tile; and the combinations it is not tested with are refused in one line."""

import pytest
import torch
from conftest import compose_cfg

from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.model import loading
from qlora_recipes.model.tiled_mlp import TiledMLPFunction, tile_mlp, tile_mlps

LEAN = ("quant=nf4", "peft.r=8", "precision=fp32")


def _model(tmp_path, *overrides):
    cfg = compose_cfg("trainer=smoke", "trainer.seq_len=64", *LEAN, *overrides)
    torch.manual_seed(0)
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    with torch.no_grad():  # LoRA B starts at zero: give the adapters a gradient through A too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return cfg, model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), embeds.grad.clone(), grads


@pytest.mark.parametrize("checkpointing", ["non_reentrant", "reentrant", "off"])
def test_tiled_mlp_on_nf4_lora_gives_the_same_loss_and_gradients(tmp_path, checkpointing):
    on = f"trainer.gradient_checkpointing={checkpointing != 'off'}"
    mode = f"trainer.checkpointing_mode={checkpointing if checkpointing != 'off' else 'non_reentrant'}"
    _, model = _model(tmp_path, "peft.dropout=0", on, mode)
    model.train()
    ids = torch.randint(4, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, gx, grads = _loss_and_grads(model, ids)
    assert tile_mlps(model, 24) == 2  # 128 tokens in 6 tiles, the last one shorter
    tiled_loss, tiled_gx, tiled_grads = _loss_and_grads(model, ids)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert _relative_error(tiled_gx, gx) < 1e-5
    assert grads.keys() == tiled_grads.keys() and any(".mlp." in n for n in grads)
    for name in grads:
        assert _relative_error(tiled_grads[name], grads[name]) < 1e-5, name


def _relative_error(a, b) -> float:
    """The largest difference against the tensor's scale: fp32 sums in another order."""
    return float((a - b).abs().max() / b.abs().max())


def test_the_option_tiles_every_decoder_mlp_at_auto_tile(tmp_path):
    cfg, model = _model(tmp_path, "trainer.tiled_mlp=true")
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    assert mlps and all(m._tiled_mlp_tile == 128 for m in mlps)  # hidden_size tokens
    assert cfg.trainer.tiled_mlp_tile == 0


def _lora_mlp(dropout: float):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=80, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.train()
    return model, model.base_model.model.model.layers[0].mlp


def _grads(mlp, run):
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(3))
    mlp.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the dropout masks
    out = run(x)
    out.backward(g)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in mlp.named_parameters() if p.requires_grad}


def test_lora_dropout_masks_are_the_forwards_in_the_recompute():
    """With dropout the tiles draw other masks than one untiled forward; the gradient must be that
    of the masks the tiled forward drew: the same as running the tiles one by one with grad."""
    _, mlp = _lora_mlp(dropout=0.3)
    plain = mlp.forward
    by_hand = _grads(mlp, lambda x: torch.cat([plain(t) for t in x.reshape(1, -1, 32).split(10, 1)], 1).view(2, 37, -1))
    params = [p for p in mlp.parameters() if p.requires_grad]
    tiled = _grads(mlp, lambda x: TiledMLPFunction.apply(plain, 10, x, *params))
    for a, b in zip(tiled[:2], by_hand[:2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in by_hand[2]:
        torch.testing.assert_close(tiled[2][name], by_hand[2][name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_autocast_is_replayed_in_the_recompute():
    _, mlp = _lora_mlp(dropout=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        untiled = _grads(mlp, mlp.forward)
        tile_mlp(mlp, 8)
        tiled = _grads(mlp, mlp.forward)
    assert tiled[0].dtype == untiled[0].dtype == torch.bfloat16
    torch.testing.assert_close(tiled[0], untiled[0])
    # bf16 products summed per tile, then in fp32: bf16's 8 bits of mantissa, not fp32's
    assert _relative_error(tiled[1], untiled[1]) < 2e-2
    for name in untiled[2]:
        assert _relative_error(tiled[2][name], untiled[2][name]) < 2e-2, name
    seen = []
    mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _grads(mlp, mlp.forward)
    assert (
        set(seen) == {torch.bfloat16} and len(seen) == 2 * 10
    )  # forward and recompute of 10 tiles (74 tokens), in bf16


@pytest.mark.parametrize(
    "overrides,words",
    [
        (("dist=ddp",), "dist=ddp"),
        (("trainer.liger=true",), "trainer.liger=true"),
    ],
)
def test_tiled_mlp_refuses_what_it_is_not_tested_with(overrides, words):
    cfg = compose_cfg("trainer.tiled_mlp=true", *overrides)
    with pytest.raises(UserError, match="trainer.tiled_mlp") as err:
        check_stack(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("adapters", ["float32", "bfloat16"])
@pytest.mark.parametrize("tiled", [False, True])
def test_the_plan_keeps_what_autograd_keeps_for_a_tiled_layer(tmp_path, tiled, adapters):
    """One decoder layer's saved tensors (NF4 + LoRA with dropout, bf16 autocast, no checkpointing) against
    layer_saved_bytes, with fp32 adapters and with bf16 ones (auto's choice under bf16 compute): tiled,
    the MLP keeps only its input, whatever the intermediate size."""
    import weakref

    from qlora_recipes.planner import components
    from qlora_recipes.planner.spec import spec_from_cfg

    b, s = 2, 64
    overrides = ("precision=bf16", f"peft.adapter_dtype={adapters}", "trainer.gradient_checkpointing=false")
    overrides += (f"trainer.micro_batch_size={b}",)
    overrides += ("trainer.tiled_mlp=true", "trainer.tiled_mlp_tile=32") if tiled else ()
    cfg, model = _model(tmp_path, *overrides)
    st = spec_from_cfg(cfg, world_size=1)
    st = type(st)(**{**st.__dict__, "seq_len": s})
    layer_bytes = next(bb for blk, bb in components.block_bytes(st) if blk.name == "model.layers.1")
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, kept = [False], []

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params:
            kept.append((weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    layer = model.base_model.model.model.layers[1]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(4, 100, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    measured = sum({ptr: n for ref, ptr, n in kept if ref() is not None}.values())
    planned = components.layer_saved_bytes(st, layer_bytes, b, on_cpu=True)
    print(f"tiled={tiled}: autograd keeps {measured} B, planned {planned} B")
    assert abs(measured - planned) / measured < 0.08
    del out


def test_the_plan_of_a_tiled_mlp_shrinks_at_long_sequences_only():
    """8B at 32k tokens: the layer working set and the eval transient shrink; a micro-batch of at most
    one tile (hidden_size tokens) runs untiled and plans the same."""
    from qlora_recipes import planner

    def plan(*overrides):
        cfg = compose_cfg(
            "recipe=llama3.1-8b-24gb", "trainer.micro_batch_size=1", "trainer.eval_batch_size=1", *overrides
        )
        return planner.plan(cfg, gpus=[24 * 2**30], host_ram=128 * 2**30, world_size=1, ladder=False)["components"]

    def gib(components, name):
        return components[name]["cuda:0"] / 2**30

    plain, tiled = plan("trainer.seq_len=32768"), plan("trainer.seq_len=32768", "trainer.tiled_mlp=true")
    assert gib(tiled, "layer_working") < 0.7 * gib(plain, "layer_working")
    assert gib(tiled, "eval_transient") < gib(plain, "eval_transient")
    assert plan("trainer.seq_len=4096") == plan("trainer.seq_len=4096", "trainer.tiled_mlp=true")
