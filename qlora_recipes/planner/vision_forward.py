"""A vision tower's shape, the image tokens its processor renders, and what its forward takes.

By shape, not by family: a vision_config's layers / hidden / intermediate / heads / patch / image size
(CLIP, SigLIP, Idefics3's tower: a fixed resolution) or its spatial merge without an image size
(Qwen2-VL, Qwen2.5-VL: images resized to a pixel budget). The processor's settings (processor_config.json's
image_processor, or preprocessor_config.json) give the image size it renders, Qwen's min/max pixels and
Idefics' splitting into tiles, LLaVA-NeXT's anyres grid pinpoints (the base view and the crops its best
pinpoint cuts, planned at the pinpoint that makes the most tokens); without them the vision_config's image
size, or for a pixel-budget tower the sequence length (no row holds more image tokens than that).

Qwen2.5-VL's layers attend within windows of window_size pixels a side, all but fullatt_block_indexes:
their attention is sized at the window, the others' at the whole image.

The tower's forward holds, for a moment, one layer's tensors at a time beside the pixels, the hidden
state the projector reads, and the text embeddings it is merged into; what autograd keeps of it for
backward (lora_kept_bytes) is counted with the activations (planner/vision.py says when).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionShape:
    """What sizes a vision tower's forward. image_size None: the tower takes any size (a pixel budget)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    patch: int
    image_size: int | None
    merge: int = 1  # patches per image token, a side (Qwen's spatial merge, Idefics3's pixel shuffle)
    temporal: int = 1  # Qwen's temporal patch: an image is its frames, repeated
    channels: int = 3
    out_hidden: int = 0  # the projector's output: the language model's hidden size
    pooled: int = 0  # image tokens an image when the projector pools the patches to a fixed count (Gemma 3)
    tiles: int = 0  # tiles an image when the tower always takes that many (mllama's max_num_tiles)
    window: int = 0  # patches a window of the windowed layers (Qwen2.5-VL's window_size); 0: none
    full_layers: tuple[int, ...] = ()  # with a window, the layers that attend the whole image
    # LLaVA-NeXT's anyres tiling: the (height, width) in pixels an image's crops may cover (its config's
    # image_grid_pinpoints; the processor's own, where it has them, decide)
    pinpoints: tuple[tuple[int, int], ...] = ()

    @property
    def windowed(self) -> int:
        """Layers that attend within windows (the rest attend the whole image)."""
        return self.layers - len({i for i in self.full_layers if 0 <= i < self.layers}) if self.window else 0


def vision_shape(cj: dict[str, Any], text_hidden: int) -> VisionShape | None:
    """The shape of a config's vision_config (full config.json dict, vision_config inside), or None when
    it lacks a size the forward needs (its weights are still counted)."""
    vc = cj.get("vision_config")
    if not isinstance(vc, dict):
        return None
    hidden = _first(vc, "hidden_size", "embed_dim")
    heads = _first(vc, "num_attention_heads", "num_heads", "attention_heads")
    layers = _first(vc, "num_hidden_layers", "depth")
    patch = _first(vc, "patch_size")
    if not (hidden and heads and layers and patch):
        return None
    inter = _first(vc, "intermediate_size") or int(float(vc.get("mlp_ratio") or 4) * hidden)
    size = vc.get("image_size")
    return VisionShape(
        layers=layers,
        hidden=hidden,
        intermediate=inter,
        heads=heads,
        patch=patch,
        image_size=int(size) if isinstance(size, int | float) and not isinstance(size, bool) else None,
        merge=_first(vc, "spatial_merge_size") or _first(cj, "scale_factor") or 1,
        temporal=_first(vc, "temporal_patch_size") or 1,
        channels=_first(vc, "num_channels", "in_channels", "in_chans") or 3,
        out_hidden=_first(vc, "out_hidden_size") or text_hidden,
        pooled=_first(cj, "mm_tokens_per_image"),
        tiles=_first(vc, "max_num_tiles"),
        pinpoints=_pinpoints(cj.get("image_grid_pinpoints")),
        **_windows(vc),
    )


