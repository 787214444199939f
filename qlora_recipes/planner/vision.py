"""A vision-language model's vision tower and projector in the plan.

The figures (figures.py) describe a VLM's language model, from its config.json's text_config: its layers,
activations and loss are planned as a text model's at seq_len, where seq_len (and the data's longest row)
counts each image's tokens, as the processor renders the rows (data/images.py). Beside it, the vision tower
and the projector load unquantized and stay in the compute dtype (model/vision.py): their weights are a
static row here, counted from the model transformers builds on the meta device. Not counted yet: the
vision tower's forward activations (it runs without gradients, so nothing of it is kept for backward)
and k-bit prep's one-tensor fp32 upcast of it while loading.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..units import dtype_bytes
from .spec import StackSpec


def vision_params(st: StackSpec) -> int:
    """Parameters of the vision tower and projector of the model `st` plans, 0 for a text model."""
    folder = st.fig.config_dir
    if not folder:
        return 0
    try:
        cj = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    if not isinstance(cj, dict) or not isinstance(cj.get("vision_config"), dict):
        return 0
    from ..model.vision import meta_model, vision_prefixes

    meta = meta_model(folder, bool(st.fig.trust_remote_code))
    return sum(p.numel() for prefix in vision_prefixes(meta) for p in meta.get_submodule(prefix).parameters())


def add_vision_rows(st: StackSpec, comp: dict, counts: dict, device: str, notes: list[str]) -> None:
    """The vision parts' weights, in the compute dtype, on the device the model computes on."""
    params = vision_params(st)
    if not params:
        return
    comp["other_params"][device] += params * dtype_bytes(st.dtype)
    counts["params_total"] += params
    notes.append(
        f"vision: the vision tower and projector ({params:,} params) stay unquantized in {st.dtype}; the "
        "sequence counts each image's tokens; not counted yet: the vision tower's forward activations"
    )
