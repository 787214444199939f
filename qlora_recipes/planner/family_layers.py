"""The parts of the newer families' layers that a Llama-shaped layer lacks, from their figures alone, as
transformers 5.23 builds them: Qwen3.5's Gated DeltaNet (linear attention) and its gated attention output,
Gemma 4's per-layer input embeddings, global layers and shared k/v, and Llama 4's feed-forward (MoE with a
shared expert, or a dense MLP). config.json keys are read with their config classes' defaults, so an
entry that leaves one out is planned as transformers would build it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..families import traits
from .blocks import Linear

# Qwen3_5TextConfig's Gated DeltaNet figures: config.json key -> (Figures field, its default)
_LINEAR = {
    "linear_num_key_heads": ("linear_k_heads", 16),
    "linear_num_value_heads": ("linear_v_heads", 32),
    "linear_key_head_dim": ("linear_k_dim", 128),
    "linear_value_head_dim": ("linear_v_dim", 128),
    "linear_conv_kernel_dim": ("linear_conv_kernel", 4),
}


# The config classes' defaults (transformers 5.23) for keys the planner reads that config.json may leave
# out, by model_type (a text config's own, or the checkpoint's when its text_config names none): a
# Qwen3 config without head_dim builds 128-wide heads, not hidden_size / heads
_MLLAMA_CROSS = [3, 8, 13, 18, 23, 28, 33, 38]  # MllamaTextConfig's cross_attention_layers
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    **dict.fromkeys(("qwen3", "qwen3_vl", "qwen3_vl_text", "llama4", "llama4_text"), {"head_dim": 128}),
    **dict.fromkeys(
        ("gemma2", "gemma3", "gemma3_text", "gemma4_text", "qwen3_5_text", "qwen3_5_moe_text"), {"head_dim": 256}
    ),
    "gpt_oss": {"head_dim": 64},
    **dict.fromkeys(("mllama", "mllama_text_model"), {"cross_attention_layers": _MLLAMA_CROSS}),
}


def with_config_defaults(arch: str, cj: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's keys with its config class's defaults (CONFIG_DEFAULTS) where it leaves one of those out
    or null; every other key as it is (a null final_logit_softcapping means no cap)."""
    return {**cj, **{k: v for k, v in CONFIG_DEFAULTS.get(arch, {}).items() if cj.get(k) is None}}


def _rope_value(cj: Mapping[str, Any], key: str, default: Any) -> Any:
    rope = cj.get("rope_parameters") or cj.get("rope_scaling") or {}
    return rope.get(key, cj.get(key, default)) if isinstance(rope, Mapping) else cj.get(key, default)


def new_family_figures(arch: str, cj: Mapping[str, Any]) -> dict[str, Any]:
    """The Figures fields of Qwen3.5's, Gemma 4's and Llama 4's own layers, and cross-attention layers
    (mllama's), from config.json keys."""
    family, layers = traits(arch), int(cj.get("num_hidden_layers") or 0)
    out: dict[str, Any] = {}
    if family.linear_attention:  # every 4th layer full attention unless layer_types says otherwise
        out.update({field: int(cj.get(key) or default) for key, (field, default) in _LINEAR.items()})
        every = int(cj.get("full_attention_interval") or 4)
        default = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
        out["layer_types"] = tuple(str(t) for t in cj.get("layer_types") or default)
        out["rotary_fraction"] = float(_rope_value(cj, "partial_rotary_factor", 0.25))
        if family.moe:  # Qwen3_5MoeTextConfig's shared expert unless config.json says otherwise
            out["shared_expert_intermediate"] = int(cj.get("shared_expert_intermediate_size") or 512)
    if family.per_layer_embeddings:
        out.update(_gemma4_figures(cj, layers))
    if cj.get("cross_attention_layers"):  # by shape: layers that cross-attend to image features (mllama)
        # an index past the last layer builds no layer (a default list on a shallower model)
        cross = {int(i) for i in cj["cross_attention_layers"]}
        out["cross_attention_layers"] = tuple(sorted(i for i in cross if i < layers or not layers))
    if family.local_attention == "chunked":  # Llama 4: MoE layers every interleave_moe_layer_step-th
        step = int(cj.get("interleave_moe_layer_step") or 1)
        moe = cj.get("moe_layers")
        out["moe_layers"] = tuple(int(i) for i in (range(step - 1, layers, step) if moe is None else moe))
        out["dense_intermediate"] = int(cj.get("intermediate_size_mlp") or 16384)
        out["l2_norm_layers"] = _l2_norm_layers(cj, layers)
    return out


