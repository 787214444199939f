"""The vision-language checkpoints whose module tree is known, laid out from their figures without a meta
model (no torch, no transformers), as transformers 5.23 builds them:
- Gemma 3 (Gemma3ForConditionalGeneration): its gemma3_text language model under model.language_model
  (layers.py's blocks, renamed), a SigLIP vision tower under model.vision_tower and the projector under
  model.multi_modal_projector, sized from the vision_config of a conf/model entry or of a local dir's
  config.json (whose figures are its text_config's, model_type gemma3_text), each key left out at its
  SiglipVisionConfig default (as Gemma3Config fills it; with no vision_config at all, every key);
- Qwen2.5-VL from a conf/model entry: its Qwen2-shaped language model, its tower and merger under
  model.visual (Qwen2_5_VLVisionConfig's defaults for the keys the entry leaves out).
The other families (and a checkpoint with its own code) keep the meta model (figures.meta_model).
tests/unit/test_vision_language_layouts_are_the_meta_models.py holds each layout to the meta model.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..model.checkpoint import read_config
from .blocks import Block, Linear
from .layers import analytic_inventory

# SiglipVisionConfig's defaults (transformers 5.23): Gemma3Config's tower when its vision_config leaves them out
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
GEMMA3 = {"model_type": "gemma3", "mm_tokens_per_image": 256}  # Gemma3Config's keys the planner reads
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

TEXT = "model.language_model"
TOWER = "model.vision_tower"
VISUAL = "model.visual"  # Qwen2.5-VL's tower, its merger (the projector) inside it
PROJECTOR = "model.multi_modal_projector"


@dataclass(frozen=True)
class VlmLayout:
    """A vision-language model's blocks as from_pretrained names them, and its vision parts' figures."""

    text: tuple[Block, ...]  # the language model's blocks and lm_head
    vision: tuple[Block, ...]  # the vision tower's and projector's blocks, in module order
    prefixes: tuple[str, ...]  # the vision parts' full prefixes (model/vision.vision_prefixes)
    tower_linears: tuple[tuple[int, int], ...]  # (in, out) of every nn.Linear in the tower, subclasses too
    config_json: str  # the config as transformers fills it: its vision_config and the top-level keys read

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)

    @property
    def vision_params(self) -> int:
        """Parameters of the vision tower and projector (linear weights, and every other parameter)."""
        return sum(_numel(b) for b in self.vision)

    def inventory(self, vision_row: bool) -> tuple[Block, ...]:
        """Every block; without the vision parts when planner/vision.py plans them as a row of their own."""
        return self.text if vision_row else self.vision + self.text


@functools.lru_cache(maxsize=16)
def layout(fig: Any) -> VlmLayout | None:
    """The layout of the figures' model when its family's is known (fig: figures.Figures), else None."""
    if fig.architecture == "qwen2_5_vl":
        return _qwen2_5_vl(fig)
    if fig.architecture == "gemma3" or (fig.architecture == "gemma3_text" and _vlm_dir(fig)):
        top, vc = _configs(fig)
        return None if top is None or vc is None else _gemma3(fig, top, vc)
    return None


def _vlm_dir(fig: Any) -> bool:
    """A local dir whose config.json is Gemma 3's VLM: its figures are its text_config's (gemma3_text), and
    from_pretrained builds the whole VLM (model/vision.py), its language model under model.language_model."""
    path = Path(fig.config_dir or "") / "config.json"
    return bool(fig.config_dir) and path.is_file() and read_config(path).get("model_type") == "gemma3"


def _configs(fig: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(top-level keys, vision_config) with Gemma3Config's and SiglipVisionConfig's defaults filled in;
    (None, None) where transformers would build something else (remote code, another vision model)."""
    top: dict[str, Any] = dict(GEMMA3)
    given: Any = json.loads(fig.vision_config_json) if fig.vision_config_json else None
    path = Path(fig.config_dir or "") / "config.json"
    if fig.config_dir and path.is_file():
        cj = read_config(path)
        if cj.get("auto_map"):
            return None, None
        top.update({k: v for k, v in cj.items() if k not in ("text_config", "vision_config")})
        given = cj.get("vision_config")
    given = given if isinstance(given, dict) else {}
    if given.get("model_type", SIGLIP_VISION["model_type"]) != SIGLIP_VISION["model_type"]:
        return None, None
    vc = {**SIGLIP_VISION, **given}
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_channels", "image_size", "patch_size")
    return (top, vc) if _sized(vc, sizes) else (None, None)


