"""The analytic inventory of the families the planner knows (families.py `known`): every block as
transformers 5.23 builds it, from the figures alone (no torch, no meta model). Llama's layer (q/k/v/o,
gate/up/down, two RMSNorms) plus what a family's traits add: q/k norms (a head_dim weight each),
Gemma's sandwich norms and per-layer-type rotary tables, gpt-oss's attention sinks (a logit per head)
and biases, and MoE blocks: a router (a weight of experts x hidden, gpt-oss's with a bias), the fused
3-D expert weights (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; gpt-oss's with per-expert biases)
and a shared expert MLP where the family has one. tests/unit/test_memory_planner.py holds each to the
module tree transformers builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import UserError
from ..families import traits
from .blocks import Block, Linear

# config.json keys of the figures a family's own layers need, by the Figures field they fill (first found)
_MOE_KEYS = {
    "num_experts": ("num_experts", "num_local_experts"),
    "experts_per_token": ("num_experts_per_tok", "experts_per_token"),
    "expert_intermediate": ("moe_intermediate_size", "intermediate_size"),
}


def family_figures(arch: str, cj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The Figures fields of a family's own layers from its config.json keys (or a conf/model entry's
    `model.figures`): experts, top-k, expert and shared-expert widths; local layers and their window."""
    family, out = traits(arch), {}
    if family.moe:
        for field, keys in _MOE_KEYS.items():
            value = next((cj[k] for k in keys if cj.get(k)), None)
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"{where}: an MoE model needs {keys[0]} (a positive integer) to be planned; add it")
            out[field] = value
        out["shared_expert_intermediate"] = int(cj.get("shared_expert_intermediate_size") or 0)
    if family.local_attention == "sliding":
        types = tuple(str(t) for t in cj.get("layer_types") or ())
        out["layer_types"] = types
        out["sliding_window"] = int(cj.get("sliding_window") or 0) if "sliding_attention" in types else 0
    return out


def analytic_inventory(fig: Any) -> tuple[Block, ...]:
    """The blocks of a known family's model (fig: planner.figures.Figures)."""
    h = fig.hidden_size
    blocks = [_embeddings(fig)]
    blocks += [_layer(fig, f"model.layers.{i}") for i in range(fig.num_layers)]
    blocks.append(Block("model.norm", params=(("model.norm.weight", h),)))
    blocks.append(_rotary(fig))
    if fig.tie_embeddings:
        blocks.append(Block("lm_head", tied_to="model.embed_tokens"))
    else:
        blocks.append(Block("lm_head", linears=(Linear("lm_head", h, fig.vocab_size, False),)))
    return tuple(blocks)


def _embeddings(fig: Any) -> Block:
    h = fig.hidden_size
    buffers = (("model.embed_tokens.embed_scale", 1, 0),) if fig.traits.embed_scale else ()  # 0-dim, load dtype
    return Block(
        "model.embed_tokens",
        params=(("model.embed_tokens.weight", fig.vocab_size * h),),
        buffers=buffers,
        embeddings=(("model.embed_tokens", fig.vocab_size, h),),
    )


def _rotary(fig: Any) -> Block:
    """inv_freq and original_inv_freq in fp32; Gemma 3 keeps a pair per layer type (local and global)."""
    half, kinds = fig.head_dim // 2, [""]
    if fig.architecture.startswith("gemma3"):
        kinds = [f"{t}_" for t in sorted(set(fig.layer_types) or {"full_attention", "sliding_attention"})]
    names = [f"model.rotary_emb.{k}{n}" for k in kinds for n in ("inv_freq", "original_inv_freq")]
    return Block("model.rotary_emb", buffers=tuple((n, half, 4) for n in names))


def _layer(fig: Any, p: str) -> Block:
    h, d, family = fig.hidden_size, fig.head_dim, fig.traits
    qd, kvd = fig.num_heads * d, fig.num_kv_heads * d
    linears = [
        Linear(f"{p}.self_attn.q_proj", h, qd, fig.qkv_bias),
        Linear(f"{p}.self_attn.k_proj", h, kvd, fig.qkv_bias),
        Linear(f"{p}.self_attn.v_proj", h, kvd, fig.qkv_bias),
        Linear(f"{p}.self_attn.o_proj", qd, h, fig.o_bias),
    ]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    params = [(f"{p}.{n}.weight", h) for n in norms]
    if family.qk_norm:
        params += [(f"{p}.self_attn.q_norm.weight", d), (f"{p}.self_attn.k_norm.weight", d)]
    if family.attention_sinks:
        params.append((f"{p}.self_attn.sinks", fig.num_heads))
    experts: tuple[tuple[str, int], ...] = ()
    if family.moe:
        router, experts = _moe(fig, f"{p}.mlp")
        params += router
        if fig.shared_expert_intermediate:
            linears += _gated_mlp(fig, f"{p}.mlp.shared_expert", fig.shared_expert_intermediate)
            linears.append(Linear(f"{p}.mlp.shared_expert_gate", h, 1, False))  # Qwen's sigmoid gate of it
    else:
        linears += _gated_mlp(fig, f"{p}.mlp", fig.intermediate_size)
    return Block(p, linears=tuple(linears), params=tuple(params), is_layer=True, experts=experts)


def _gated_mlp(fig: Any, p: str, f: int) -> list[Linear]:
    h, bias = fig.hidden_size, fig.mlp_bias
    return [
        Linear(f"{p}.gate_proj", h, f, bias),
        Linear(f"{p}.up_proj", h, f, bias),
        Linear(f"{p}.down_proj", f, h, bias),
    ]


def _moe(fig: Any, p: str) -> tuple[list[tuple[str, int]], tuple[tuple[str, int], ...]]:
    """(router and expert-bias params, 3-D expert weights) of one MoE block. The router is a bare weight
    (Qwen's `gate`, gpt-oss's `router` with a bias), not an nn.Linear: bitsandbytes leaves it as loaded."""
    h, e, i = fig.hidden_size, fig.num_experts, fig.expert_intermediate
    weights = ((f"{p}.experts.gate_up_proj", e * 2 * i * h), (f"{p}.experts.down_proj", e * h * i))
    if fig.traits.router == "topk_softmax":  # gpt-oss: router bias, expert biases in the compute dtype
        params = [(f"{p}.router.weight", e * h), (f"{p}.router.bias", e)]
        params += [(f"{p}.experts.gate_up_proj_bias", e * 2 * i), (f"{p}.experts.down_proj_bias", e * h)]
        return params, weights
    return [(f"{p}.gate.weight", e * h)], weights
