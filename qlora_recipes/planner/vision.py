"""A vision-language model's vision tower and projector in the plan.

The figures (figures.py) describe a VLM's language model, from its config.json's text_config: its layers,
activations and loss are planned as a text model's at seq_len, where seq_len (and the data's longest row)
counts each image's tokens, as the processor renders the rows (data/images.py). Beside it:
- the vision tower and projector as model.vision_tower loads them (model/vision_tower.py): frozen, both
  unquantized in the compute dtype; quantized, the tower's linears in quant's format (components'
  quantized_linear_bytes, as the language model's), the rest in the compute dtype; lora, as frozen plus
  the adapters on the tower's linears (weights, gradients, optimizer state, as the language model's).
  Counted from the family's layout (vlm_layout.py: the families it knows), else from the model
  transformers builds on the meta device;
- k-bit prep (peft 0.21's prepare_model_for_kbit_training) casts every bf16/fp16 parameter that is not
  4-bit to fp32, the tower's unquantized ones included, before model/vision.keep_vision_in casts them
  back: the load phase holds them in fp32 at its end;
- the tower's forward on a micro-batch's images (vision_forward.py), micro_batch_size x data.images_per_row
  of them (auto: the most any row of the data holds, 1 before a run reads its rows; no more than seq_len
  holds at an image's tokens; settle_images): a phase of its own before the decoder layers run, beside
  the text embeddings the image features go into. Under lora the tower keeps what its adapters' gradients
  need (each layer's input when checkpointed); frozen or quantized, nothing: the loader drops the hook
  enable_input_require_grads puts on the tower's patch embeddings (model/vision_tower.unhook_frozen_tower),
  so a tower that trains nothing builds no autograd graph.
The vision config comes from the run's config.json, or from a conf/model entry's vision_config (carried
on the figures as vision_config_json); without either the model is a text model.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..units import dtype_bytes, fmt_bytes
from .components import act_dtypes, eager, quantized_linear_bytes
from .cross_attention import add_cross_attention, eval_bytes
from .figures import hf_config, vision_language
from .spec import StackSpec
from .vision_forward import (
    TowerLora,
    forward_bytes,
    image_tokens,
    images_per_row,
    lora_kept_bytes,
    merge_bytes,
    row_images,
    vision_shape,
)
from .vlm_layout import VlmLayout, layout


def vision_config(st: StackSpec) -> dict[str, Any] | None:
    """The model's config as a dict with its vision_config (every default filled in when transformers
    knows the model type), or None for a text model."""
    known = _layout(st)
    if known is not None:
        return known.config
    folder = st.fig.config_dir
    if folder and (Path(folder) / "config.json").is_file():
        return _dir_config(folder, bool(st.fig.trust_remote_code))
    raw = getattr(st.fig, "vision_config_json", None)
    if not raw:
        return None
    vc = json.loads(raw)
    if not isinstance(vc, dict):
        return None
    try:  # the whole VLM's config (figures.hf_config builds it from the entry): its projector's keys too
        full = hf_config(st.fig).to_dict()
    except (UserError, ValueError, TypeError):
        full = {}
    return full if isinstance(full.get("vision_config"), dict) else {"vision_config": _filled(vc)}


def _layout(st: StackSpec) -> VlmLayout | None:
    """The model's layout from its figures (vlm_layout.py) when its family's is known and it is planned
    as a vision-language model; None: its config and parts come from transformers."""
    return layout(st.fig) if vision_language(st.fig) else None


@functools.lru_cache(maxsize=8)
def _dir_config(folder: str, trust: bool) -> dict[str, Any] | None:
    try:
        cj = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(cj, dict) or not isinstance(cj.get("vision_config"), dict):
        return None
    try:  # a saved config.json holds only what differs from the class's defaults
        from transformers import AutoConfig

        full = AutoConfig.from_pretrained(folder, trust_remote_code=trust).to_dict()
        return full if isinstance(full.get("vision_config"), dict) else cj
    except (OSError, ValueError, KeyError):
        return cj


def _filled(vc: dict[str, Any]) -> dict[str, Any]:
    """A vision_config mapping with its class's defaults (transformers' config of its model_type)."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in vc.items() if k != "model_type"}
    try:
        return {**AutoConfig.for_model(str(vc.get("model_type")), **kwargs).to_dict(), **vc}
    except (ValueError, KeyError, TypeError):
        return vc


