"""trainer.lean_rmsnorm: the RMSNorm that keeps its 16-bit input gives Llama's RMSNorm's output bit for bit
and its gradients within fp32 rounding (in fp32 and bf16, with a trainable weight or a frozen one), keeps
no fp32 copy of its input for backward, patches every norm of the tiny NF4 + LoRA model without changing
its loss or gradients, plans less at long sequences, and is refused where it is not tested."""

import pytest
import torch
from conftest import compose_cfg
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.model import loading
from qlora_recipes.model.lean_rmsnorm import lean_rmsnorm


def _relative_error(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _run(norm, x, g):
    norm.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = norm(x)
    y.backward(g)
    return y.detach(), x.grad, norm.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trainable", [True, False])
def test_lean_rmsnorm_gives_llamas_output_and_gradients(dtype, weight_dtype, trainable):
    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
    norm.to(weight_dtype).weight.requires_grad_(trainable)
    x = (3 * torch.randn(2, 37, 64, generator=gen)).to(dtype)
    g = torch.randn(2, 37, 64, generator=gen).to(torch.promote_types(dtype, weight_dtype))
    plain = _run(norm, x, g)
    lean_rmsnorm(norm)
    lean = _run(norm, x, g)
    assert lean[0].dtype == plain[0].dtype and torch.equal(lean[0], plain[0])
    with torch.no_grad():  # evaluation and generation: the same bits
        assert torch.equal(norm(x), plain[0])
    assert lean[1].dtype == plain[1].dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the input gradient is cast to bf16 at the end
    assert _relative_error(lean[1].float(), plain[1].float()) < tol
    if trainable:
        assert _relative_error(lean[2].float(), plain[2].float()) < tol
    else:
        assert lean[2] is None and plain[2] is None


def _saved_bytes(norm, x) -> int:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x.detach().requires_grad_(True))
    return sum(saved)


def test_lean_rmsnorm_keeps_the_16_bit_input_not_an_fp32_copy():
    norm = LlamaRMSNorm(256).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 512, 256).to(torch.bfloat16)
    plain = _saved_bytes(norm, x)
    lean_rmsnorm(norm)
    lean = _saved_bytes(norm, x)
    tokens, h = 512, 256
    assert plain >= 2 * 4 * tokens * h  # fp32 input for pow and for the product with rsqrt
    assert lean == 2 * tokens * h + 4 * tokens + 2 * h  # x, rstd and the weight


def test_the_option_patches_every_norm_and_keeps_the_models_loss_and_gradients(tmp_path):
    overrides = ("trainer=smoke", "trainer.seq_len=64", "quant=nf4", "peft.r=8", "precision=fp32", "peft.dropout=0")
    ids = torch.randint(4, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    results = []
    for lean in (False, True):
        cfg = compose_cfg(*overrides, f"trainer.lean_rmsnorm={lean}")
        torch.manual_seed(0)
        model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
        patched = [m for m in model.modules() if getattr(m, "_lean_rmsnorm", False)]
        assert len(patched) == (5 if lean else 0)  # 2 per decoder layer, the final norm
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (loss, grads), (lean_loss, lean_grads) = results
    torch.testing.assert_close(lean_loss, loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        assert _relative_error(lean_grads[name], grads[name]) < 1e-5, name


def test_the_plan_of_lean_norms_shrinks_by_the_fp32_copies():
    """8B at 32k tokens in bf16: each layer's recompute keeps 4h bytes a token less for the first norm
    (its rsqrt stays) and 2h less for the second (its 16-bit input instead of an fp32 copy); the loss keeps the final norm's 16-bit input, not an fp32 copy."""
    from qlora_recipes import planner

    def plan(*overrides):
        cfg = compose_cfg(
            "recipe=llama3.1-8b-24gb",
            "trainer.seq_len=32768",
            "trainer.micro_batch_size=1",
            "precision.upcast_frozen=false",
            *overrides,
        )
        return planner.plan(cfg, gpus=[80 * 2**30], host_ram=128 * 2**30, world_size=1, ladder=False)["components"]

    plain, lean = plan(), plan("trainer.lean_rmsnorm=true")
    tokens, h = 32768, 4096
    assert plain["layer_working"]["cuda:0"] - lean["layer_working"]["cuda:0"] == tokens * (4 * h + 2 * h)
    assert plain["lm_head_loss"]["cuda:0"] - lean["lm_head_loss"]["cuda:0"] == tokens * 2 * h


@pytest.mark.parametrize(
    "overrides,words",
    [
        (("dist=ddp",), "dist=ddp"),
        (("trainer.liger=true",), "trainer.liger=true"),
        (("model=gemma2-9b",), "not Llama's form"),
    ],
)
def test_lean_rmsnorm_refuses_what_it_is_not_tested_with(overrides, words):
    cfg = compose_cfg("trainer.lean_rmsnorm=true", *overrides)
    with pytest.raises(UserError, match="trainer.lean_rmsnorm") as err:
        check_stack(cfg)
    assert words in str(err.value)
