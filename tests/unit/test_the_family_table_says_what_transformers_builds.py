"""Each family's traits in qlora_recipes/families.py are what transformers 5.23 builds for it: a tiny model
of every family (tests/helpers_families.py) on the meta device shows its attention support, its tied
embeddings default, its norms, biases, experts, sinks, linear-attention layers and per-layer embeddings,
and `known` families have no part beyond what their traits name (the planner inventories those)."""

import pytest
from helpers_families import FAMILY_CONFIGS, tiny_config

from qlora_recipes.families import FAMILIES, KNOWN_ARCHITECTURES, traits

MODEL_TYPES = sorted(FAMILY_CONFIGS)


def _meta(model_type: str):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(tiny_config(model_type))


def _names(model) -> set[str]:
    return {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_traits_are_what_the_model_class_builds(model_type):
    from qlora_recipes.model.lean_rmsnorm import llama_form
    from qlora_recipes.model.moe_experts import expert_weights

    t, model = traits(model_type), _meta(model_type)
    config, names = model.config, _names(model)
    modules = dict(model.named_modules())
    assert t is not FAMILIES.get("no such family") and model_type in FAMILIES
    assert (t.attention == "eager") is (not type(model)._supports_sdpa)
    assert t.tie_embeddings is type(config)().tie_word_embeddings
    assert t.llama_rmsnorm is any(llama_form(m) for m in modules.values())
    assert t.qk_norm is any(n.endswith((".q_norm", ".qk_norm")) for n in modules)
    assert t.sandwich_norms is any("pre_feedforward_layernorm" in n for n in names)
    assert t.embed_scale is any(n.endswith("embed_tokens.embed_scale") for n in names)
    assert t.attention_sinks is any(n.endswith("self_attn.sinks") for n in names)
    assert t.moe is any(expert_weights(m) for m in modules.values()) is bool(t.router)
    assert t.shared_experts is any("shared_expert." in n for n in names)
    assert t.linear_attention is any(".linear_attn." in n for n in names)
    assert t.per_layer_embeddings is any("embed_tokens_per_layer" in n for n in names)
    assert t.nope_layers is ("no_rope_layers" in config.to_dict())
    local = {"sliding_attention", "chunked_attention"} & set(config.to_dict().get("layer_types") or [])
    assert bool(t.local_attention) is bool(local)
    q = [m for n, m in modules.items() if n.endswith("self_attn.q_proj")]
    gated = q[0].out_features == 2 * config.num_attention_heads * config.head_dim
    assert t.attn_output_gate is gated


LLAMA_LAYER = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
    *(f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")),
}


@pytest.mark.parametrize("model_type", sorted(set(KNOWN_ARCHITECTURES) & set(FAMILY_CONFIGS)))
def test_known_families_have_only_the_parts_their_traits_name(model_type):
    """What the planner inventories from figures alone (planner/layers.py, family_layers.py): a layer of
    Llama's parts (Gemma's four norms beside them) and what each trait adds (q/k norms, sinks, routers and
    fused experts, shared experts, Gated DeltaNet layers, per-layer inputs), nothing else."""
    t, model = traits(model_type), _meta(model_type)
    layer = {n.split(".layers.", 1)[1].split(".", 1)[1] for n, _ in model.named_parameters() if ".layers." in n}
    allowed = set(LLAMA_LAYER)
    if t.sandwich_norms:
        allowed |= {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
    if t.qk_norm:
        allowed |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    if t.attention_sinks:
        allowed.add("self_attn.sinks")
    mlp = "feed_forward" if t.router == "sigmoid" else "mlp"  # Llama 4's
    if t.moe:
        allowed |= {f"{mlp}.experts.{w}{b}" for w in ("gate_up_proj", "down_proj") for b in ("", "_bias")}
        allowed |= {"mlp.gate.weight", "mlp.router.weight", "mlp.router.bias", "feed_forward.router.weight"}
    if t.shared_experts:
        allowed |= {f"{mlp}.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")}
        allowed |= {"mlp.shared_expert_gate.weight"} if mlp == "mlp" else set()
    if t.router == "sigmoid":  # Llama 4's dense layers name their MLP feed_forward too
        allowed |= {f"feed_forward.{p}_proj.weight" for p in ("gate", "up", "down")}
    if t.linear_attention:
        own = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight")
        allowed |= {f"linear_attn.{p}" for p in (*own, "conv1d.weight", "dt_bias", "A_log", "norm.weight")}
    if t.per_layer_embeddings:
        own = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")
        allowed |= {f"{p}.weight" for p in own}
    assert layer <= allowed, layer - allowed
    q = [m for n, m in model.named_modules() if n.endswith("self_attn.q_proj")][0]
    assert (q.out_features == 2 * model.config.num_attention_heads * model.config.head_dim) is t.attn_output_gate


def test_the_default_lora_skips_a_linear_whose_forward_is_its_own():
    """Llama 4's router is an nn.Linear whose forward returns (scores, logits): peft's LoRA, which adds its
    output to the base layer's, cannot wrap it; the attention and shared-expert linears take LoRA."""
    from qlora_recipes.model.moe_experts import linear_targets, plain_linear

    model = _meta("llama4_text")
    router = next(m for n, m in model.named_modules() if n.endswith("feed_forward.router"))
    assert not plain_linear(router)
    targets = linear_targets(model)
    assert "router" not in targets and {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(targets)
