"""The MoE terms of the planner's byte figures (components.py adds them to a block's and a layer's):
the fused 3-D expert weights (4-bit under quant.experts=4bit, their LoRA under peft.experts=lora), what a
routed layer keeps per token for backward and what its routed backward holds at once. Pure arithmetic on a
`StackSpec`, as model/moe_experts.py runs the experts; tests/unit/test_moe_and_new_families_are_planned_from_their_figures.py
checks the figures against what autograd keeps on CPU."""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import UserError
from ..model.checkpoint import read_config
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


def routed_working_bytes(st: StackSpec, tokens: int, c: int, r: int, mlp_saved: int, dequant: int) -> int:
    """A routed layer's backward working set beside all it saves (the layer-backward phase adds the
    dequant scratch, `dequant` bytes): the larger of its moments. The top-k weights' product
    (routed_backward_bytes) and the recompute at the down projection (routed_recompute_bytes) hold no
    dequantized expert weight, so they count here net of it; the recompute's first expert projection
    holds one (first_projection_bytes). 0 for a dense model and for Llama 4's batched experts."""
    fig = st.fig
    if not fig.num_experts or fig.traits.router == "sigmoid":
        return 0
    held = max(routed_backward_bytes(st, tokens, r), routed_recompute_bytes(st, tokens, c, r))
    return max(held - dequant, first_projection_bytes(st, tokens, c, r, mlp_saved, dequant))


def first_projection_bytes(st: StackSpec, tokens: int, c: int, r: int, mlp_saved: int, dequant: int) -> int:
    """The recompute's first expert projection (gate and up, fused), against all the layer saves
    (`mlp_saved` bytes a token of them its MLP's): of the MLP's, only the router's and the routed rows
    (k x h) exist yet, beside the routed rows' gradient the backward came with (k x h) and
    beside_recompute_per_token's tensors; and the larger of the projection's output beside its whole
    weight dequantized (bench trace, gpt-oss-20b at 3,520 tokens: the layer-backward peak there) and,
    that weight freed, its LoRA update, sums and bias rows (as at the down projection), net of `dequant`."""
    fig = st.fig
    k, h = fig.routed_rows, fig.hidden_size
    kept = 8 * fig.num_experts + k * c * h
    output = tokens * k * c * 2 * fig.expert_intermediate
    projection = max(output, output * _held_at_projection(st) - dequant)
    return tokens * (kept - mlp_saved + k * c * h + beside_recompute_per_token(st, r)) + projection


def _held_at_projection(st: StackSpec) -> int:
    """The routed-row tensors an expert projection holds at once (model/moe_experts._project): its base
    output, with expert LoRA the update and their sum; with expert biases too (a top-k-softmax router's
    experts: gpt-oss) the base output is freed by then and the update, sum, gathered bias rows and biased
    sum are (bench trace: three at Qwen3-30B-A3B's down projection, four at gpt-oss-20b's)."""
    lora, biased = bool(st.expert_r), st.fig.traits.router == "topk_softmax"
    return 4 if lora and biased else 1 + 2 * lora + 2 * biased


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
    layer has saved by then: what the projection holds at once (_held_at_projection) and the routed rows'
    gradient the backward came with, h-wide routed-row tensors in the compute dtype, less the weighted
    rows saved_per_token counts, which come after (bench trace at 8,192 and 16,384 tokens: five such
    tensors in gpt-oss-20b's layer-backward peak, four in Qwen3-30B-A3B's); and the hidden-width tensors
    beside them. 0 for a dense model and for Llama 4's batched experts."""
    fig = st.fig
    if not fig.num_experts or fig.traits.router == "sigmoid":
        return 0
    rows = _held_at_projection(st) + 1  # and the routed rows' gradient the backward came with
    return tokens * (fig.routed_rows * fig.hidden_size * max(0, c * rows - r) + beside_recompute_per_token(st, r))


def beside_recompute_per_token(st: StackSpec, r: int) -> int:
    """The hidden-width tensors alive beside that recompute, not saved for backward (bench trace,
    gpt-oss-20b at 8,192 tokens with expert widths unlike h): the layer output's gradient, which its
    backward started from, and what the recomputing forward still holds, the attention block's residual
    sum (unless the second norm keeps it itself: fp32, or trainer.lean_rmsnorm) and the MLP's normed input
    (r bytes each). Under TRL's activation offloading with checkpointing,
    also what the backward brought back from host RAM for the node before, kept until this node is done:
    at the last layer the final norm's input, fp32 (its r-byte input under trainer.lean_rmsnorm)."""
    h = st.fig.hidden_size
    brought_back = (r if st.lean_norms else 4) * h if st.activation_offloading and st.checkpointing else 0
    residual = r * h if r < 4 and not st.lean_norms else 0  # else the second norm keeps it, as saved
    return 2 * r * h + residual + brought_back


def load_balancing_loss(st: StackSpec) -> bool:
    """Whether the step adds the router's load-balancing loss: every TRL trainer turns it on for a config
    class with output_router_logits (each MoE one has it) and a nonzero router_aux_loss_coef, and sets
    output_router_logits to that, whatever config.json said of it; the coefficient is config.json's, else
    the config class's default (0.001 in each). The loader sets Llama 4's to 0 (model/loading.py: its
    forward adds none)."""
    fig = st.fig
    if not fig.num_experts or fig.traits.router == "sigmoid":
        return False
    return router_aux_loss_coef(fig.config_dir) != 0


@functools.lru_cache(maxsize=32)
def router_aux_loss_coef(config_dir: str | None) -> float | None:
    """config.json's router_aux_loss_coef (a multimodal one's text_config's); None where it has none or
    there is no config.json (a conf/model entry): the config class's default then."""
    path = Path(config_dir or "") / "config.json"
    if not config_dir or not path.is_file():
        return None
    cj = read_config(path)
    text = cj.get("text_config")
    value = (text if isinstance(text, dict) and "router_aux_loss_coef" in text else cj).get("router_aux_loss_coef")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(
            f"{path}: router_aux_loss_coef={value!r} must be a number (0 turns the MoE load-balancing loss off)"
        )
    return float(value)


def router_logits_bytes(st: StackSpec, tokens: int, layers: int, c: int) -> int:
    """What the load-balancing loss keeps beside the activations, in forward and backward alike: each
    routed layer's router logits (tokens x experts, the router linear's c-byte output), recorded from
    its forward through the loss; in backward the loss's softmax backwards run first (the newest nodes),
    so each layer's logits' gradient, as large, waits from the loss until that layer's backward (tiny
    qwen3_moe and gpt_oss on CPU: all of them alive when the last layer's backward starts)."""
    if not load_balancing_loss(st):
        return 0
    return tokens * layers * st.fig.num_experts * c