def vision_params(st: StackSpec) -> int:
    """Parameters of the vision tower and projector of the model `st` plans, 0 for a text model."""
    known = _layout(st)
    if known is not None:
        return known.vision_params
    parts = _vision_parts(st) if vision_config(st) is not None else None
    if parts is None:
        return 0
    model, prefixes = parts
    return sum(p.numel() for prefix in prefixes for p in model.get_submodule(prefix).parameters())


def tower_linears(st: StackSpec) -> list[tuple[int, int]]:
    """(in, out) features of every nn.Linear in the vision tower (model/vision_tower.tower_prefix): what
    model.vision_tower quantizes or adapts."""
    known = _layout(st)
    if known is not None:
        return list(known.tower_linears)
    import torch

    from ..model.vision_tower import tower_prefix

    model, prefixes = _vision_parts(st)
    tower = model.get_submodule(tower_prefix(model, prefixes))
    return [(m.in_features, m.out_features) for m in tower.modules() if isinstance(m, torch.nn.Linear)]


def _vision_parts(st: StackSpec):
    """The model on the meta device and its vision parts' prefixes: the run's config.json's VLM, a
    conf/model entry's VLM from its figures (figures.hf_config), else its vision tower alone."""
    if st.fig.config_dir:
        return _dir_parts(st.fig.config_dir, bool(st.fig.trust_remote_code))
    return _entry_parts(st.fig)


@functools.lru_cache(maxsize=4)
def _dir_parts(folder: str, trust: bool):
    """Built once per folder: a plan asks for the parts several times, and the ladder and the searches plan
    many stacks of one model (as _dir_config reads its config.json once)."""
    from ..model.vision import meta_model, vision_prefixes

    meta = meta_model(folder, trust)
    return meta, vision_prefixes(meta)


@functools.lru_cache(maxsize=4)
def _entry_parts(fig):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

    from ..model.vision import vision_prefixes

    config = hf_config(fig)
    with init_empty_weights():
        if getattr(config, "vision_config", None) is not None:
            meta = AutoModelForImageTextToText.from_config(config, trust_remote_code=fig.trust_remote_code)
            return meta, vision_prefixes(meta)
        vc = json.loads(str(getattr(fig, "vision_config_json", None)))
        kwargs = {k: v for k, v in vc.items() if k != "model_type"}
        return AutoModel.from_config(AutoConfig.for_model(str(vc.get("model_type")), **kwargs)), [""]


def processor_settings(st: StackSpec) -> dict[str, Any]:
    """The processor's saved settings beside the model (processor_config.json, or the older
    preprocessor_config.json), {} when there is none."""
    folder = st.fig.config_dir
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = Path(folder or "") / name
        if folder and path.is_file():
            try:
                got = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(got, dict):
                return got
    return {}


def settle_images(cfg: Any, stats: dict) -> tuple[Any, str | None]:
    """cfg with data.images_per_row=auto resolved to the most images a row of the data holds (counted as
    data/images.py checks the rows), and the line saying so; else cfg as it was and None."""
    most = stats.get("images_per_row") or {}
    if cfg.data.images_per_row != "auto" or not most.get("images"):
        return cfg, None
    out = copy.deepcopy(cfg)
    out.data.images_per_row = int(most["images"])
    return (
        out,
        f"data.images_per_row=auto -> {most['images']} (the most images a row of the data holds: {most['where']})",
    )


