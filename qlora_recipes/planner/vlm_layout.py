"""The vision-language checkpoints whose module tree is known, laid out from their figures without a meta
model (no torch, no transformers), as transformers 5.23 builds them:
- Gemma 3 (Gemma3ForConditionalGeneration): its gemma3_text language model under model.language_model
  (layers.py's blocks, renamed), a SigLIP vision tower under model.vision_tower and the projector under
  model.multi_modal_projector, sized from the vision_config of a conf/model entry or of a local dir's
  config.json (whose figures are its text_config's, model_type gemma3_text), each key left out at its
  SiglipVisionConfig default (as Gemma3Config fills it; with no vision_config at all, every key);
- Qwen2.5-VL from a conf/model entry: its Qwen2-shaped language model, its tower and merger under
  model.visual (Qwen2_5_VLVisionConfig's defaults for the keys the entry leaves out).
- a local dir's (or a hub id's) LLaVA: a CLIP or SigLIP tower under model.vision_tower, the two-linear
  projector under model.multi_modal_projector, its text_config's family (one layers.py knows) under
  model.language_model;
- a local dir's LLaVA-NeXT: LLaVA's parts and its image_newline parameter, a block of its own;
- a local dir's Qwen3-VL: its qwen3_vl_text language model (Qwen3's layers) under model.language_model,
  the tower, its merger and its deepstack mergers under model.visual; Qwen3-VL-MoE's the same around
  Qwen3-MoE's layers (3-D fused experts, 4-bit under quant.experts=4bit as a text MoE's);
- Llama-3.2-Vision (mllama), a conf/model entry's or a local dir's: Llama's layers but at the text_config's
  cross_attention_layers (MllamaTextConfig's default list where it leaves them out) a cross-attention
  layer, 8 more embedding rows, an untied lm_head; the tiled vision model under model.vision_model and
  the projector (one linear) under model.multi_modal_projector;
- a local dir's Idefics3 or SmolVLM: the SigLIP-shaped tower under model.vision_model, the connector (the
  pixel shuffle's scale_factor^2 patches into one linear) under model.connector, the text model under
  model.text_model.
The other families (and a checkpoint with its own code) keep the meta model (figures.meta_model); the
towers are planner/vlm_towers.py's.
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
from .vlm_towers import (
    CLIP_VISION,
    IDEFICS3_VISION,
    LLAVA_DEFAULT_TOWER,
    MLLAMA_SIZES,
    MLLAMA_VISION,
    QWEN2_5_VL_VISION,
    QWEN3_VL_SIZES,
    QWEN3_VL_VISION,
    SIGLIP_VISION,
    SIZES,
    biases,
    clip_tower,
    idefics3_tower,
    linears_of,
    mllama_tower,
    qwen2_5_vl_tower,
    qwen3_vl_tower,
    siglip_tower,
    sized,
)

GEMMA3 = {"model_type": "gemma3", "mm_tokens_per_image": 256}  # Gemma3Config's keys the planner reads

TEXT = "model.language_model"
TOWER = "model.vision_tower"
VISUAL = "model.visual"  # Qwen2.5-VL's tower, its merger (the projector) inside it
PROJECTOR = "model.multi_modal_projector"  # Gemma 3's and LLaVA's
IDEFICS3_TEXT = "model.text_model"  # Idefics3's and SmolVLM's language model, tower and connector
IDEFICS3_TOWER = "model.vision_model"
CONNECTOR = "model.connector"
NEWLINE = "model.image_newline"  # LLaVA-NeXT's parameter on the model itself
# LlavaNextConfig's default image_grid_pinpoints: the (height, width) an image's anyres crops may cover
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
# Qwen3VLMoeTextConfig's defaults (transformers 5.23) for the keys its layout reads
QWEN3_VL_MOE_TEXT = {
    "num_local_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


@dataclass(frozen=True)
class VlmLayout:
    """A vision-language model's blocks as from_pretrained names them, and its vision parts' figures."""

    text: tuple[Block, ...]  # the language model's blocks and lm_head
    vision: tuple[Block, ...]  # the vision tower's and projector's blocks, in module order
    prefixes: tuple[str, ...]  # the vision parts' full prefixes (model/vision.vision_prefixes)
    tower_linears: tuple[tuple[int, int], ...]  # (in, out) of every nn.Linear in the tower, subclasses too
    config_json: str  # the config as transformers fills it: its vision_config and the top-level keys read
    text_prefix: str = TEXT  # where the language model's modules sit

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
    cj = _dir_json(fig)
    if (fig.architecture == "mllama" and not cj) or (fig.architecture == "mllama_text_model" and cj):
        return _mllama(fig, cj)
    if fig.architecture == "gemma3" or (fig.architecture == "gemma3_text" and cj.get("model_type") == "gemma3"):
        top, vc = _configs(fig)
        return None if top is None or vc is None else _gemma3(fig, top, vc)
    build = _DIR_FAMILIES.get(str(cj.get("model_type")))
    if build is None or cj.get("auto_map") or not isinstance(cj.get("text_config"), dict):
        return None
    if fig.architecture in _QWEN3_VL_TEXT:  # Qwen3's layers (Qwen3-MoE's), as its text_config sizes them
        return build(fig, cj) if cj.get("model_type") == _QWEN3_VL_TEXT[fig.architecture] else None
    # the text model is its text_config's family: laid out when layers.py knows it (else the meta model)
    return build(fig, cj) if fig.traits.known else None


def _dir_json(fig: Any) -> dict[str, Any]:
    """A local dir's config.json (whose figures are its text_config's: model/vision.py builds the whole
    VLM from it), {} for a conf/model entry."""
    path = Path(fig.config_dir or "") / "config.json"
    cj = read_config(path) if fig.config_dir and path.is_file() else {}
    return cj if isinstance(cj, dict) else {}


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
    return (top, vc) if sized(vc, SIZES) else (None, None)


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
    linears = _tower_linears(tower, linears, [projector])
    config = {**top, "vision_config": vc}
    return VlmLayout(text, (*tower, projector), (TOWER, PROJECTOR), linears, json.dumps(config, sort_keys=True))


def _tower_linears(tower: list[Block], linears: tuple[tuple[int, int], ...], rest: list[Block]):
    """The linears of the part model/vision_tower.tower_prefix takes for the tower, the one with the most
    parameters: the projector in a tiny model whose projector outweighs its tower."""
    return linears if sum(map(_numel, tower)) >= sum(map(_numel, rest)) else linears_of(rest)


def _numel(block: Block) -> int:
    return sum(lin.numel for lin in block.linears) + sum(n for _, n in block.params)


def _under_text(block: Block, prefix: str = TEXT) -> Block:
    """A text model's block as the VLM names it: model.X -> model.language_model.X (lm_head stays)."""

    def name(n: str) -> str:
        return f"{prefix}.{n[len('model.') :]}" if n.startswith("model.") else n

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
    if not sized(vc, (*sizes, "spatial_merge_size", "out_hidden_size")):
        return None
    blocks, linears = qwen2_5_vl_tower(vc, VISUAL)
    text = tuple(_under_text(b) for b in analytic_inventory(fig))
    config = {"model_type": "qwen2_5_vl", "vision_config": vc}
    return VlmLayout(text, tuple(blocks), (VISUAL,), linears, json.dumps(config, sort_keys=True))


