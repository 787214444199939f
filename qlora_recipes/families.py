"""What sets one model family apart, in one table that the config checks, the loader and the planner ask.

A family is transformers' `model_type` (conf/model's `architecture`, a config.json's `model_type`; a
multimodal checkpoint's text model answers to both, gemma3 and gemma3_text). Adding one is one entry
in FAMILIES: the traits below where it differs from Llama's, as transformers 5.23 builds it. `known`
families the planner inventories from their figures (planner/layers.py, planner/family_layers.py: Llama's
layer plus what the traits after `known` add); Gemma 3's and Qwen2.5-VL's multimodal checkpoints it lays
out from their figures and vision_config (planner/vlm_layout.py); the others it sizes from the model
transformers builds on the meta device (another multimodal checkpoint, a family not in the table). On the floor: the config checks, model/ and planner/ all ask it, and it imports nothing
heavy (the planner's one-device path never imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTraits:
    """The traits of one family as transformers 5.23 builds it; the defaults are Llama's."""

    # What the sdpa default of model.attn_implementation becomes: "eager" where sdpa cannot apply the
    # family's attention (Gemma 2's attention-logit soft-capping, gpt-oss's sinks: `_supports_sdpa = False`).
    attention: str = "sdpa"
    attn_logit_softcap: bool = False  # tanh soft-capping of attention scores (eager keeps its output too)
    # its config class soft-caps the LM head's logits by default (config.json's final_logit_softcapping decides)
    final_logit_softcap: bool = False
    sandwich_norms: bool = False  # pre/post feed-forward RMSNorms beside the two of Llama: 4 per layer
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden) through a 0-dim buffer in the load dtype
    tie_embeddings: bool = False  # its config class's tie_word_embeddings default (config.json may omit it)
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2)
    config_biases: bool = False  # config.json's attention_bias / mlp_bias apply (else no biases)
    # its RMSNorm is weight * normed.to(dtype) in LlamaRMSNorm's own code (model/lean_rmsnorm.py patches
    # those); Gemma's and Qwen3.5's are (1 + weight) in fp32, gpt-oss's and Gemma 4's weight the fp32 value
    llama_rmsnorm: bool = True
    known: bool = True  # inventoried from its figures without torch (planner/layers.py, family_layers.py)
    # What a Llama-shaped layer lacks, each counted by the planner's inventory and activations:
    qk_norm: bool = False  # a norm over each head's q and k (a weight of head_dim each; Llama 4's has none)
    local_attention: str = ""  # "sliding": some layers attend within a window; "chunked": within fixed chunks
    nope_layers: bool = False  # some layers apply no rotary embedding (every 4th in SmolLM3 and Llama 4)
    attention_sinks: bool = False  # a learned logit per head beside the keys (gpt-oss): no sdpa path
    attn_output_gate: bool = False  # q_proj also gives a sigmoid gate of the attention output (2x its width)
    linear_attention: bool = False  # linear-attention layers (Qwen3.5's Gated DeltaNet) beside full attention
    moe: bool = False  # MoE MLPs: experts fused into 3-D weights (model/moe_experts.py) and a router linear
    # how the router weighs its top-k: "softmax_topk" (softmax, top-k, renormalised), "topk_softmax" (top-k
    # logits, softmax over them; a router bias), "sigmoid" (Llama 4: top-k logits through a sigmoid)
    router: str = ""
    shared_experts: bool = False  # a dense MLP every token takes beside the routed experts
    # gpt-oss's experts clamp gate and up and gate with a sigmoid: autograd keeps 6 widths of the expert
    # intermediate per routed row (gate_up, the clamped gate, its sigmoid, the glu, up + 1), not 3
    clamped_glu: bool = False
    per_layer_embeddings: bool = False  # a second embedding table feeding each layer (Gemma 4's per-layer input)


