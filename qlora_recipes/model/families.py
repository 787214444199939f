"""What sets one model family apart, in one table that the loader and the planner both ask.

A family is transformers' `model_type` (conf/model's `architecture`, a config.json's `model_type`).
Adding one is one entry in FAMILIES: the traits below where it differs from Llama's. The planner then
inventories it from its figures (planner/figures.py builds Llama-shaped decoder layers: q/k/v/o and
gate/up/down projections, RMSNorms, rotary embeddings); a family shaped otherwise (MoE, fused qkv)
stays out of the table, and the planner sizes it from the model transformers builds on the meta
device. Imports nothing heavy: the planner's one-device path never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTraits:
    """The traits of one family as transformers 5.23 builds it; the defaults are Llama's."""

    # What the sdpa default of model.attn_implementation becomes: "eager" where sdpa cannot apply the
    # family's attention (Gemma 2's attention-logit soft-capping; its class has `_supports_sdpa = False`).
    attention: str = "sdpa"
    attn_logit_softcap: bool = False  # tanh soft-capping of attention scores (eager keeps its output too)
    final_logit_softcap: bool = False  # tanh soft-capping of the LM head's logits (the loss applies it per tile)
    sandwich_norms: bool = False  # pre/post feed-forward RMSNorms beside the two of Llama: 4 per layer
    embed_scale: bool = False  # embeddings scaled by sqrt(hidden) through a 0-dim buffer in the load dtype
    tie_embeddings: bool = False  # its config class's tie_word_embeddings default (config.json may omit it)
    qkv_bias: bool = False  # q/k/v projections always carry a bias (Qwen2)
    config_biases: bool = False  # config.json's attention_bias / mlp_bias apply (else no biases)
    # its RMSNorm is weight * normed.to(dtype), as LlamaRMSNorm (model/lean_rmsnorm.py); Gemma 2's: (1 + weight)
    llama_rmsnorm: bool = True
    known: bool = True  # in the table: Llama-shaped, inventoried from its figures without torch


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(config_biases=True),
    "mistral": FamilyTraits(),
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
    ),
}
KNOWN_ARCHITECTURES = tuple(FAMILIES)

# A family not in the table: nothing assumed beyond transformers' PretrainedConfig defaults (tied
# embeddings); the loader asks the model class about sdpa, the planner the meta model about layers.
UNKNOWN = FamilyTraits(tie_embeddings=True, known=False)


def traits(architecture: str) -> FamilyTraits:
    """The traits of `architecture` (a model_type, any case); UNKNOWN for a family not in the table."""
    return FAMILIES.get(str(architecture).lower(), UNKNOWN)