def _text(fig: Any, tie: bool, prefix: str) -> tuple[Block, ...]:
    """The language model's blocks under `prefix`, its lm_head tied as the VLM's config ties it (the top
    level's tie_word_embeddings, which the text_config's figures may not say)."""
    own = fig if tie == fig.tie_embeddings else replace(fig, tie_embeddings=tie)
    return tuple(_under_text(b, prefix) for b in analytic_inventory(own))


def _top(cj: dict[str, Any], **defaults: Any) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in cj.items() if k not in ("text_config", "vision_config")}}


def _llava(fig: Any, cj: dict[str, Any], **defaults: Any) -> VlmLayout | None:
    """LLaVA (LlavaForConditionalGeneration): its tower is AutoModel's of the vision_config (CLIP by default,
    CLIP-L/14 at 336 px without one), the projector two linears from the tower's hidden size (times the
    feature layers it concatenates) to the text's; tied where the top level or the text_config ties.
    `defaults`: the config class's own top-level keys beside LlavaConfig's (LLaVA-NeXT's)."""
    given = cj.get("vision_config")
    if given is None:
        vc = dict(LLAVA_DEFAULT_TOWER)
    else:
        defaults = {"clip_vision_model": CLIP_VISION, "siglip_vision_model": SIGLIP_VISION}
        kind = given.get("model_type", "clip_vision_model") if isinstance(given, dict) else None
        if kind not in defaults:
            return None
        vc = {**defaults[kind], **given}
    if not sized(vc, SIZES):
        return None
    top = _top(cj, vision_feature_layer=-2, multimodal_projector_bias=True, tie_word_embeddings=False, **defaults)
    build = clip_tower if vc["model_type"] == "clip_vision_model" else siglip_tower
    tower, own = build(vc, TOWER)
    layers = top["vision_feature_layer"]
    wide = vc["hidden_size"] * (len(layers) if isinstance(layers, list) else 1)
    h, bias = fig.hidden_size, bool(top["multimodal_projector_bias"])
    projection = (Linear(f"{PROJECTOR}.linear_1", wide, h, bias), Linear(f"{PROJECTOR}.linear_2", h, h, bias))
    projector = Block(PROJECTOR, projection, biases(projection))
    linears = _tower_linears(tower, own, [projector])
    text = _text(fig, bool(top["tie_word_embeddings"]) or fig.tie_embeddings, TEXT)
    config = json.dumps({**top, "vision_config": vc}, sort_keys=True)
    return VlmLayout(text, (*tower, projector), (TOWER, PROJECTOR), linears, config)