def _pinpoints(given: Any) -> tuple[tuple[int, int], ...]:
    """image_grid_pinpoints as (height, width) pairs of positive integers; () where it is none such."""
    if not isinstance(given, list | tuple) or not all(isinstance(p, list | tuple) and len(p) == 2 for p in given):
        return ()
    pairs = tuple((p[0], p[1]) for p in given)
    positive = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for p in pairs for v in p)
    return pairs if positive else ()


def _windows(vc: dict[str, Any]) -> dict[str, Any]:
    """Qwen2.5-VL's windowed layers: all but fullatt_block_indexes attend within windows of window_size
    pixels a side, in whole merge units (transformers' get_vision_window_index)."""
    merge, patch, size = _first(vc, "spatial_merge_size") or 1, _first(vc, "patch_size"), _first(vc, "window_size")
    full = vc.get("fullatt_block_indexes")
    if not (size and patch and isinstance(full, list | tuple)):
        return {}
    side = size // merge // patch
    return {"window": max(1, side) ** 2 * merge**2, "full_layers": tuple(int(i) for i in full)}


def _first(d: dict, *keys: str) -> int:
    for k in keys:
        v = d.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
            return int(v)
    return 0


@dataclass(frozen=True)
class ImageTokens:
    """Per image: its tokens in the text sequence, the tower's sequences (tiles) and patches in each."""

    tokens: int
    tiles: int
    patches: int  # per tile, the tower's sequence (a CLS token included)
    source: str  # where the size came from, for plan.json's note
    extra: int = 0  # of those, the tokens the tower adds (CLS)