def add_vision_rows(st: StackSpec, comp: dict, counts: dict, device: str, notes: list[str], shapes: list) -> int:
    """The vision parts' weights as model.vision_tower loads them, the tower's adapters (their shapes
    added to the trainable `shapes`), and their forward, on the device the model computes on; returns the
    parameters left unquantized (0 for a text model)."""
    cj = vision_config(st)
    params = vision_params(st) if cj is not None else 0
    if not params:
        return 0
    kept = _weights(st, comp, counts, device, params, shapes)
    counts["params_total"] += params
    shape = vision_shape(cj, st.fig.hidden_size)
    seq = "one token an image" if shape is not None and shape.tiles else "each image's tokens"
    note = f"vision: {_weights_words(st, params)}; the sequence counts {seq}"
    if shape is None:
        notes.append(
            f"{note}; not counted: the tower's forward (its vision_config lacks its layers/hidden/heads/patch)"
        )
        return kept
    img = image_tokens(shape, processor_settings(st), st.seq_len)
    n = row_images(st.images_per_row, img, st.seq_len, bool(shape.tiles))
    comp["vision_forward"][device] += _forward(st, shape, img, st.train_rows, n, device)
    tower_kept = _tower_kept(st, shape, img, cj, device)
    comp["activations"][device] += tower_kept
    notes.append(
        f"{note}; the tower's forward ({shape.layers} layers of {img.tiles * img.patches} patches an image"
        f"{_window_words(shape, img)}, "
        f"{_tokens_words(shape, img)} from {img.source}) is a phase of its own (and part of the eval "
        f"batch's), {_kept_words(st, tower_kept)}; planned for {_images_words(st, img, n, bool(shape.tiles))}"
    )
    if shape.tiles:  # the text cross-attends to every image's tiles' features (mllama)
        add_cross_attention(st, comp, device, n * img.tiles * img.patches, notes)
    return kept


def _images_words(st: StackSpec, img, n: int, cross: bool) -> str:
    """How many images a row the tower's terms count, and why."""
    what = f"{n} image{'s' if n > 1 else ''} a row"
    if st.images_auto:
        holds = "" if cross else f"; seq_len holds up to {images_per_row(img, st.seq_len)}"
        return (
            f"{what} (data.images_per_row=auto with no data read: a run plans the most any row of its data "
            f"holds{holds})"
        )
    if n < st.images_per_row:
        return f"{what} (data.images_per_row={st.images_per_row}, capped at the {n} seq_len={st.seq_len} holds)"
    return f"{what} (data.images_per_row={st.images_per_row})"


def _weights(st: StackSpec, comp: dict, counts: dict, device: str, params: int, shapes: list) -> int:
    """The tower's linears in quant's format (quantized) or with their adapters (lora); every other vision
    weight in the compute dtype. Returns the parameters left unquantized."""
    linears = tower_linears(st) if st.vision_tower != "frozen" else []
    plain = params
    if st.vision_tower == "quantized" and st.quantized:
        for n_in, n_out in linears:
            data, state = quantized_linear_bytes(n_in * n_out, n_out, st.quant, st.double_quant, st.quant_storage_bytes)
            comp["quantized_weights"][device] += data + state
            counts["params_quantized"] += n_in * n_out
            counts["quant_state_bytes"] += state
            plain -= n_in * n_out
    elif st.vision_tower == "lora":
        tensors = [t for n_in, n_out in linears for t in ((st.r, n_in), (n_out, st.r))]
        numel = sum(x * y for x, y in tensors)
        comp["lora_weights"][device] += st.adapter_bytes * numel
        comp["gradients"][device] += st.adapter_bytes * numel
        counts["lora_params"] += numel
        shapes += tensors
    comp["other_params"][device] += plain * dtype_bytes(st.dtype)
    return plain


