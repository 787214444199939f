"""quant.experts=4bit (model/moe_experts.py): a fused MoE experts module of transformers 5 (Qwen3-MoE's
routed experts through each of transformers' implementations, gpt-oss's biased and transposed ones,
Llama 4's per-expert batches) stores its 3-D weights as bitsandbytes NF4 codes at half a byte per
parameter plus absmax, gives the very output and input gradient of the same layer holding the
dequantized weights, keeps no 16-bit weight for backward and gives the frozen codes no gradient.
Nothing here trains; tests/e2e/test_moe_models_train_with_4bit_experts.py trains."""

import copy

import pytest
import torch
from conftest import compose_cfg

from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.model import moe_experts

TOKENS, HIDDEN, TOP_K = 12, 64, 2


def _experts(family: str, implementation: str = "grouped_mm") -> torch.nn.Module:
    """A freshly initialised experts module of `family` (hidden 64, expert intermediate 32)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=32, num_experts=8)
        cls = Qwen3MoeExperts
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4)
        cls = GptOssExperts
    else:
        config = transformers.Llama4TextConfig(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4)
        cls = Llama4TextExperts
    config._experts_implementation = implementation
    module = cls(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return module


def _inputs(module: torch.nn.Module, x: torch.Tensor) -> tuple:
    """The experts' call arguments: routed tokens with their top-k experts, or Llama 4's per-expert rows."""
    if not hasattr(module, "has_gate"):
        return (x.repeat(module.num_experts, 1),)
    gen = torch.Generator().manual_seed(1)
    index = torch.stack([torch.randperm(module.num_experts, generator=gen)[:TOP_K] for _ in range(x.shape[0])])
    weights = torch.softmax(torch.randn(x.shape[0], TOP_K, generator=gen), dim=-1)
    return x, index, weights


def _quantized_and_reference(module, quant):
    """(the module with 4-bit experts, a copy of the original holding the dequantized weights)."""
    quantized = copy.deepcopy(module)
    counts = moe_experts.quantize_experts(quantized, quant)
    reference = copy.deepcopy(module)
    for name, param in quantized.named_parameters():
        if moe_experts.is_4bit(param):
            getattr(reference, name).data = moe_experts.dequantized(param).to(param.quant_state.dtype)
    return quantized, reference, counts


CASES = [("qwen3_moe", "grouped_mm"), ("qwen3_moe", "eager"), ("qwen3_moe", "batched_mm"), ("gpt_oss", "grouped_mm")]
CASES += [("gpt_oss", "eager"), ("llama4", "eager")]


@pytest.mark.parametrize("family, implementation", CASES, ids=["-".join(c) for c in CASES])
def test_4bit_experts_give_the_dequantized_layers_output_and_input_gradient(family, implementation):
    quant = compose_cfg("precision=fp32").quant
    module = _experts(family, implementation)
    quantized, reference, counts = _quantized_and_reference(module, quant)
    assert counts["layers"] == 1 and counts["weights"] == 2 and counts["kept_16bit"] == 0
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2))
    x_ref, x_4bit = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_4bit = reference(*_inputs(module, x_ref)), quantized(*_inputs(module, x_4bit))
    torch.testing.assert_close(out_4bit, out_ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out_ref)
    (out_ref * grad).sum().backward()
    (out_4bit * grad).sum().backward()
    torch.testing.assert_close(x_4bit.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    # and it is the quantized weight that ran: the original 16-bit layer differs
    assert not torch.allclose(module(*_inputs(module, x)), out_4bit, atol=1e-3)


def test_bf16_4bit_experts_match_the_dequantized_layer_in_bf16():
    quant = compose_cfg("precision=bf16").quant
    module = _experts("qwen3_moe").to(torch.bfloat16)
    quantized, reference, _ = _quantized_and_reference(module, quant)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
    assert quantized.gate_up_proj.quant_state.dtype == torch.bfloat16
    # bf16 rounding of the same products summed in another order: within one ulp at the outputs' scale
    torch.testing.assert_close(quantized(*_inputs(module, x)), reference(*_inputs(module, x)), rtol=1.6e-2, atol=1e-3)


def test_no_16bit_expert_weight_is_kept_for_backward_and_the_codes_get_no_gradient():
    """Every tensor autograd saves is an activation (rows of tokens), never a weight or one expert's slice
    of it: backward dequantizes again."""
    quant = compose_cfg("precision=fp32").quant
    quantized, _, _ = _quantized_and_reference(_experts("qwen3_moe"), quant)
    weight_shapes = {tuple(p.quant_state.shape[i:]) for p in quantized.parameters() for i in (0, 1)}
    saved: list[tuple] = []
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = quantized(*_inputs(quantized, x))
    assert saved and not (set(saved) & weight_shapes), saved
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(not p.requires_grad and p.grad is None for p in quantized.parameters())


@pytest.mark.parametrize("double_quant", [True, False])
def test_expert_weights_are_stored_at_half_a_byte_per_parameter_plus_absmax(double_quant):
    quant = compose_cfg(f"quant.double_quant={str(double_quant).lower()}").quant
    module = _experts("qwen3_moe")
    params = sum(p.numel() for p in module.parameters())
    quantized, _, counts = _quantized_and_reference(module, quant)
    codes = sum(p.data.numel() * p.data.element_size() for p in quantized.parameters())
    assert codes * 2 == params == counts["params"]  # two 4-bit codes per byte
    absmax = sum(p.quant_state.absmax.numel() * p.quant_state.absmax.element_size() for p in quantized.parameters())
    blocks = params // moe_experts.BLOCKSIZE
    assert absmax == blocks * (1 if double_quant else 4)  # 8-bit absmax with double quant, fp32 without
    assert counts["bytes"] == sum(moe_experts.stored_bytes(p) for p in quantized.parameters())
    assert codes + absmax <= counts["bytes"] < 0.3 * params * 2  # under 30 % of bf16, code books included


def test_gpt_oss_biases_stay_as_they_were():
    quant = compose_cfg("precision=fp32").quant
    module = _experts("gpt_oss")
    quantized, _, _ = _quantized_and_reference(module, quant)
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        kept = getattr(quantized, name)
        assert not moe_experts.is_4bit(kept) and torch.equal(kept, getattr(module, name))


@pytest.mark.parametrize("overrides", [("quant.experts=16bit",), ("quant=int8",), ("quant=none",)])
def test_experts_stay_in_the_compute_dtype_unless_a_4bit_quant_stores_them(overrides):
    module = _experts("qwen3_moe")
    counts = moe_experts.quantize_experts(module, compose_cfg(*overrides).quant)
    assert counts["layers"] == 0 and type(module).__name__ == "Qwen3MoeExperts"
    assert all(p.dtype == torch.float32 and p.dim() == 3 for p in module.parameters())


def test_a_bad_quant_experts_value_is_refused_naming_the_key_and_its_choices():
    with pytest.raises(UserError) as info:
        check_stack(compose_cfg("quant.experts=8bit"))
    assert "quant.experts" in str(info.value) and "16bit" in str(info.value) and "\n" not in str(info.value)


def test_all_linear_on_an_moe_model_is_spelled_out_as_its_linears():
    import transformers
    from transformers import AutoModelForCausalLM

    config = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    config.update({"moe_intermediate_size": 32, "num_experts": 4, "head_dim": 16})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft = compose_cfg().peft
    assert peft.target_modules == "all-linear"
    assert moe_experts.lora_on_linears(peft, model).target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]
    chosen = compose_cfg("peft.target_modules=[q_proj,v_proj]").peft
    assert moe_experts.lora_on_linears(chosen, model) is chosen  # the user's own list is theirs
    llama = compose_cfg("model=tiny").model  # a dense model keeps peft's all-linear
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(llama.name_or_path))
    assert moe_experts.lora_on_linears(peft, dense) is peft


class _OwnRoutedExperts(torch.nn.Module):
    """Fused experts with a routed forward of their own, not transformers' decorated kind: no forward here
    knows how to run them on 4-bit weights."""

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, HIDDEN))
        self.down_proj = torch.nn.Parameter(torch.randn(4, HIDDEN, 32))
        self.act_fn = torch.nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


def test_experts_with_a_forward_of_their_own_stay_in_16_bits_and_are_counted(caplog):
    module = _OwnRoutedExperts()
    with caplog.at_level("WARNING", logger="qlora_recipes.model.moe_experts"):
        counts = moe_experts.quantize_experts(module, compose_cfg().quant)
    assert counts["kept_16bit"] == 1 and counts["layers"] == 0 and type(module) is _OwnRoutedExperts
    assert all(p.dim() == 3 and p.is_floating_point() for p in module.parameters())
    assert "1 expert layers stay in 16 bits" in caplog.text


@pytest.mark.parametrize("double_quant", [True, False])
def test_the_loading_warm_up_is_sized_for_experts_as_stored_not_as_loaded(double_quant):
    """transformers takes the bytes it expects a GPU to hold in one block before loading (its caching
    allocator warm-up): 16-bit experts counted there would be the run's peak. Within
    quantized_while_loading each expert weight counts at its stored 4-bit size, everything else as before."""
    import transformers
    import transformers.modeling_utils as modeling

    quant = compose_cfg("quant=nf4", f"quant.double_quant={str(double_quant).lower()}").quant
    config = transformers.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4, num_hidden_layers=2, vocab_size=100
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gpu = torch.device("cuda", 0)  # a label only: counting allocates nothing
    placed = {name: gpu for name, _ in model.named_parameters()}
    as_loaded = modeling.get_total_byte_count(model, placed)[gpu]
    with moe_experts.quantized_while_loading(quant):
        as_stored = modeling.get_total_byte_count(model, placed)[gpu]
    assert modeling.get_total_byte_count(model, placed)[gpu] == as_loaded  # restored on exit

    experts = [getattr(m, n) for m in model.modules() for n in moe_experts.expert_weights(m)]
    assert len(experts) == 4
    saved = sum(w.numel() * 2 - moe_experts.stored_size(w.numel(), quant) for w in experts)
    assert as_stored == as_loaded - saved and saved > 0.7 * sum(w.numel() * 2 for w in experts)
    # the stored size is what quantize_weight keeps, less the code books (16 + 256 floats a weight)
    module = next(m for m in _experts("gpt_oss").modules() if moe_experts.expert_weights(m))
    numel = module.gate_up_proj.numel()
    moe_experts.quantize_weight(module, "gate_up_proj", quant)
    kept = moe_experts.stored_bytes(module.gate_up_proj)
    assert 0 <= kept - moe_experts.stored_size(numel, quant) <= 4 * (16 + 256)
