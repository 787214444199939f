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


# Qwen2_5_VLVisionConfig's defaults (transformers 5.23)
QWEN2_5_VL_VISION = {
    "model_type": "qwen2_5_vl",
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 4,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}


def qwen2_5_vl_tower(vc: dict[str, Any], p: str) -> Tower:
    """Qwen2.5-VL's tower: a bias-free Conv3d patch embedding, blocks of RMSNorms, a fused qkv and a gated
    MLP (all with biases), and its merger (an RMSNorm, two linears over merge^2 patches)."""
    h, inter, wide = vc["hidden_size"], vc["intermediate_size"], vc["hidden_size"] * vc["spatial_merge_size"] ** 2
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    blocks = [Block(f"{p}.patch_embed.proj", params=((f"{p}.patch_embed.proj.weight", h * patch),))]
    blocks += [_qwen2_5_vl_block(f"{p}.blocks.{i}", h, inter) for i in range(vc["depth"])]
    m = f"{p}.merger"
    merger = (Linear(f"{m}.mlp.0", wide, wide, True), Linear(f"{m}.mlp.2", wide, vc["out_hidden_size"], True))
    blocks.append(Block(m, merger, ((f"{m}.ln_q.weight", h),) + biases(merger)))
    return blocks, linears_of(blocks)


def _qwen2_5_vl_block(p: str, h: int, inter: int) -> Block:
    linears = (Linear(f"{p}.attn.qkv", h, 3 * h, True), Linear(f"{p}.attn.proj", h, h, True))
    linears += tuple(Linear(f"{p}.mlp.{n}", h, inter, True) for n in ("gate_proj", "up_proj"))
    linears += (Linear(f"{p}.mlp.down_proj", inter, h, True),)
    params = ((f"{p}.norm1.weight", h), (f"{p}.norm2.weight", h))
    return Block(p, linears, params + biases(linears), is_layer=True)


# Qwen3VLVisionConfig's defaults (transformers 5.23)
QWEN3_VL_VISION = {
    "model_type": "qwen3_vl_vision",
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}
QWEN3_VL_SIZES = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size")
QWEN3_VL_SIZES += ("spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings")


def qwen3_vl_tower(vc: dict[str, Any], p: str) -> Tower:
    """Qwen3VLVisionModel's blocks: a Conv3d patch embedding (with a bias), a learned position grid, the
    axial rotary embedding's fp32 buffers, blocks of LayerNorms, a fused qkv and an MLP (all with biases),
    the merger (a LayerNorm, two linears over merge^2 patches) and a merger per deepstack layer (its norm
    after the shuffle)."""
    h, inter = vc["hidden_size"], vc["intermediate_size"]
    wide, n = h * vc["spatial_merge_size"] ** 2, vc["num_position_embeddings"]
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    e, r = f"{p}.patch_embed.proj", f"{p}.rotary_pos_emb"
    spatial = h // vc["num_heads"] // 2  # half the head's dim for each of rows and columns
    freqs = len(range(0, spatial, 2))
    blocks = [
        Block(e, params=((f"{e}.weight", h * patch), (f"{e}.bias", h))),
        Block(f"{p}.pos_embed", params=((f"{p}.pos_embed.weight", n * h),), embeddings=((f"{p}.pos_embed", n, h),)),
        Block(r, buffers=((f"{r}.inv_freq", freqs, 4), (f"{r}.original_inv_freq", freqs, 4))),
    ]
    blocks += [_qwen3_vl_block(f"{p}.blocks.{i}", h, inter) for i in range(vc["depth"])]
    blocks.append(_merger(f"{p}.merger", h, wide, vc["out_hidden_size"]))
    for i in range(len(vc["deepstack_visual_indexes"])):
        blocks.append(_merger(f"{p}.deepstack_merger_list.{i}", wide, wide, vc["out_hidden_size"]))
    return blocks, linears_of(blocks)