def _llava_next(fig: Any, cj: dict[str, Any]) -> VlmLayout | None:
    """LLaVA-NeXT (LlavaNextForConditionalGeneration): LLaVA's tower, projector and language model, and
    image_newline (a text-wide parameter of the model itself, the row end of each image's anyres features)
    a block of its own before the language model's; its config carries the grid pinpoints the anyres
    tiling reads (planner/vision_forward.py)."""
    known = _llava(fig, cj, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, vision_feature_select_strategy="default")
    if known is None:
        return None
    newline = Block(NEWLINE, params=((NEWLINE, fig.hidden_size),))
    return replace(known, text=(newline, *known.text))


def _idefics3(fig: Any, cj: dict[str, Any]) -> VlmLayout | None:
    """Idefics3 and SmolVLM: a SigLIP-shaped tower (no pooling head), the connector's one bias-free linear
    over scale_factor^2 shuffled patches, the text model under model.text_model (tied only where the
    top level says so)."""
    given = cj.get("vision_config") or {}
    top = _top(cj, scale_factor=2, tie_word_embeddings=False)
    if not isinstance(given, dict) or not sized(top, ("scale_factor",)):
        return None
    vc = {**IDEFICS3_VISION, **given, "model_type": f"{cj['model_type']}_vision"}
    if not sized(vc, SIZES):
        return None
    tower, own = idefics3_tower(vc, IDEFICS3_TOWER)
    wide = vc["hidden_size"] * top["scale_factor"] ** 2
    proj = Linear(f"{CONNECTOR}.modality_projection.proj", wide, fig.hidden_size, False)
    text = _text(fig, bool(top["tie_word_embeddings"]), IDEFICS3_TEXT)
    config = json.dumps({**top, "vision_config": vc}, sort_keys=True)
    connector = Block(CONNECTOR, (proj,))
    linears = _tower_linears(tower, own, [connector])
    return VlmLayout(text, (*tower, connector), (IDEFICS3_TOWER, CONNECTOR), linears, config, IDEFICS3_TEXT)


def _qwen3_vl(fig: Any, cj: dict[str, Any]) -> VlmLayout | None:
    """Qwen3-VL: its text model is Qwen3's layers (q/k norms; attention_bias on all four projections, a
    bias-free MLP; Qwen3VLTextConfig's head_dim of 128 where the text_config leaves it out), its tower
    planner/vlm_towers.qwen3_vl_tower's, tied only where the top level says so."""
    tc = cj["text_config"]
    bias = bool(tc.get("attention_bias", False))
    own = replace(fig, architecture="qwen3", qkv_bias=bias, o_bias=bias, mlp_bias=False)
    return _qwen3_vl_shaped(replace(own, head_dim=int(tc.get("head_dim") or 128)), cj)


