"""The vision towers and projectors of planner/vlm_layout.py's families, as transformers 5.23 builds them:
each a list of blocks in module order (planner/blocks.py) from a vision_config with its class's defaults
filled in, and the (in, out) of every nn.Linear in the tower (what model.vision_tower quantizes or adapts)."""

from __future__ import annotations

from typing import Any

from .blocks import Block, Linear

# SiglipVisionConfig's defaults: Gemma 3's and a LLaVA's SigLIP tower where its vision_config leaves them out
SIGLIP_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0,
    "vision_use_head": True,
}
# CLIPVisionConfig's defaults: a LLaVA's CLIP tower where its vision_config leaves them out
CLIP_VISION = {
    "model_type": "clip_vision_model",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0,
}
# LlavaConfig's tower when config.json has no vision_config: CLIP-L/14 at 336 px
LLAVA_DEFAULT_TOWER = {
    **CLIP_VISION,
    "intermediate_size": 4096,
    "hidden_size": 1024,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "vocab_size": 32000,
    "projection_dim": 768,
}
# Idefics3VisionConfig's (and SmolVLMVisionConfig's) defaults: a SigLIP without the pooling head
IDEFICS3_VISION = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0,
}
SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_channels", "image_size", "patch_size")

Tower = tuple[list[Block], tuple[tuple[int, int], ...]]


def sized(vc: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """Every one of `keys` a positive integer: a size given as a pair is left to the meta model."""
    return all(isinstance(vc.get(k), int) and not isinstance(vc[k], bool) and vc[k] > 0 for k in keys)


def linears_of(blocks: list[Block]) -> tuple[tuple[int, int], ...]:
    return tuple((lin.in_features, lin.out_features) for b in blocks for lin in b.linears)


def siglip_tower(vc: dict[str, Any], p: str) -> Tower:
    """SiglipVisionModel's blocks (the patch and position embeddings, the encoder layers, the post-norm,
    the attention-pooling head under vision_use_head) and its linears' (in, out), in module order."""
    h, inter = vc["hidden_size"], vc["intermediate_size"]
    blocks = [_embeddings(vc, f"{p}.embeddings", position_ids=True)]
    blocks += [encoder_layer(f"{p}.encoder.layers.{i}", h, inter) for i in range(vc["num_hidden_layers"])]
    linears = linears_of(blocks)
    blocks.append(Block(f"{p}.post_layernorm", params=norm(f"{p}.post_layernorm", h)))
    if vc["vision_use_head"]:
        blocks.append(_siglip_head(f"{p}.head", h, inter))
        linears += ((h, h),) + linears_of(blocks[-1:])  # the MultiheadAttention's out_proj, then the MLP
    return blocks, linears


def clip_tower(vc: dict[str, Any], p: str) -> Tower:
    """CLIPVisionModel's blocks: the embeddings (a class embedding, a bias-free patch convolution, a
    position per patch and one for the class token), the pre-norm, the encoder layers, the post-norm."""
    h, inter, patch = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    positions = (vc["image_size"] // patch) ** 2 + 1
    e = f"{p}.embeddings"
    params = ((f"{e}.class_embedding", h), (f"{e}.patch_embedding.weight", h * vc["num_channels"] * patch * patch))
    params += ((f"{e}.position_embedding.weight", positions * h),)
    embeddings = ((f"{e}.position_embedding", positions, h),)
    blocks = [Block(e, params=params, buffers=((f"{e}.position_ids", positions, 8),), embeddings=embeddings)]
    blocks.append(Block(f"{p}.pre_layrnorm", params=norm(f"{p}.pre_layrnorm", h)))
    blocks += [encoder_layer(f"{p}.encoder.layers.{i}", h, inter) for i in range(vc["num_hidden_layers"])]
    blocks.append(Block(f"{p}.post_layernorm", params=norm(f"{p}.post_layernorm", h)))
    return blocks, linears_of(blocks)


def idefics3_tower(vc: dict[str, Any], p: str) -> Tower:
    """Idefics3VisionTransformer's (SmolVLM's): SigLIP's embeddings without a position_ids buffer (positions
    are bucketed per image), its encoder layers and post-norm, no pooling head."""
    h, inter = vc["hidden_size"], vc["intermediate_size"]
    blocks = [_embeddings(vc, f"{p}.embeddings", position_ids=False)]
    blocks += [encoder_layer(f"{p}.encoder.layers.{i}", h, inter) for i in range(vc["num_hidden_layers"])]
    blocks.append(Block(f"{p}.post_layernorm", params=norm(f"{p}.post_layernorm", h)))
    return blocks, linears_of(blocks)


def _embeddings(vc: dict[str, Any], e: str, position_ids: bool) -> Block:
    """SigLIP's patch convolution (with a bias) and a position embedding per patch."""
    h, patch = vc["hidden_size"], vc["patch_size"]
    positions = (vc["image_size"] // patch) ** 2
    params = ((f"{e}.patch_embedding.weight", h * vc["num_channels"] * patch * patch), (f"{e}.patch_embedding.bias", h))
    params += ((f"{e}.position_embedding.weight", positions * h),)
    buffers = ((f"{e}.position_ids", positions, 8),) if position_ids else ()  # int64
    return Block(
        e, params=params, buffers=buffers, embeddings=((f"{e}.position_embedding", positions, h),), is_layer=True
    )


def norm(p: str, h: int) -> tuple[tuple[str, int], ...]:
    """A LayerNorm's weight and bias."""
    return ((f"{p}.weight", h), (f"{p}.bias", h))


def biases(linears: tuple[Linear, ...] | list[Linear]) -> tuple[tuple[str, int], ...]:
    return tuple((f"{lin.name}.bias", lin.out_features) for lin in linears if lin.bias)


def _mlp(p: str, h: int, inter: int) -> list[Linear]:
    return [Linear(f"{p}.fc1", h, inter, True), Linear(f"{p}.fc2", inter, h, True)]


def encoder_layer(p: str, h: int, inter: int) -> Block:
    """A CLIP / SigLIP encoder layer: k, v, q and out projections, the MLP's fc1 and fc2 (all with biases),
    two LayerNorms."""
    linears = [Linear(f"{p}.self_attn.{n}", h, h, True) for n in ("k_proj", "v_proj", "q_proj", "out_proj")]
    linears += _mlp(f"{p}.mlp", h, inter)
    params = biases(linears) + norm(f"{p}.layer_norm1", h) + norm(f"{p}.layer_norm2", h)
    return Block(p, tuple(linears), params, is_layer=True)


def _siglip_head(p: str, h: int, inter: int) -> Block:
    """The attention-pooling head: a probe, torch's MultiheadAttention (its packed in-projection and its
    out_proj, an nn.Linear subclass that bitsandbytes leaves as loaded), a LayerNorm, an MLP."""
    linears = _mlp(f"{p}.mlp", h, inter)
    a = f"{p}.attention"
    params = biases(linears) + ((f"{p}.probe", h), (f"{a}.in_proj_weight", 3 * h * h), (f"{a}.in_proj_bias", 3 * h))
    params += ((f"{a}.out_proj.weight", h * h), (f"{a}.out_proj.bias", h)) + norm(f"{p}.layernorm", h)
    return Block(p, tuple(linears), params, is_layer=True)
