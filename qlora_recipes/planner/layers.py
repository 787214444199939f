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
from .blocks import OUTPUT_HEAD, Block, Linear
from .family_layers import (
    gated_delta_net,
    gemma4_extras,
    gemma4_mlp_width,
    kv_shared,
    layer_heads,
    new_family_figures,
    per_layer_embeddings,
)

# config.json keys of the figures a family's own layers need, by the Figures field they fill (first found)
_MOE_KEYS = {
    "num_experts": ("num_experts", "num_local_experts"),
    "experts_per_token": ("num_experts_per_tok", "experts_per_token"),
    "expert_intermediate": ("moe_intermediate_size", "intermediate_size"),
}


def family_figures(arch: str, cj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The Figures fields of a family's own layers from its config.json keys (or a conf/model entry's
    `model.figures`): experts, top-k, expert and shared-expert widths; local layers and their window;
    Qwen3.5's, Gemma 4's and Llama 4's own parts (family_layers.new_family_figures)."""
    family, out = traits(arch), {}
    if family.moe:
        for field, keys in _MOE_KEYS.items():
            value = next((cj[k] for k in keys if cj.get(k)), None)
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"{where}: an MoE model needs {keys[0]} (a positive integer) to be planned; add it")
            out[field] = value
        out["shared_expert_intermediate"] = int(cj.get("shared_expert_intermediate_size") or 0)
        if family.router == "sigmoid":  # Llama 4's shared expert is as wide as an expert
            out["shared_expert_intermediate"] = out["expert_intermediate"]
    if family.local_attention == "sliding":
        types = tuple(str(t) for t in cj.get("layer_types") or ())
        out["layer_types"] = types
        out["sliding_window"] = int(cj.get("sliding_window") or 0) if "sliding_attention" in types else 0
    if "final_logit_softcapping" in cj:
        out["final_logit_softcapping"] = _softcap(cj["final_logit_softcapping"], where)
    try:
        out.update(new_family_figures(arch, cj))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: a figure of {arch}'s own layers is missing or not a number ({e}); add it") from None
    return out


def _softcap(value: Any, where: str) -> bool:
    """final_logit_softcapping: a positive number caps the logits, null leaves them as they are."""
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"{where}: final_logit_softcapping={value!r} must be a positive number or null; fix it")
    return True