_QWEN3 = FamilyTraits(config_biases=True, qk_norm=True)
_QWEN3_5 = FamilyTraits(
    config_biases=True,
    llama_rmsnorm=False,
    qk_norm=True,
    attn_output_gate=True,
    linear_attention=True,
)
_QWEN3_5_MOE = FamilyTraits(**{**vars(_QWEN3_5), "moe": True, "router": "softmax_topk", "shared_experts": True})
_GEMMA3 = FamilyTraits(
    sandwich_norms=True,
    llama_rmsnorm=False,
    embed_scale=True,
    tie_embeddings=True,
    config_biases=True,
    qk_norm=True,
    local_attention="sliding",
)
_GEMMA4 = FamilyTraits(**{**vars(_GEMMA3), "per_layer_embeddings": True})
_LLAMA4 = FamilyTraits(
    config_biases=True,
    llama_rmsnorm=False,
    qk_norm=True,
    local_attention="chunked",
    nope_layers=True,
    moe=True,
    router="sigmoid",
    shared_experts=True,
)

FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(config_biases=True),
    "mistral": FamilyTraits(),
    "mixtral": FamilyTraits(moe=True, router="softmax_topk"),  # Mistral's layer, its MLP 3-D experts
    "qwen2": FamilyTraits(qkv_bias=True),
    "gemma2": FamilyTraits(
        attention="eager",
        attn_logit_softcap=True,
        final_logit_softcap=True,
        sandwich_norms=True,
        llama_rmsnorm=False,
        embed_scale=True,
        tie_embeddings=True,
        config_biases=True,
        local_attention="sliding",
    ),
    "qwen3": _QWEN3,
    "qwen3_moe": FamilyTraits(**{**vars(_QWEN3), "moe": True, "router": "softmax_topk"}),
    "qwen3_5": _QWEN3_5,
    "qwen3_5_text": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5_MOE,
    "qwen3_5_moe_text": _QWEN3_5_MOE,
    # the multimodal checkpoint loads its vision tower too: laid out with it (planner/vlm_layout.py)
    "gemma3": FamilyTraits(**{**vars(_GEMMA3), "known": False}),
    "gemma3_text": _GEMMA3,
    "gemma4": FamilyTraits(**{**vars(_GEMMA4), "known": False}),  # its vision and audio towers too
    # vision-language checkpoints (their vision tower a row of its own): Qwen2.5-VL's language model is
    # Qwen2-shaped (q/k/v biases), Llama-3.2-Vision's (mllama) Llama's with cross-attention layers at
    # config.json's listed indices; both laid out from their figures (planner/vlm_layout.py)
    "qwen2_5_vl": FamilyTraits(qkv_bias=True, known=False),
    "mllama": FamilyTraits(known=False),
    "gemma4_text": _GEMMA4,
    "gpt_oss": FamilyTraits(
        attention="eager",
        config_biases=True,
        llama_rmsnorm=False,
        local_attention="sliding",
        attention_sinks=True,
        moe=True,
        router="topk_softmax",
        clamped_glu=True,
    ),
    "llama4": _LLAMA4,
    "llama4_text": _LLAMA4,
    "smollm3": FamilyTraits(config_biases=True, tie_embeddings=True, nope_layers=True),
}
# the families inventoried from their figures alone
KNOWN_ARCHITECTURES = tuple(name for name, t in FAMILIES.items() if t.known)

# A family not in the table: nothing assumed beyond transformers' PretrainedConfig defaults (tied
# embeddings); the loader asks the model class about sdpa, the planner the meta model about layers.
UNKNOWN = FamilyTraits(tie_embeddings=True, known=False)


def traits(architecture: str) -> FamilyTraits:
    """The traits of `architecture` (a model_type, any case); UNKNOWN for a family not in the table."""
    return FAMILIES.get(str(architecture).lower(), UNKNOWN)


# peft's v4-to-v5 MoE remap (utils/transformers_weight_conversion.py) turns these leaf names into the fused
# experts' parameters and the router's weight (here, not in model/moe_experts.py: the planner reads it
# without loading torch)
V4_EXPERT_NAMES = frozenset({"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})