def _weights_words(st: StackSpec, params: int) -> str:
    if st.vision_tower == "quantized" and st.quantized:
        return (
            f"the vision tower and projector ({params:,} params): the tower's linears in {st.quant}, the rest "
            f"unquantized in {st.dtype}"
        )
    if st.vision_tower == "lora":
        return f"the vision tower and projector ({params:,} params) in {st.dtype}, LoRA r={st.r} on the tower's linears"
    return f"the vision tower and projector ({params:,} params) stay unquantized in {st.dtype}"


def _window_words(shape, img) -> str:
    if not shape.windowed:
        return ""
    return f", {shape.windowed} of them attending within windows of {min(shape.window, img.patches)} patches"


def _tokens_words(shape, img) -> str:
    if shape.tiles:  # mllama: one token an image in the row, the text cross-attends to the tiles' features
        return f"one image token each in the row, the text cross-attending to its {img.tiles * img.patches} features"
    return f"{img.tokens} image tokens each"


def _tower_kept(st: StackSpec, shape, img, cj: dict, device: str) -> int:
    """The tower's saved activations over the micro-batch's images: under lora, what its adapters'
    gradients need; frozen or quantized, nothing (no hook makes its patch embeddings require grad:
    model/vision_tower.unhook_frozen_tower)."""
    if st.vision_tower != "lora":
        return 0
    c, _, _ = act_dtypes(st, device == "cpu")
    act = str(cj["vision_config"].get("hidden_act") or "")
    lora = TowerLora(st.r, st.lora_dropout > 0, st.checkpointing, act in ("quick_gelu", "silu", "swish"))
    images = st.train_rows * row_images(st.images_per_row, img, st.seq_len, bool(shape.tiles))
    return lora_kept_bytes(shape, img, images, c, eager(st), lora)


def _kept_words(st: StackSpec, kept: int) -> str:
    if not kept:
        return "nothing of it kept for backward"
    how = "each layer's input (checkpointed with the rest)" if st.checkpointing else "every layer's saved tensors"
    return f"its LoRA keeps {how} for backward ({kept / 2**20:,.1f} MiB, in the activations)"


def _forward(st: StackSpec, shape, img, rows: int, per_row: int, device: str) -> int:
    """The tower's forward on `rows` rows of `per_row` images each, beside the text embeddings, then the
    features written into their copy."""
    c, r, _ = act_dtypes(st, device == "cpu")
    embeds = rows * st.seq_len * st.fig.hidden_size * r
    images = rows * per_row
    tower = forward_bytes(shape, img, images, c, eager(st))
    return embeds + max(tower, merge_bytes(images, img, st.fig.hidden_size, c, r) + embeds)


def add_vision_eval(st: StackSpec, comp: dict, device: str) -> None:
    """The eval batch runs the tower too: its forward on the eval rows, when larger than the eval phase
    (whose decoder forward holds, for a cross-attending model, the features, the mask and one layer's k/v)."""
    cj = vision_config(st) if st.evaluates else None
    shape = vision_shape(cj, st.fig.hidden_size) if cj is not None else None
    if shape is None:
        return
    img = image_tokens(shape, processor_settings(st), st.seq_len)
    n = row_images(st.images_per_row, img, st.seq_len, bool(shape.tiles))
    here = _forward(st, shape, img, st.eval_rows, n, device)
    cross = eval_bytes(st, device, n * img.tiles * img.patches) if shape.tiles else 0
    comp["eval_transient"][device] = max(comp["eval_transient"].get(device, 0) + cross, here)


def add_vision_upcast(st: StackSpec, comp: dict, params: int, device: str, notes: list[str]) -> None:
    """k-bit prep's fp32 copy of the vision parts' unquantized `params` (every non-4-bit bf16/fp16
    parameter is cast), until keep_vision_in casts them back: the load phase holds it beside the rest."""
    extra = 4 - dtype_bytes(st.dtype)
    if not (params and st.quantized and st.upcast_frozen and extra > 0):
        return
    comp["load_transient"][device] += params * extra
    notes.append(f"vision: k-bit prep holds the tower in fp32 while loading (+{fmt_bytes(params * extra)})")
