"""The planner's parameter inventory as plain records: the blocks the loader places (decoder layers,
embeddings, norms, lm_head), each with its linears, other parameters, buffers and MoE expert weights.
Built from figures (layers.py) or from the meta model (figures.py); read by components.py."""

from __future__ import annotations

from dataclasses import dataclass

OUTPUT_HEAD = "lm_head"  # the output embeddings, in a causal LM and a vision-language model alike


@dataclass(frozen=True)
class Linear:
    name: str  # full module name, e.g. model.layers.3.self_attn.q_proj
    in_features: int
    out_features: int
    bias: bool

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class Block:
    """A module the loader places as a whole: a decoder layer, the embeddings, a norm, lm_head."""

    name: str
    linears: tuple[Linear, ...] = ()
    params: tuple[tuple[str, int], ...] = ()  # non-linear params: (full name, numel)
    buffers: tuple[tuple[str, int, int], ...] = ()  # (full name, numel, bytes/elem; 0 = load dtype)
    embeddings: tuple[tuple[str, int, int], ...] = ()  # (module name, num_embeddings, dim)
    is_layer: bool = False
    tied_to: str | None = None  # lm_head of a tied model: its weight is the embedding's
    # fused 3-D MoE expert weights (full name, numel): NF4/FP4 under quant.experts=4bit (model/moe_experts.py)
    experts: tuple[tuple[str, int], ...] = ()
    # what a decoder layer mixes tokens with: its layer type ("full_attention", "sliding_attention",
    # "chunked_attention", "linear_attention": Qwen3.5's Gated DeltaNet); "" where the family has one kind
    mixer: str = ""
    l2_qk_norm: bool = False  # q and k through a weightless L2 norm (Llama 4's RoPE layers)
    head_dim: int = 0  # its attention's head_dim and kv heads where they are not the model's (Gemma 4's global layers)
    kv_heads: int = 0
