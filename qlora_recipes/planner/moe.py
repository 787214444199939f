"""The MoE terms of the planner's byte figures (components.py adds them to a block's and a layer's):
the fused 3-D expert weights (4-bit under quant.experts=4bit, their LoRA under peft.experts=lora), what a
routed layer keeps per token for backward and what its routed backward holds at once. Pure arithmetic on a
`StackSpec`, as model/moe_experts.py runs the experts; tests/unit/test_moe_and_new_families_are_planned_from_their_figures.py
checks the figures against what autograd keeps on CPU."""

from __future__ import annotations

from .spec import StackSpec


def experts_quantized(st: StackSpec) -> bool:
    """Under quant.experts=4bit with nf4/fp4 each fused expert weight is one blockwise NF4/FP4 tensor
    (model/moe_experts.py: the codes, absmax and code books as a Linear4bit's weight holds), and its
    forward (and again its backward) dequantizes the whole tensor in the compute dtype: the layer's
    dequant scratch. Otherwise they are frozen 16-bit params (k-bit prep upcasts them to fp32 like the norms)."""
    return st.quant in ("nf4", "fp4") and st.experts_4bit


def expert_lora(st: StackSpec, name: str, numel: int) -> tuple[list[tuple[int, int]], int]:
    """peft.experts=lora on the fused expert weight `name` of `numel` elements: peft's A [E*r_e, in] and
    B [out, E*r_e], and its in_features (per routed row); ([], 0) without expert LoRA. The weight's other
    side than h is 2 x intermediate (gate_up) or intermediate (down)."""
    if not st.expert_r:
        return [], 0
    e, h = st.fig.num_experts, st.fig.hidden_size
    width = numel // (e * h)
    fan_in, fan_out = (width, h) if name.endswith("down_proj") else (h, width)
    return [(e * st.expert_r, fan_in), (fan_out, e * st.expert_r)], fan_in


def saved_per_token(st: StackSpec, expert_lora_in: int, c: int, r: int) -> int:
    """What a routed layer keeps per token for backward beyond a dense MLP's: the routed rows' weighted
    outputs (k x h) and the router's fp32 logits and probs, gpt-oss's clamped gate (6 not 3 intermediate
    widths a routed row), and with expert LoRA, per routed row and weight, its input, x@A over all
    experts and the mask (expert_lora_in: the adapted expert weights' in_features)."""
    fig = st.fig
    if not fig.num_experts:
        return 0
    per_token = fig.routed_rows * fig.hidden_size * r + 8 * fig.num_experts
    per_token += 3 * r * fig.routed_rows * fig.expert_intermediate * fig.traits.clamped_glu
    if expert_lora_in:
        ranks = fig.num_experts * st.expert_r
        per_token += fig.experts_per_token * (c * expert_lora_in + 2 * (2 * c + 1) * ranks)
    return per_token


def routed_backward_bytes(st: StackSpec, tokens: int, r: int) -> int:
    """moe_experts.routed_forward's top-k weights' product in backward: three h-wide routed-row tensors
    at once (output gradient scattered back, rows' gradient, their product with the rows), no dequantized
    weight. 0 for a dense model and for Llama 4's sigmoid router, whose experts run batched."""
    fig = st.fig
    if not fig.num_experts or fig.traits.router == "sigmoid":
        return 0
    return tokens * r * fig.hidden_size * (2 + 3 * fig.experts_per_token)


def routed_recompute_bytes(st: StackSpec, tokens: int, c: int, r: int) -> int:
    """A routed layer's forward (the recompute, under checkpointing) at its down projection, beside all the
    layer has saved by then: the projection's base output, with expert LoRA its update and their sum, with
    expert biases (a top-k-softmax router's experts: gpt-oss) the gathered bias rows and the biased sum,
    h-wide routed-row tensors in the compute dtype; the weighted rows saved_per_token counts come after
    (bench trace, gpt-oss-20b with 16-bit hidden states at 32,768 and 131,072 tokens: five such tensors
    at the layer-backward peak). 0 for a dense model and for Llama 4's batched experts."""
    fig = st.fig
    if not fig.num_experts or fig.traits.router == "sigmoid":
        return 0
    rows = 1 + (2 if st.expert_r else 0) + (2 if fig.traits.router == "topk_softmax" else 0)
    return tokens * fig.routed_rows * fig.hidden_size * max(0, c * rows - r)
