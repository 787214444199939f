"""peft.experts=lora (model/expert_lora.py): LoRA on an MoE layer's fused expert weights, stored in 4 bits,
gives the very output and A/B gradients that peft's own ParamWrapper gives on the same layer holding the
dequantized 16-bit weights with the same A and B (Qwen3-MoE's routed experts, gpt-oss's biased and
transposed ones, Llama 4's per-expert batches); the run's LoraConfig targets the experts' parameters at
the rank per expert peft's docs advise, keeps the configured dropout for the linears (peft refuses it on
expert parameters: the defaults are not refused), and peft.experts=none leaves the experts alone."""

import logging

import pytest
import torch
from conftest import compose_cfg
from test_moe_experts_in_4bit_compute_as_their_dequantized_weights import (
    HIDDEN,
    TOKENS,
    _experts,
    _inputs,
    _quantized_and_reference,
)

from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.model import expert_lora

TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


class _Holder(torch.nn.Module):
    """A parent for the experts module: peft replaces a targeted module in its parent."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, *args):
        return self.experts(*args)


def _lora(module, dropout: float, ours: bool):
    """The experts under LoRA (rank 2 per expert, random B so the update is not zero): peft's own
    ParamWrapper, or ours registered for the experts' class."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        target_modules=[],
        target_parameters=TARGETS,
        r=2,
        lora_alpha=8,
        lora_dropout=dropout,
        init_lora_weights=False,
    )
    holder = _Holder(module)
    if ours:
        expert_lora.register(config, holder)
    return inject_adapter_in_model(config, holder)


CASES = [("qwen3_moe", "grouped_mm"), ("qwen3_moe", "eager"), ("gpt_oss", "grouped_mm"), ("llama4", "eager")]


@pytest.mark.parametrize("family, implementation", CASES, ids=["-".join(c) for c in CASES])
def test_lora_on_4bit_experts_gives_peft_output_and_adapter_gradients_on_the_dequantized_experts(
    family, implementation
):
    module = _experts(family, implementation)
    quantized, reference, _ = _quantized_and_reference(module, compose_cfg("precision=fp32").quant)
    plain = _Holder(reference).experts(*_inputs(module, torch.ones(TOKENS, HIDDEN)))  # no LoRA
    peft_layer = _lora(reference, 0.0, ours=False)
    ours = _lora(quantized, 0.05, ours=True)  # the default dropout: built, none on the experts
    assert type(ours.experts).__mro__[1].__name__ == "ParamWrapper"
    peft_params = {n: p for n, p in peft_layer.named_parameters() if "lora_" in n}
    our_params = {n: p for n, p in ours.named_parameters() if "lora_" in n}
    assert sorted(our_params) == sorted(peft_params) and len(our_params) == 4  # A, B of both weights
    with torch.no_grad():
        for name, param in our_params.items():
            param.copy_(peft_params[name])
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    out_peft, out_ours = peft_layer(*_inputs(module, x)), ours(*_inputs(module, x))
    torch.testing.assert_close(out_ours, out_peft, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        moved = (ours(*_inputs(module, torch.ones(TOKENS, HIDDEN))) - plain).abs().max()
    assert moved > 1e-2  # the update is applied, not lost
    grad = torch.randn_like(out_peft)
    (out_peft * grad).sum().backward()
    (out_ours * grad).sum().backward()
    for name, param in our_params.items():
        torch.testing.assert_close(param.grad, peft_params[name].grad, rtol=1e-4, atol=1e-4, msg=name)
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n)


def test_disabled_adapters_give_the_4bit_experts_alone():
    module = _experts("qwen3_moe")
    quantized, _, _ = _quantized_and_reference(module, compose_cfg("precision=fp32").quant)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        base = quantized(*_inputs(module, x))
        ours = _lora(quantized, 0.0, ours=True)
        assert not torch.allclose(ours(*_inputs(module, x)), base)
        ours.experts.enable_adapters(False)
        ours.experts.base_layer.enable_adapters(False)
        torch.testing.assert_close(ours(*_inputs(module, x)), base, rtol=0, atol=0)


def test_16bit_experts_take_the_default_dropout_that_peft_refuses():
    with pytest.raises(ValueError, match="lora_dropout"):
        _lora(_experts("qwen3_moe"), 0.05, ours=False)
    ours = _lora(_experts("qwen3_moe"), 0.05, ours=True)
    assert isinstance(ours.experts.lora_dropout["default"], torch.nn.Identity)


def _tiny_moe(num_experts: int = 4):
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.update({"moe_intermediate_size": 32, "num_experts": num_experts, "head_dim": 16})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_the_default_peft_group_targets_the_experts_at_r_over_experts_with_dropout_on_the_linears(caplog):
    peft = compose_cfg().peft
    assert (peft.experts, peft.expert_r, peft.dropout) == ("lora", None, 0.05)
    with caplog.at_level(logging.INFO, logger="qlora_recipes.model.expert_lora"):
        config = expert_lora.peft_config(peft, _tiny_moe(num_experts=8))
    assert sorted(config.target_parameters) == sorted(TARGETS)
    assert config.rank_pattern == dict.fromkeys(TARGETS, 2)  # r 16 // 8 experts, peft's docs' advice
    assert sorted(config.target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"] and config.r == 16
    assert config.lora_dropout == 0.05  # the linears keep it
    # this logger's own lines: an earlier test in the worker may have left moe_experts' INFO lines on
    lines = [r.getMessage() for r in caplog.records if r.name == "qlora_recipes.model.expert_lora"]
    assert len(lines) == 1 and "rank 2 per expert" in lines[0] and "dropout=0.05 on the linears only" in lines[0]
    many = expert_lora.peft_config(peft, _tiny_moe(num_experts=64))
    assert set(many.rank_pattern.values()) == {1}  # never below 1


def test_expert_r_sets_the_rank_and_experts_none_keeps_the_linears_only():
    chosen = expert_lora.peft_config(compose_cfg("peft.expert_r=3").peft, _tiny_moe())
    assert chosen.rank_pattern == dict.fromkeys(TARGETS, 3)
    linears = expert_lora.peft_config(compose_cfg("peft.experts=none").peft, _tiny_moe())
    assert not linears.target_parameters and not linears.rank_pattern
    assert sorted(linears.target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize(
    "override, words", [("peft.experts=all", ("peft.experts", "none")), ("peft.expert_r=0", ("peft.expert_r",))]
)
def test_bad_expert_lora_values_are_refused_in_one_line(override, words):
    with pytest.raises(UserError) as info:
        check_stack(compose_cfg(override))
    message = str(info.value)
    assert all(w in message for w in words) and "\n" not in message, message