def _l2_norm_layers(cj: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """Llama4TextConfig's RoPE layers (no_rope_layers: 1 where a layer rotates; by default all but every
    no_rope_layer_interval-th), where use_qk_norm puts an L2 norm over q and k (none without it)."""
    if not cj.get("use_qk_norm", True):
        return ()
    every = int(cj.get("no_rope_layer_interval") or 4)
    rotates = cj.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(layers)]
    return tuple(i for i, r in enumerate(rotates) if r)


def _gemma4_figures(cj: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Gemma4TextConfig's figures: 5 local layers to 1 global by default, the last one global; a global
    layer's head_dim (and, with keys as values, its kv heads) its own; an MoE block beside the MLP."""
    types = [str(t) for t in cj.get("layer_types") or ()]
    if not types:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types[-1:] = ["full_attention"] if types else []
    k_eq_v = bool(cj.get("attention_k_eq_v", False))
    head_dim, kv = int(cj.get("global_head_dim") or 512), (cj.get("num_global_key_value_heads") if k_eq_v else None)
    overrides = cj.get("per_layer_config")
    if isinstance(overrides, Mapping):  # a saved config's own overrides of its global layers (none: {})
        full = next((v for v in overrides.values() if isinstance(v, Mapping)), {})
        head_dim, kv = int(full.get("head_dim") or 0), full.get("num_key_value_heads")
    out = {
        "layer_types": tuple(types),
        "sliding_window": int(cj.get("sliding_window") or 512),
        "per_layer_input": int(cj.get("hidden_size_per_layer_input", 256) or 0),
        "per_layer_vocab": int(cj.get("vocab_size_per_layer_input") or 262_144),
        "global_head_dim": head_dim,
        "global_kv_heads": int(kv or 0),
        "kv_shared_layers": int(cj.get("num_kv_shared_layers") or 0),
        "k_eq_v": k_eq_v,
        "double_wide_mlp": bool(cj.get("use_double_wide_mlp", False)),
    }
    if cj.get("enable_moe_block"):  # the experts run beside the dense MLP: every token takes that too
        out.update(num_experts=int(cj["num_experts"]), experts_per_token=int(cj["top_k_experts"]))
        out.update(expert_intermediate=int(cj["moe_intermediate_size"]))
        out["shared_expert_intermediate"] = int(cj.get("intermediate_size") or 0)
        out["moe_layers"] = tuple(range(layers))
    return out


def gated_delta_net(fig: Any, p: str) -> tuple[list[Linear], list[tuple[str, int]]]:
    """(linears, params) of a Qwen3_5GatedDeltaNet: the q/k/v projection into the causal conv, z (the
    output gate), b (beta) and a (the decay), the depthwise conv1d over q/k/v, A_log and dt_bias per value
    head, the gated RMSNorm over a value head, out_proj."""
    h, hv = fig.hidden_size, fig.linear_v_heads
    kd, vd = fig.linear_k_heads * fig.linear_k_dim, hv * fig.linear_v_dim
    p = f"{p}.linear_attn"
    linears = [
        Linear(f"{p}.in_proj_qkv", h, 2 * kd + vd, False),
        Linear(f"{p}.in_proj_z", h, vd, False),
        Linear(f"{p}.in_proj_b", h, hv, False),
        Linear(f"{p}.in_proj_a", h, hv, False),
        Linear(f"{p}.out_proj", vd, h, False),
    ]
    params = [
        (f"{p}.conv1d.weight", (2 * kd + vd) * fig.linear_conv_kernel),
        (f"{p}.dt_bias", hv),
        (f"{p}.A_log", hv),
        (f"{p}.norm.weight", fig.linear_v_dim),
    ]
    return linears, params


def layer_heads(fig: Any, i: int) -> tuple[int, int]:
    """(head_dim, kv heads) of layer i: Gemma 4's global layers have their own head_dim (and kv heads
    when keys are values), the others the model's."""
    if fig.global_head_dim and fig.layer_types[i] == "full_attention":
        return fig.global_head_dim, fig.global_kv_heads or fig.num_kv_heads
    return fig.head_dim, fig.num_kv_heads


def kv_shared(fig: Any, i: int) -> bool:
    """Gemma 4's last num_kv_shared_layers layers reuse an earlier layer's k/v: no k/v projections."""
    return i >= fig.num_layers - fig.kv_shared_layers


def gemma4_extras(fig: Any, p: str, i: int) -> tuple[list[Linear], list[tuple[str, int]]]:
    """(linears, params) Gemma 4 adds to a layer: the per-layer input's gate and projection and their
    norm, the router (a norm, a linear, its scales) and the three norms of an MoE block."""
    h, linears, params = fig.hidden_size, [], []
    if fig.per_layer_input:
        linears += [
            Linear(f"{p}.per_layer_input_gate", h, fig.per_layer_input, False),
            Linear(f"{p}.per_layer_projection", fig.per_layer_input, h, False),
        ]
        params.append((f"{p}.post_per_layer_input_norm.weight", h))
    if fig.num_experts and i in fig.moe_layers:
        linears.append(Linear(f"{p}.router.proj", h, fig.num_experts, False))
        params += [(f"{p}.router.scale", h), (f"{p}.router.per_expert_scale", fig.num_experts)]
        norms = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")
        params += [(f"{p}.{n}.weight", h) for n in norms]
    return linears, params


def gemma4_mlp_width(fig: Any, i: int) -> int:
    """A shared-k/v layer's MLP is twice as wide under use_double_wide_mlp."""
    return fig.intermediate_size * (2 if fig.double_wide_mlp and kv_shared(fig, i) else 1)


def per_layer_embeddings(fig: Any) -> tuple[list[Linear], list[tuple[str, int]], list[tuple[str, int, int]]]:
    """Gemma 4's model-level per-layer input: a second table (vocab_size_per_layer_input x layers*width)
    with its 0-dim scale, the projection of the embeddings to layers*width and its norm."""
    h, width = fig.hidden_size, fig.num_layers * fig.per_layer_input
    linears = [Linear("model.per_layer_model_projection", h, width, False)]
    params = [("model.embed_tokens_per_layer.weight", fig.per_layer_vocab * width)]
    params.append(("model.per_layer_projection_norm.weight", fig.per_layer_input))
    return linears, params, [("model.embed_tokens_per_layer", fig.per_layer_vocab, width)]


def saved_per_token(fig: Any, mixer: str, qd: int, kvd: int, r: int) -> int:
    """What a layer's family-own parts keep for backward per token (r: residual bytes). Qwen3.5's gated
    attention: the 2x-wide q_proj output (q_norm's input is a view of it), sigmoid(gate), the gated
    output o_proj reads, k_norm's input. Gemma 4's per-layer input: the gate's output, its activation,
    the layer's slice of the per-layer inputs, the fp32 input and rsqrt of its norm."""
    out = r * (4 * qd + kvd) if fig.traits.attn_output_gate and mixer != "linear_attention" else 0
    return out + (3 * r * fig.per_layer_input + 4 * fig.hidden_size + 4 if fig.per_layer_input else 0)


def head_norms_saved_per_token(fig: Any, block: Any, heads: tuple[int, int, int], r: int, lean: bool) -> int:
    """What a layer's per-head q/k norms keep for backward per token (names: the layer's parameter names;
    heads: head_dim, q heads, kv heads): each its input as the fp32 copy its `.float()` makes and a 4-byte
    rsqrt per head (Gemma 4's pow-based norm: the mean square and its power, 8 bytes), Gemma 4's weightless
    v_norm beside its k_norm; a Llama-form norm under trainer.lean_rmsnorm keeps its r-byte input instead
    (the q/k projections' output dtype). Qwen3.5's gated attention counts its own (saved_per_token).
    Llama 4's weightless L2 norm (Llama4TextL2Norm, on its RoPE layers) keeps the same: x.float() for
    pow and the product, the rsqrt per head (block: planner.blocks.Block)."""
    if fig.traits.attn_output_gate:
        return 0
    d, a, kv = heads
    if block.l2_qk_norm:
        return (a + kv) * (4 * d + 4)
    names = [n for n, _ in block.params]
    width = r if lean and fig.traits.llama_rmsnorm else 4
    row = 8 if fig.traits.per_layer_embeddings else 4
    rows = sum(a for n in names if n.endswith(".q_norm.weight"))
    rows += sum(kv * (2 if fig.traits.per_layer_embeddings else 1) for n in names if n.endswith(".k_norm.weight"))
    return rows * (width * d + row)


def sink_renorm_per_token(fig: Any, c: int) -> int:
    """Attention sinks beside a fused kernel (flex attention; transformers renormalises the kernel's output
    by the sinks after it, from its log-sum-exp): per head, the lse cast to the compute dtype, it and the
    sink as an fp32 pair, their logsumexp and exp, and the kernel's second fp32 row beside the lse (bench
    trace, gpt-oss-20b: 22 bytes a head at c = 2). The renormalised output is a copy o_proj reads."""
    return (c + 20) * fig.num_heads if fig.traits.attention_sinks else 0


def shared_bytes(fig: Any, tokens: int, r: int) -> int:
    """Gemma 4's per-layer inputs of all layers, read by each: its projection's normed fp32 input, the sum."""
    return tokens * fig.num_layers * fig.per_layer_input * (4 + r)


def config_keys(fig: Any) -> dict[str, Any]:
    """The config.json keys of these figures' own layers, for a transformers config built from them
    (figures.hf_config): the inverse of new_family_figures."""
    out: dict[str, Any] = {}
    if fig.linear_v_heads:
        out.update({key: getattr(fig, field) for key, (field, _) in _LINEAR.items()})
        out.update(layer_types=list(fig.layer_types), partial_rotary_factor=fig.rotary_fraction)
    if fig.traits.per_layer_embeddings:
        out.update(layer_types=list(fig.layer_types), sliding_window=fig.sliding_window)
        out.update(hidden_size_per_layer_input=fig.per_layer_input, vocab_size_per_layer_input=fig.per_layer_vocab)
        out.update(global_head_dim=fig.global_head_dim or fig.head_dim, attention_k_eq_v=fig.k_eq_v)
        out.update(num_global_key_value_heads=fig.global_kv_heads or None, num_kv_shared_layers=fig.kv_shared_layers)
        out.update(use_double_wide_mlp=fig.double_wide_mlp, enable_moe_block=bool(fig.num_experts))
        if fig.num_experts:
            out.update(top_k_experts=fig.experts_per_token)
    if fig.traits.router == "sigmoid":
        out.update(moe_layers=list(fig.moe_layers), intermediate_size_mlp=fig.dense_intermediate)
        out.update(intermediate_size=fig.expert_intermediate, use_qk_norm=bool(fig.l2_norm_layers))
        if fig.l2_norm_layers:
            out["no_rope_layers"] = [int(i in fig.l2_norm_layers) for i in range(fig.num_layers)]
    if fig.cross_attention_layers:
        out["cross_attention_layers"] = list(fig.cross_attention_layers)
    if fig.shared_expert_intermediate and fig.traits.shared_experts:
        out["shared_expert_intermediate_size"] = fig.shared_expert_intermediate
    return out