def _qwen3_vl_moe(fig: Any, cj: dict[str, Any]) -> VlmLayout | None:
    """Qwen3-VL-MoE: Qwen3-VL's tower around Qwen3-MoE's layers (a router weight, the experts fused into
    3-D gate_up_proj and down_proj, no shared expert), Qwen3VLMoeTextConfig's defaults where its
    text_config leaves a figure out (its head_dim hidden / heads, as the figures read it). A text model
    with dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step) keeps the meta model."""
    given = {k: v for k, v in cj["text_config"].items() if v is not None}
    if "num_experts" in given:  # the name its config class maps to num_local_experts
        given.setdefault("num_local_experts", given["num_experts"])
    tc = {**QWEN3_VL_MOE_TEXT, **given}
    if tc["mlp_only_layers"] or tc["decoder_sparse_step"] != 1:
        return None
    if not sized(tc, ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size")):
        return None
    experts = tc["num_local_experts"]
    bias = bool(tc["attention_bias"])
    own = replace(fig, architecture="qwen3_moe", qkv_bias=bias, o_bias=bias, mlp_bias=False, num_experts=experts)
    own = replace(own, experts_per_token=tc["num_experts_per_tok"], expert_intermediate=tc["moe_intermediate_size"])
    return _qwen3_vl_shaped(replace(own, shared_expert_intermediate=0), cj)


def _qwen3_vl_shaped(text_fig: Any, cj: dict[str, Any]) -> VlmLayout | None:
    """A Qwen3-VL checkpoint's layout: the tower under model.visual, the language model `text_fig`'s
    family's layers under model.language_model."""
    given = cj.get("vision_config") or {}
    if not isinstance(given, dict):
        return None
    vc = {**QWEN3_VL_VISION, **given, "model_type": f"{cj['model_type']}_vision"}
    deepstack = vc["deepstack_visual_indexes"]
    if not sized(vc, QWEN3_VL_SIZES) or not isinstance(deepstack, list | tuple):
        return None
    top = _top(cj, tie_word_embeddings=False)
    tower, linears = qwen3_vl_tower(vc, VISUAL)
    text = _text(text_fig, bool(top["tie_word_embeddings"]), TEXT)
    config = json.dumps({**top, "vision_config": vc}, sort_keys=True)
    return VlmLayout(text, tuple(tower), (VISUAL,), linears, config)


MLLAMA_TOWER = "model.vision_model"
MLLAMA_CROSS = (3, 8, 13, 18, 23, 28, 33, 38)  # MllamaTextConfig's cross_attention_layers


def _mllama(fig: Any, cj: dict[str, Any]) -> VlmLayout | None:
    """Llama-3.2-Vision from a conf/model entry's vision_config or a local dir's config.json (its
    model_type mllama, no code of its own)."""
    if cj and (cj.get("model_type") != "mllama" or cj.get("auto_map") or not isinstance(cj.get("text_config"), dict)):
        return None
    given: Any = cj.get("vision_config") if cj else json.loads(fig.vision_config_json or "null")
    if not cj and not isinstance(given, dict):  # an entry without a vision_config: a text model
        return None
    if not isinstance(given or {}, dict):
        return None
    vc = {**MLLAMA_VISION, **(given or {}), "model_type": "mllama_vision_model"}
    if not sized(vc, MLLAMA_SIZES) or not isinstance(vc["supported_aspect_ratios"], list):
        return None
    cross = cj["text_config"].get("cross_attention_layers") if cj else fig.cross_attention_layers
    tower, linears = mllama_tower(vc, MLLAMA_TOWER)
    projection = Linear(PROJECTOR, vc["vision_output_dim"], fig.hidden_size, True)
    projector = Block(PROJECTOR, (projection,), biases((projection,)))
    linears = _tower_linears(tower, linears, [projector])
    text = _mllama_text(fig, set(cross or MLLAMA_CROSS))
    config = json.dumps({**_top(cj, model_type="mllama"), "vision_config": vc}, sort_keys=True)
    return VlmLayout(text, (*tower, projector), (MLLAMA_TOWER, PROJECTOR), linears, config)


def _mllama_text(fig: Any, cross: set[int]) -> tuple[Block, ...]:
    """MllamaTextModel's blocks from Llama's: a cross-attention layer at each of `cross`, its embeddings
    8 rows longer than the vocabulary, lm_head never tied (head_dim: hidden / heads, as its attention)."""
    llama = replace(fig, architecture="llama", qkv_bias=False, o_bias=False, mlp_bias=False, tie_embeddings=False)
    llama = replace(llama, head_dim=fig.hidden_size // fig.num_heads)
    blocks = []
    for block in analytic_inventory(llama):
        if block.name == "model.embed_tokens":
            rows = fig.vocab_size + 8
            block = replace(block, params=((f"{block.name}.weight", rows * fig.hidden_size),))
            block = replace(block, embeddings=((block.name, rows, fig.hidden_size),))
        elif block.is_layer and int(block.name.rsplit(".", 1)[1]) in cross:
            block = _cross_layer(block, llama.head_dim)
        blocks.append(_under_text(block))
    return tuple(blocks)


def _cross_layer(layer: Block, head_dim: int) -> Block:
    """A self-attention layer's block made MllamaCrossAttentionDecoderLayer's: its q/k/v/o under
    cross_attn, q and k norms, the attention's and the MLP's gates."""
    p = layer.name
    linears = tuple(replace(lin, name=lin.name.replace(".self_attn.", ".cross_attn.")) for lin in layer.linears)
    params = ((f"{p}.cross_attn.q_norm.weight", head_dim), (f"{p}.cross_attn.k_norm.weight", head_dim))
    params += ((f"{p}.cross_attn_attn_gate", 1), (f"{p}.cross_attn_mlp_gate", 1))
    return replace(layer, linears=linears, params=layer.params + params)


_DIR_FAMILIES = {"llava": _llava, "llava_next": _llava_next, "idefics3": _idefics3, "smolvlm": _idefics3}
_DIR_FAMILIES.update(qwen3_vl=_qwen3_vl, qwen3_vl_moe=_qwen3_vl_moe)
# the text model_types whose layout is their checkpoint's (the figures' family unknown to layers.py)
_QWEN3_VL_TEXT = {"qwen3_vl_text": "qwen3_vl", "qwen3_vl_moe_text": "qwen3_vl_moe"}