def image_tokens(shape: VisionShape, settings: dict[str, Any], seq_len: int) -> ImageTokens:
    """The image tokens of the largest image the processor renders with `settings` (its image_processor's
    keys, with the processor's own: num_additional_image_tokens, vision_feature_select_strategy)."""
    ip = settings.get("image_processor") if isinstance(settings.get("image_processor"), dict) else settings
    if shape.image_size is None:
        return _pixel_budget(shape, ip, seq_len)
    # the tower's own tokens: the processor's count (CLIP's CLS), or a tiled tower's class token a tile (mllama)
    add = _first(settings, "num_additional_image_tokens") or (1 if shape.tiles else 0)
    drop = 1 if add and settings.get("vision_feature_select_strategy") == "default" else 0
    edge, source = _fixed_edge(shape, ip)
    grid = (edge // shape.patch) ** 2
    pinpoints = _pinpoints(ip.get("image_grid_pinpoints")) or shape.pinpoints
    if pinpoints and not shape.tiles:
        return _anyres(pinpoints, edge, edge // shape.patch, add, drop, source)
    tiles = shape.tiles or _tiles(ip)
    # a cross-attending model (fixed tiles) puts no image tokens in the row: sized by the tower's sequence
    tokens = tiles * (shape.pooled or (grid // shape.merge**2 + add - drop))
    return ImageTokens(tokens, tiles, grid + add, source + (f", {tiles} tiles" if tiles > 1 else ""), add)


def _anyres(
    pinpoints: tuple[tuple[int, int], ...], edge: int, side: int, add: int, drop: int, source: str
) -> ImageTokens:
    """LLaVA-NeXT's anyres tiling (its processor's _get_number_of_features): the base view at `edge` px
    (`side` patches a side), then the image resized into its best pinpoint and cut into crops of `edge`
    px, each crop's features laid out as one grid with a newline token a row, the padding back to the
    image's aspect dropped. The most tokens: an image of its pinpoint's own aspect (nothing unpadded) at
    the pinpoint that makes the most; the tower sees the base view and every crop (the most crops any
    pinpoint cuts)."""
    rows_cols = [(side * (h // edge), side * (w // edge)) for h, w in pinpoints]
    tokens = side * side + add - drop + max(rows * cols + rows for rows, cols in rows_cols)
    crops = max(-(-h // edge) * -(-w // edge) for h, w in pinpoints)
    where = f"{source}, anyres over {len(pinpoints)} pinpoints: the base view and up to {crops} crops"
    return ImageTokens(tokens, 1 + crops, side * side + add, where, add)


def _fixed_edge(shape: VisionShape, ip: dict) -> tuple[int, str]:
    """The side a fixed-resolution tower sees: the processor's crop, its tile size, its size, else the
    vision_config's image_size (the tower's position embeddings are made for it)."""
    for key in ("crop_size", "max_image_size", "size"):
        size = ip.get(key)
        if key == "crop_size" and ip.get("do_center_crop") is False:
            continue
        if isinstance(size, dict):
            side = max(_first(size, "height"), _first(size, "width")) or (
                _first(size, "longest_edge") if key == "max_image_size" else _first(size, "shortest_edge")
            )
            if side:
                return side, f"the processor's {key} {side} px"
        elif isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size, f"the processor's {key} {size} px"
    return int(shape.image_size or 0), f"the vision config's image_size {shape.image_size} px"


def _tiles(ip: dict) -> int:
    """Idefics3-style splitting: an image resized to size.longest_edge, cut into max_image_size tiles
    a side, plus the whole image downscaled to one tile."""
    if not ip.get("do_image_splitting"):
        return 1
    longest = _first(ip.get("size") or {}, "longest_edge")
    tile = _first(ip.get("max_image_size") or {}, "longest_edge")
    if not (longest and tile):
        return 1
    return math.ceil(longest / tile) ** 2 + 1


def _pixel_budget(shape: VisionShape, ip: dict, seq_len: int) -> ImageTokens:
    """Qwen2-VL-style: an image resized to at most max_pixels (size.longest_edge in transformers 5), in
    units of patch x merge pixels a side; no row holds more tokens than seq_len."""
    size = ip.get("size") if isinstance(ip.get("size"), dict) else {}
    budget = _first(ip, "max_pixels") or _first(size, "longest_edge")
    unit = shape.patch * shape.merge
    if budget:
        tokens, source = min(budget // unit**2, seq_len), f"the processor's max_pixels {budget:,}"
    else:
        tokens, source = seq_len, "no processor settings: as many as seq_len holds"
    return ImageTokens(tokens, 1, tokens * shape.merge**2, source)


def images_per_row(img: ImageTokens, seq_len: int) -> int:
    """Images a row of seq_len tokens can hold (at least one): the tower's worst case per row."""
    return max(1, seq_len // max(1, img.tokens))


def row_images(wanted: int, img: ImageTokens, seq_len: int, cross: bool) -> int:
    """Images a row is planned with: `wanted`, no more than seq_len holds at the largest image's tokens (a
    longer row is refused or dropped); a cross-attending row holds one token an image, so no cap there."""
    return max(1, wanted if cross else min(wanted, images_per_row(img, seq_len)))


def scores(shape: VisionShape, img: ImageTokens, seqs: int, windowed: bool) -> int:
    """Attention scores of one layer over `seqs` sequences (per head, query x key): each patch against
    its window's patches in a windowed layer (transformers splits the sequence at the window bounds),
    else against the whole image."""
    keys = min(shape.window, img.patches) if windowed and shape.window else img.patches
    return seqs * shape.heads * img.patches * keys


def forward_bytes(shape: VisionShape, img: ImageTokens, images: int, a: int, eager: bool) -> int:
    """The tower and projector's forward on `images` images, no gradient, activations of `a` bytes: the
    largest of one layer's tensors (attention or MLP), beside the pixels (fp32 from the processor and their
    cast) and the hidden state the projector reads; then the projector's input, hidden and output."""
    seqs = images * img.tiles
    n = seqs * img.patches  # the tower's tokens
    hv, iv = shape.hidden, shape.intermediate
    grid = img.patches - img.extra  # the patches cut from pixels (a CLS token is not)
    pixel_elems = seqs * grid * shape.channels * shape.temporal * shape.patch**2
    pixels = pixel_elems * 4  # fp32, as the processor makes them
    # the patch embedding: the pixels cast to the tower's dtype and the convolution's copy of them
    embedding = pixels + (2 * pixel_elems * a if a != 4 else 0) + n * hv * a
    # attention: the input and its norm, Q, K, V, the output and its contiguous copy
    attention = 7 * n * hv * a
    if eager:  # the scores, their fp32 softmax and its cast back, per sequence; the output before its transpose
        widest = scores(shape, img, seqs, windowed=shape.windowed == shape.layers)  # one layer at a time
        attention += widest * (2 * a + 4) + n * hv * a
    # the MLP: the input, its norm and the residual sum; fc1 (or gate and up), the activation, its product
    mlp = n * (3 * hv + 3 * iv) * a
    tower = max(embedding, pixels + n * hv * a + max(attention, mlp))  # the hidden state the projector reads
    tokens = images * img.tokens
    # LLaVA's projector: two linears at the text width; a merger: at merge^2 times the tower's width
    inner = shape.hidden * shape.merge**2 if shape.merge > 1 else shape.out_hidden
    projector = n * hv * a + tokens * (2 * inner + shape.out_hidden) * a
    return max(tower, projector)


def merge_bytes(images: int, img: ImageTokens, text_hidden: int, a: int, r: int) -> int:
    """The image features cast to the embeddings' dtype, beside the projector's output, while
    masked_scatter writes them into a copy of the text embeddings (counted by the caller)."""
    return images * img.tokens * text_hidden * (a + r)


@dataclass(frozen=True)
class TowerLora:
    """What sizes the tower's saved activations under model.vision_tower=lora."""

    r: int
    dropout: bool  # peft's dropout: its output and mask per adapted linear (nn.Identity at 0)
    checkpointed: bool  # transformers checkpoints every GradientCheckpointingLayer, the tower's layers too
    sigmoid_act: bool  # quick_gelu / silu: x * sigmoid(x) saves its input and the sigmoid's output


def lora_kept_bytes(shape: VisionShape, img: ImageTokens, images: int, a: int, eager: bool, lora: TowerLora) -> int:
    """What autograd keeps of the tower and projector's forward for backward when LoRA adapts the tower's
    linears: checkpointed, each layer's input; else each layer's saved tensors. Beside them the inputs
    of the norms before and after the layers (CLIP's pre- and post-layernorm; the embeddings need a
    gradient, as enable_input_require_grads makes them) and the projector's activation input (its
    linears are frozen: they save no input)."""
    seqs = images * img.tiles
    n = seqs * img.patches
    inner = shape.hidden * shape.merge**2 if shape.merge > 1 else shape.out_hidden
    ends = 2 * n * shape.hidden * a + images * img.tokens * inner * a
    if lora.checkpointed:
        return shape.layers * n * shape.hidden * a + ends
    windowed = _layer_saved(shape, n, scores(shape, img, seqs, True), seqs * shape.heads * img.patches, a, eager, lora)
    full = _layer_saved(shape, n, scores(shape, img, seqs, False), seqs * shape.heads * img.patches, a, eager, lora)
    return shape.windowed * windowed + (shape.layers - shape.windowed) * full + ends


def _layer_saved(shape: VisionShape, n: int, score: int, rows: int, a: int, eager: bool, lora: TowerLora) -> int:
    """One tower layer's saved tensors (pre-norm attention and MLP, LoRA on q, k, v, the output, fc1,
    fc2): the norms' inputs and fp32 statistics, the attention's q, k, v and output (sdpa's fp32
    log-sum-exp, or eager's scores and probabilities), the activation's input, each adapter's input
    (the dropout's output and mask) and its rank-r hidden state; the frozen linears save no input."""
    hv, iv = shape.hidden, shape.intermediate
    norms = 2 * (n * hv * a + 8 * n)
    attention = 4 * n * hv * a + (score * (2 * a + 4) if eager else rows * 4)  # rows: sdpa's per head and query
    act = n * iv * a * (2 if lora.sigmoid_act else 1)
    if lora.dropout:  # q, k, v each drop their shared input apart
        inputs = 5 * n * hv * (a + 1) + n * iv * (a + 1)
    else:  # q, k, v's shared input, the attention's output, fc1's input; fc2 reads the activation's output
        inputs = 3 * n * hv * a + n * iv * a
    return norms + attention + act + inputs + 6 * n * lora.r * a