def analytic_inventory(fig: Any) -> tuple[Block, ...]:
    """The blocks of a known family's model (fig: planner.figures.Figures)."""
    h = fig.hidden_size
    blocks = [_embeddings(fig)]
    blocks += [_layer(fig, i) for i in range(fig.num_layers)]
    blocks.append(Block("model.norm", params=(("model.norm.weight", h),)))
    blocks.append(_rotary(fig))
    if fig.per_layer_input:  # Gemma 4's second table and its projection: blocks of their own
        linears, params, tables = per_layer_embeddings(fig)
        scale = (("model.embed_tokens_per_layer.embed_scale", 1, 0),)
        blocks.append(Block("model.embed_tokens_per_layer", params=params[:1], buffers=scale, embeddings=tuple(tables)))
        blocks.append(Block("model.per_layer_model_projection", linears=tuple(linears)))
        blocks.append(Block("model.per_layer_projection_norm", params=tuple(params[1:])))
    if fig.tie_embeddings:
        blocks.append(Block(OUTPUT_HEAD, tied_to="model.embed_tokens"))
    else:
        blocks.append(Block(OUTPUT_HEAD, linears=(Linear(OUTPUT_HEAD, h, fig.vocab_size, False),)))
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
    """inv_freq and original_inv_freq in fp32, one entry per rotated pair of a head's dims (Qwen3.5 rotates
    a quarter of them); Gemma 3 and 4 keep a pair per layer type (Gemma 4's global ones of its head_dim)."""
    half = -(-int(fig.head_dim * fig.rotary_fraction) // 2)
    kinds = {"": half}
    if fig.architecture.startswith(("gemma3", "gemma4")):
        types = sorted(set(fig.layer_types) or {"full_attention", "sliding_attention"})
        kinds = {
            f"{t}_": (fig.global_head_dim or fig.head_dim if t == "full_attention" else fig.head_dim) // 2
            for t in types
        }
    names = [(f"model.rotary_emb.{k}{n}", size) for k, size in kinds.items() for n in ("inv_freq", "original_inv_freq")]
    return Block("model.rotary_emb", buffers=tuple((n, size, 4) for n, size in names))


def _layer(fig: Any, i: int) -> Block:
    p, h, family = f"model.layers.{i}", fig.hidden_size, fig.traits
    mixer = fig.layer_types[i] if fig.layer_types else ""
    norms = ["input_layernorm", "post_attention_layernorm"]
    if family.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    params = [(f"{p}.{n}.weight", h) for n in norms]
    if mixer == "linear_attention":
        linears, own = gated_delta_net(fig, p)
    else:
        linears, own = _attention(fig, p, i)
    params += own
    experts: tuple[tuple[str, int], ...] = ()
    if family.router == "sigmoid":  # Llama 4: feed_forward, MoE in its moe_layers, a dense MLP elsewhere
        if i in fig.moe_layers:
            router, experts = _moe(fig, f"{p}.feed_forward")
            params += router
            linears += _gated_mlp(fig, f"{p}.feed_forward.shared_expert", fig.shared_expert_intermediate)
        else:
            linears += _gated_mlp(fig, f"{p}.feed_forward", fig.dense_intermediate)
    elif family.moe:
        router, experts = _moe(fig, f"{p}.mlp")
        params += router
        if fig.shared_expert_intermediate:
            linears += _gated_mlp(fig, f"{p}.mlp.shared_expert", fig.shared_expert_intermediate)
            linears.append(Linear(f"{p}.mlp.shared_expert_gate", h, 1, False))  # Qwen's sigmoid gate of it
    elif family.per_layer_embeddings:  # Gemma 4: its MLP, the MoE block beside it, the per-layer input
        linears += _gated_mlp(fig, f"{p}.mlp", gemma4_mlp_width(fig, i))
        more, more_params = gemma4_extras(fig, p, i)
        linears, params = linears + more, params + more_params
        if fig.num_experts:
            experts = _moe(fig, p)[1]
    else:
        linears += _gated_mlp(fig, f"{p}.mlp", fig.intermediate_size)
    buffers = ((f"{p}.layer_scalar", 1, 0),) if family.per_layer_embeddings else ()  # Gemma 4's, load dtype
    d, kv = layer_heads(fig, i)
    dims = {"head_dim": d, "kv_heads": kv} if (d, kv) != (fig.head_dim, fig.num_kv_heads) else {}
    l2 = i in fig.l2_norm_layers
    return Block(
        p, tuple(linears), tuple(params), buffers, is_layer=True, experts=experts, mixer=mixer, l2_qk_norm=l2, **dims
    )


def _attention(fig: Any, p: str, i: int) -> tuple[list[Linear], list[tuple[str, int]]]:
    """q/k/v/o (q twice as wide under an attention-output gate: Qwen3.5), q/k norms, sinks; Gemma 4's
    global layers with their own head_dim, no v_proj where keys are values, no k/v where they are shared."""
    h, family = fig.hidden_size, fig.traits
    d, kv = layer_heads(fig, i)
    qd, kvd = fig.num_heads * d, kv * d
    p = f"{p}.self_attn"
    shared = family.per_layer_embeddings and kv_shared(fig, i)
    linears = [Linear(f"{p}.q_proj", h, qd * (2 if family.attn_output_gate else 1), fig.qkv_bias)]
    if not shared:
        linears.append(Linear(f"{p}.k_proj", h, kvd, fig.qkv_bias))
        if not (fig.k_eq_v and fig.layer_types[i] == "full_attention"):
            linears.append(Linear(f"{p}.v_proj", h, kvd, fig.qkv_bias))
    linears.append(Linear(f"{p}.o_proj", qd, h, fig.o_bias))
    params = []
    if family.qk_norm and family.router != "sigmoid":  # Llama 4's is an L2 norm without a weight
        params.append((f"{p}.q_norm.weight", d))
        params += [] if shared else [(f"{p}.k_norm.weight", d)]
    if family.attention_sinks:
        params.append((f"{p}.sinks", fig.num_heads))
    return linears, params


def _gated_mlp(fig: Any, p: str, f: int) -> list[Linear]:
    h, bias = fig.hidden_size, fig.mlp_bias
    return [
        Linear(f"{p}.gate_proj", h, f, bias),
        Linear(f"{p}.up_proj", h, f, bias),
        Linear(f"{p}.down_proj", f, h, bias),
    ]


def _moe(fig: Any, p: str) -> tuple[list[tuple[str, int]], tuple[tuple[str, int], ...]]:
    """(router and expert-bias params, 3-D expert weights) of one MoE block. The router is a bare weight
    (Qwen's `gate`, gpt-oss's `router` with a bias), not an nn.Linear: bitsandbytes leaves it as loaded;
    Llama 4's is an nn.Linear subclass, which bitsandbytes (`type(m) is nn.Linear`) leaves as loaded too."""
    h, e, i = fig.hidden_size, fig.num_experts, fig.expert_intermediate
    weights = ((f"{p}.experts.gate_up_proj", e * 2 * i * h), (f"{p}.experts.down_proj", e * h * i))
    if fig.traits.router == "topk_softmax":  # gpt-oss: router bias, expert biases in the compute dtype
        params = [(f"{p}.router.weight", e * h), (f"{p}.router.bias", e)]
        params += [(f"{p}.experts.gate_up_proj_bias", e * 2 * i), (f"{p}.experts.down_proj_bias", e * h)]
        return params, weights
    if fig.traits.router == "sigmoid":
        return [(f"{p}.router.weight", e * h)], weights
    return [(f"{p}.gate.weight", e * h)], weights