def _sized(vc: dict[str, Any], keys: tuple[str, ...]) -> bool:
    """Every one of `keys` a positive integer: a size given as a pair is left to the meta model."""
    return all(isinstance(vc.get(k), int) and not isinstance(vc[k], bool) and vc[k] > 0 for k in keys)


def _gemma3(fig: Any, top: dict[str, Any], vc: dict[str, Any]) -> VlmLayout:
    tower, linears = siglip_tower(vc, TOWER)
    h = vc["hidden_size"]
    projector = Block(
        PROJECTOR,
        params=(
            (f"{PROJECTOR}.mm_input_projection_weight", h * fig.hidden_size),
            (f"{PROJECTOR}.mm_soft_emb_norm.weight", h),
        ),
    )
    text = tuple(_under_text(b) for b in analytic_inventory(fig))
    if _numel(projector) > sum(_numel(b) for b in tower):  # the tower is the part with the most (a tiny model's)
        linears = ()
    config = {**top, "vision_config": vc}
    return VlmLayout(text, (*tower, projector), (TOWER, PROJECTOR), linears, json.dumps(config, sort_keys=True))


def _numel(block: Block) -> int:
    return sum(lin.numel for lin in block.linears) + sum(n for _, n in block.params)


def _under_text(block: Block) -> Block:
    """A text model's block as the VLM names it: model.X -> model.language_model.X (lm_head stays)."""

    def name(n: str) -> str:
        return f"{TEXT}.{n[len('model.') :]}" if n.startswith("model.") else n

    return replace(
        block,
        name=name(block.name),
        linears=tuple(replace(lin, name=name(lin.name)) for lin in block.linears),
        params=tuple((name(n), k) for n, k in block.params),
        buffers=tuple((name(n), k, b) for n, k, b in block.buffers),
        embeddings=tuple((name(n), v, d) for n, v, d in block.embeddings),
        experts=tuple((name(n), k) for n, k in block.experts),
        tied_to=name(block.tied_to) if block.tied_to else None,
    )