def _qwen3_vl_block(p: str, h: int, inter: int) -> Block:
    linears = (Linear(f"{p}.attn.qkv", h, 3 * h, True), Linear(f"{p}.attn.proj", h, h, True))
    linears += (Linear(f"{p}.mlp.linear_fc1", h, inter, True), Linear(f"{p}.mlp.linear_fc2", inter, h, True))
    return Block(p, linears, biases(linears) + norm(f"{p}.norm1", h) + norm(f"{p}.norm2", h), is_layer=True)


def _merger(p: str, normed: int, wide: int, out: int) -> Block:
    """A patch merger: its LayerNorm over each patch (normed = hidden) or the shuffled patches (= wide)."""
    linears = (Linear(f"{p}.linear_fc1", wide, wide, True), Linear(f"{p}.linear_fc2", wide, out, True))
    return Block(p, linears, norm(f"{p}.norm", normed) + biases(linears))


# MllamaVisionConfig's defaults (transformers 5.23; its __post_init__ fills the two lists)
MLLAMA_VISION = {
    "model_type": "mllama_vision_model",
    "hidden_size": 1280,
    "hidden_act": "gelu",
    "num_hidden_layers": 32,
    "num_global_layers": 8,
    "attention_heads": 16,
    "num_channels": 3,
    "intermediate_size": 5120,
    "vision_output_dim": 7680,
    "image_size": 448,
    "patch_size": 14,
    "norm_eps": 1e-5,
    "max_num_tiles": 4,
    "intermediate_layers_indices": [3, 7, 15, 23, 30],
    "supported_aspect_ratios": [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]],
}
MLLAMA_SIZES = SIZES + ("num_global_layers", "attention_heads", "max_num_tiles", "vision_output_dim")


def mllama_tower(vc: dict[str, Any], p: str) -> Tower:
    """MllamaVisionModel's blocks: the model's own parameters (a class embedding, a bias-free patch
    convolution, the gated position and per-tile embeddings, one row per supported aspect ratio and one
    for none, two LayerNorms), its local encoder layers and its gated global ones."""
    h, inter, patch, tiles = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"], vc["max_num_tiles"]
    patches, ratios = (vc["image_size"] // patch) ** 2 + 1, len(vc["supported_aspect_ratios"]) + 1
    g = f"{p}.gated_positional_embedding"
    params = ((f"{p}.class_embedding", h), (f"{p}.patch_embedding.weight", h * vc["num_channels"] * patch * patch))
    params += (
        (f"{g}.gate", 1),
        (f"{g}.embedding", patches * h),
        (f"{g}.tile_embedding.weight", ratios * tiles * patches * h),
    )
    embeddings = [(f"{g}.tile_embedding", ratios, tiles * patches * h)]
    for t in ("pre_tile_positional_embedding", "post_tile_positional_embedding"):
        params += ((f"{p}.{t}.gate", 1), (f"{p}.{t}.embedding.weight", ratios * tiles * h))
        embeddings.append((f"{p}.{t}.embedding", ratios, tiles * h))
    params += norm(f"{p}.layernorm_pre", h) + norm(f"{p}.layernorm_post", h)
    blocks = [Block(p, params=params, embeddings=tuple(embeddings))]
    blocks += [_mllama_layer(f"{p}.transformer.layers.{i}", h, inter, False) for i in range(vc["num_hidden_layers"])]
    blocks += [
        _mllama_layer(f"{p}.global_transformer.layers.{i}", h, inter, True) for i in range(vc["num_global_layers"])
    ]
    return blocks, linears_of(blocks)


def _mllama_layer(p: str, h: int, inter: int, gated: bool) -> Block:
    """A vision encoder layer: bias-free q/k/v/o, an MLP with biases, two LayerNorms; a global layer's two
    tanh gates too."""
    linears = [Linear(f"{p}.self_attn.{n}", h, h, False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += _mlp(f"{p}.mlp", h, inter)
    params = biases(linears) + norm(f"{p}.input_layernorm", h) + norm(f"{p}.post_attention_layernorm", h)
    params += ((f"{p}.gate_attn", 1), (f"{p}.gate_ffn", 1)) if gated else ()
    return Block(p, tuple(linears), params, is_layer=True)
