"""trainer.tiled_mlp on MoE models (model/tiled_moe.py): each sparse MoE block (router, 4-bit routed experts
with LoRA on them through peft's target_parameters, shared experts) over tiles of tokens gives the untiled
model's loss with its load-balancing term, its router logits (one tensor per layer, as untiled) and the
gradients of the input and of every LoRA tensor (the experts' A and B included) within fp32 tolerance;
gpt-oss's (hidden, router_scores) tuple is kept; and trainer.tiled_mlp on an MoE model builds."""

import pytest
import torch
from conftest import compose_cfg
from helpers_families import build_family

from qlora_recipes.config.checks import check_stack
from qlora_recipes.model import loading
from qlora_recipes.model.tiled_moe import moe_blocks, tile_moe_blocks

FAMILIES = ("qwen3_moe", "gpt_oss", "llama4_text", "qwen3_5_moe_text")
STACK = ("trainer=smoke", "trainer.seq_len=64", "quant=nf4", "peft.r=8", "precision=fp32", "peft.dropout=0")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiled-moe")
    return {family: build_family(family, root / family) for family in FAMILIES}


def _model(base, tmp_path, *overrides):
    cfg = compose_cfg(*STACK, f"model.name_or_path={base}", *overrides)
    torch.manual_seed(0)
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    with torch.no_grad():  # LoRA B starts at zero: give the adapters a gradient through A too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    model.train()
    return cfg, model


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=embeds, labels=ids, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    logits = [t.detach() for t in out.router_logits]
    aux = getattr(out, "aux_loss", None)
    return out.loss.detach(), aux, logits, embeds.grad.clone(), grads


def _relative_error(a, b) -> float:
    """The largest difference against the tensor's scale: fp32 sums in another order."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_moe_blocks_give_the_untiled_loss_router_logits_and_lora_gradients(family, bases, tmp_path):
    _, model = _model(bases[family], tmp_path, "trainer.gradient_checkpointing=true")
    ids = torch.randint(4, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    loss, aux, logits, gx, grads = _run(model, ids)
    assert tile_moe_blocks(model, 24) == 2  # 128 tokens in 6 tiles, the last one shorter
    tiled_loss, tiled_aux, tiled_logits, tiled_gx, tiled_grads = _run(model, ids)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-5, atol=1e-6)
    if aux is not None:  # the load-balancing loss from the concatenated tiles' logits
        assert float(aux.detach()) > 0
        torch.testing.assert_close(tiled_aux, aux, rtol=1e-5, atol=1e-6)
    assert len(tiled_logits) == len(logits) == 2  # one per layer, not one per tile
    for a, b in zip(tiled_logits, logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert _relative_error(tiled_gx, gx) < 1e-4
    experts = [n for n in grads if ".experts." in n and "lora_" in n]
    assert grads.keys() == tiled_grads.keys() and len(experts) == 8  # A, B of gate_up and down, 2 layers
    for name in grads:
        assert _relative_error(tiled_grads[name], grads[name]) < 1e-4, name


def test_the_router_gets_the_load_balancing_gradient_through_the_tiles(bases, tmp_path):
    """The aux loss alone: its gradient reaches the block's input only through the recorded router
    logits, which the tiles hand back as outputs of the tiled Function."""
    _, model = _model(bases["qwen3_moe"], tmp_path, "trainer.gradient_checkpointing=false")
    ids = torch.randint(4, 100, (1, 64), generator=torch.Generator().manual_seed(2))

    def aux_grad():
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeds, output_router_logits=True).aux_loss.backward()
        return embeds.grad.clone()

    untiled = aux_grad()
    tile_moe_blocks(model, 16)
    tiled = aux_grad()
    assert untiled.abs().max() > 0 and _relative_error(tiled, untiled) < 1e-4


def test_gpt_oss_block_keeps_its_hidden_and_router_scores_tuple(bases, tmp_path):
    _, model = _model(bases["gpt_oss"], tmp_path)
    block = moe_blocks(model)[0]
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    hidden, scores = block(x)
    tile_moe_blocks(model, 8)
    tiled_hidden, tiled_scores = block(x)
    assert tiled_hidden.shape == hidden.shape == (2, 20, 64) and tiled_scores.shape == scores.shape == (40, 2)
    torch.testing.assert_close(tiled_hidden, hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tiled_scores, scores, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(tiled_scores.sum() + tiled_hidden.square().sum(), x)
    (want,) = torch.autograd.grad(scores.sum() + hidden.square().sum(), x)
    assert _relative_error(g, want) < 1e-4


def test_tiled_mlp_on_an_moe_model_tiles_its_blocks_at_auto_tile(bases, tmp_path):
    cfg, model = _model(bases["qwen3_moe"], tmp_path, "trainer.tiled_mlp=true")
    check_stack(cfg)  # no longer refused
    assert [b._tiled_mlp_tile for b in moe_blocks(model)] == [64, 64]  # hidden_size tokens