def siglip_tower(vc: dict[str, Any], p: str) -> tuple[list[Block], tuple[tuple[int, int], ...]]:
    """SiglipVisionModel's blocks (the patch and position embeddings, the encoder layers, the post-norm,
    the attention-pooling head under vision_use_head) and its linears' (in, out), in module order."""
    h, inter, patch = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    positions = (vc["image_size"] // patch) ** 2
    e = f"{p}.embeddings"
    blocks = [
        Block(
            e,
            params=(
                (f"{e}.patch_embedding.weight", h * vc["num_channels"] * patch * patch),
                (f"{e}.patch_embedding.bias", h),
                (f"{e}.position_embedding.weight", positions * h),
            ),
            buffers=((f"{e}.position_ids", positions, 8),),  # int64
            embeddings=((f"{e}.position_embedding", positions, h),),
            is_layer=True,
        )
    ]
    linears: list[tuple[int, int]] = []
    for i in range(vc["num_hidden_layers"]):
        blocks.append(_siglip_layer(f"{p}.encoder.layers.{i}", h, inter))
        linears += [(lin.in_features, lin.out_features) for lin in blocks[-1].linears]
    blocks.append(Block(f"{p}.post_layernorm", params=_norm(f"{p}.post_layernorm", h)))
    if vc["vision_use_head"]:
        blocks.append(_siglip_head(f"{p}.head", h, inter))
        linears += [(h, h)] + [(lin.in_features, lin.out_features) for lin in blocks[-1].linears]
    return blocks, tuple(linears)


def _norm(p: str, h: int) -> tuple[tuple[str, int], ...]:
    return ((f"{p}.weight", h), (f"{p}.bias", h))


def _mlp(p: str, h: int, inter: int) -> list[Linear]:
    return [Linear(f"{p}.fc1", h, inter, True), Linear(f"{p}.fc2", inter, h, True)]


def _siglip_layer(p: str, h: int, inter: int) -> Block:
    """An encoder layer: k, v, q and out projections, the MLP's fc1 and fc2 (all with biases), two LayerNorms."""
    linears = [Linear(f"{p}.self_attn.{n}", h, h, True) for n in ("k_proj", "v_proj", "q_proj", "out_proj")]
    linears += _mlp(f"{p}.mlp", h, inter)
    params = tuple((f"{lin.name}.bias", lin.out_features) for lin in linears)
    return Block(p, tuple(linears), params + _norm(f"{p}.layer_norm1", h) + _norm(f"{p}.layer_norm2", h), is_layer=True)


def _siglip_head(p: str, h: int, inter: int) -> Block:
    """The attention-pooling head: a probe, torch's MultiheadAttention (its packed in-projection and its
    out_proj, an nn.Linear subclass that bitsandbytes leaves as loaded), a LayerNorm, an MLP."""
    linears = _mlp(f"{p}.mlp", h, inter)
    a = f"{p}.attention"
    params = tuple((f"{lin.name}.bias", lin.out_features) for lin in linears)
    params += ((f"{p}.probe", h), (f"{a}.in_proj_weight", 3 * h * h), (f"{a}.in_proj_bias", 3 * h))
    params += ((f"{a}.out_proj.weight", h * h), (f"{a}.out_proj.bias", h)) + _norm(f"{p}.layernorm", h)
    return Block(p, tuple(linears), params, is_layer=True)


def _qwen2_5_vl(fig: Any) -> VlmLayout | None:
    """A conf/model entry's Qwen2.5-VL: the Qwen2-shaped language model, the vision tower (a Conv3d patch
    embedding, blocks of RMSNorms, a fused qkv and a gated MLP, all with biases) and its merger (an RMSNorm,
    two linears over merge^2 patches), a row of their own. A local dir's text_config is another family
    (qwen2_5_vl_text): the meta model sizes it."""
    if fig.config_dir or not fig.vision_config_json:
        return None
    given = json.loads(fig.vision_config_json)
    vc = {**QWEN2_5_VL_VISION, **(given if isinstance(given, dict) else {})}
    sizes = ("depth", "hidden_size", "intermediate_size", "in_channels", "patch_size", "temporal_patch_size")
    if not _sized(vc, (*sizes, "spatial_merge_size", "out_hidden_size")):
        return None
    h, inter, wide = vc["hidden_size"], vc["intermediate_size"], vc["hidden_size"] * vc["spatial_merge_size"] ** 2
    patch = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    blocks = [Block(f"{VISUAL}.patch_embed.proj", params=((f"{VISUAL}.patch_embed.proj.weight", h * patch),))]
    blocks += [_qwen_vision_block(f"{VISUAL}.blocks.{i}", h, inter) for i in range(vc["depth"])]
    m = f"{VISUAL}.merger"
    merger = (Linear(f"{m}.mlp.0", wide, wide, True), Linear(f"{m}.mlp.2", wide, vc["out_hidden_size"], True))
    params = ((f"{m}.ln_q.weight", h),) + tuple((f"{lin.name}.bias", lin.out_features) for lin in merger)
    blocks.append(Block(m, merger, params))
    linears = tuple((lin.in_features, lin.out_features) for b in blocks for lin in b.linears)
    text = tuple(_under_text(b) for b in analytic_inventory(fig))
    config = {"model_type": "qwen2_5_vl", "vision_config": vc}
    return VlmLayout(text, tuple(blocks), (VISUAL,), linears, json.dumps(config, sort_keys=True))


def _qwen_vision_block(p: str, h: int, inter: int) -> Block:
    linears = (Linear(f"{p}.attn.qkv", h, 3 * h, True), Linear(f"{p}.attn.proj", h, h, True))
    linears += tuple(Linear(f"{p}.mlp.{n}", h, inter, True) for n in ("gate_proj", "up_proj"))
    linears += (Linear(f"{p}.mlp.down_proj", inter, h, True),)
    params = ((f"{p}.norm1.weight", h), (f"{p}.norm2.weight", h))
    return Block(p, linears, params + tuple((f"{lin.name}.bias", lin.out_features) for lin in linears), is_layer=True)
