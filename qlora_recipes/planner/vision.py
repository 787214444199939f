"""A vision-language model's vision tower and projector in the plan.

The figures (figures.py) describe a VLM's language model, from its config.json's text_config: its layers,
activations and loss are planned as a text model's at seq_len, where seq_len (and the data's longest row)
counts each image's tokens, as the processor renders the rows (data/images.py). Beside it:
- the vision tower and projector load unquantized and stay in the compute dtype (model/vision.py): their
  weights are a static row, counted from the model transformers builds on the meta device;
- k-bit prep (peft 0.21's prepare_model_for_kbit_training) casts every bf16/fp16 parameter that is not
  4-bit to fp32, the whole tower included, before model/vision.keep_vision_in casts it back: the load
  phase holds the tower in fp32 at its end;
- the tower's forward on a micro-batch's images (vision_forward.py): no gradient, nothing kept, a phase
  of its own before the decoder layers run, beside the text embeddings the image features go into.
The vision config comes from the run's config.json, or from a conf/model entry's vision_config (carried
on the figures as vision_config_json); without either the model is a text model.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..units import dtype_bytes
from .components import act_dtypes, eager
from .spec import StackSpec
from .vision_forward import forward_bytes, image_tokens, images_per_row, merge_bytes, vision_shape


def vision_config(st: StackSpec) -> dict[str, Any] | None:
    """The model's config as a dict with its vision_config (every default filled in when transformers
    knows the model type), or None for a text model."""
    folder = st.fig.config_dir
    if folder and (Path(folder) / "config.json").is_file():
        return _dir_config(folder, bool(st.fig.trust_remote_code))
    raw = getattr(st.fig, "vision_config_json", None)
    if not raw:
        return None
    vc = json.loads(raw)
    if not isinstance(vc, dict):
        return None
    from .figures import hf_config

    try:  # the whole VLM's config (figures.hf_config builds it from the entry): its projector's keys too
        full = hf_config(st.fig).to_dict()
    except (UserError, ValueError, TypeError):
        full = {}
    return full if isinstance(full.get("vision_config"), dict) else {"vision_config": _filled(vc)}


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
    if vision_config(st) is None:
        return 0
    from ..model.vision import meta_model, vision_prefixes

    if st.fig.config_dir:
        meta = meta_model(st.fig.config_dir, bool(st.fig.trust_remote_code))
        return sum(p.numel() for prefix in vision_prefixes(meta) for p in meta.get_submodule(prefix).parameters())
    return _entry_params(st)


def _entry_params(st: StackSpec) -> int:
    """A conf/model entry's VLM built on the meta device from its figures (figures.hf_config), else its
    vision tower alone from the vision_config."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText

    from ..model.vision import vision_prefixes
    from .figures import hf_config

    config = hf_config(st.fig)
    with init_empty_weights():
        if getattr(config, "vision_config", None) is not None:
            meta = AutoModelForImageTextToText.from_config(config, trust_remote_code=st.fig.trust_remote_code)
            return sum(p.numel() for pre in vision_prefixes(meta) for p in meta.get_submodule(pre).parameters())
        vc = json.loads(str(getattr(st.fig, "vision_config_json", None)))
        kwargs = {k: v for k, v in vc.items() if k != "model_type"}
        tower = AutoModel.from_config(AutoConfig.for_model(str(vc.get("model_type")), **kwargs))
    return sum(p.numel() for p in tower.parameters())


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


def add_vision_rows(st: StackSpec, comp: dict, counts: dict, device: str, notes: list[str]) -> int:
    """The vision parts' weights in the compute dtype, and their forward, on the device the model
    computes on; returns the parameter count (0 for a text model)."""
    cj = vision_config(st)
    params = vision_params(st) if cj is not None else 0
    if not params:
        return 0
    comp["other_params"][device] += params * dtype_bytes(st.dtype)
    counts["params_total"] += params
    note = (
        f"vision: the vision tower and projector ({params:,} params) stay unquantized in {st.dtype}; the "
        "sequence counts each image's tokens"
    )
    shape = vision_shape(cj, st.fig.hidden_size)
    if shape is None:
        notes.append(
            f"{note}; not counted: the tower's forward (its vision_config lacks its layers/hidden/heads/patch)"
        )
        return params
    img = image_tokens(shape, processor_settings(st), st.seq_len)
    comp["vision_forward"][device] += _forward(st, shape, img, st.train_rows, device)
    notes.append(
        f"{note}; the tower's forward ({shape.layers} layers of {img.tiles * img.patches} patches an image, "
        f"{img.tokens} image tokens each from {img.source}) is a phase of its own (and part of the eval "
        f"batch's), nothing of it kept for backward; planned for one image a row (seq_len holds up to "
        f"{images_per_row(img, st.seq_len)}: more images a row, more memory)"
    )
    return params


def _forward(st: StackSpec, shape, img, rows: int, device: str) -> int:
    """The tower's forward on `rows` rows, one image each (the planner does not read the data), beside
    the text embeddings, then the features written into their copy."""
    c, r, _ = act_dtypes(st, device == "cpu")
    embeds = rows * st.seq_len * st.fig.hidden_size * r
    tower = forward_bytes(shape, img, rows, c, eager(st))
    return embeds + max(tower, merge_bytes(rows, img, st.fig.hidden_size, c, r) + embeds)


def add_vision_eval(st: StackSpec, comp: dict, device: str) -> None:
    """The eval batch runs the tower too: its forward on the eval rows, when larger than the eval phase."""
    cj = vision_config(st) if st.evaluates else None
    shape = vision_shape(cj, st.fig.hidden_size) if cj is not None else None
    if shape is None:
        return
    img = image_tokens(shape, processor_settings(st), st.seq_len)
    here = _forward(st, shape, img, st.eval_rows, device)
    comp["eval_transient"][device] = max(comp["eval_transient"].get(device, 0), here)


def add_vision_upcast(st: StackSpec, comp: dict, params: int, device: str, notes: list[str]) -> None:
    """k-bit prep's fp32 copy of the whole tower (every non-4-bit bf16/fp16 parameter is cast, the
    tower's too), until keep_vision_in casts it back: the load phase holds it beside the rest."""
    extra = 4 - dtype_bytes(st.dtype)
    if not (params and st.quantized and st.upcast_frozen and extra > 0):
        return
    comp["load_transient"][device] += params * extra
    notes.append(f"vision: k-bit prep holds the tower in fp32 while loading (+{params * extra / 2**20:,.0f} MiB)")
