"""Image size bounds of image rows: what the processor resizes each image to (data.image_max_pixels,
data.image_min_pixels, data.image_longest_edge), and the largest file a row may hold
(data.image_file_max_pixels).

transformers 5.23's image processors size an image in one of three ways, and each key maps onto one:
- pixel counts (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V: a patch_size, a merge_size, and
  `size = {shortest_edge: min pixels, longest_edge: max pixels}`): each image is resized to between
  min and max pixels, its tokens about pixels / (patch x merge)^2; image_max_pixels / image_min_pixels.
- a longest edge (Idefics3, SmolVLM, Pixtral: `size = {longest_edge: px}`): the longer side is resized
  to at most that many pixels (Idefics3 then splits it into max_image_size tiles); image_longest_edge.
- one size for every image (CLIP's shortest edge and centre crop, SigLIP's or Gemma 3's height x
  width): every image is the same pixels and tokens, so no bound applies and a key set is refused.

The bounds are set on the processor before the rows are counted, so trainer.seq_len=auto counts the
tokens the bounded images make, and the processor saved with the adapter keeps them for generation.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config.schema import DataConfig
from ..errors import UserError

log = logging.getLogger(__name__)

PIXEL_KEYS = ("image_max_pixels", "image_min_pixels")


def bound_processor(processor: Any, data: DataConfig) -> None:
    """The processor's image processor resized within data.image_* (in place)."""
    bound_image_processor(getattr(processor, "image_processor", None), data)


def bound_image_processor(image_processor: Any, data: DataConfig) -> None:
    """The image processor resized within data.image_* (in place); a key it cannot take, or bounds that
    contradict each other, is one line."""
    wanted = {k: getattr(data, k) for k in (*PIXEL_KEYS, "image_longest_edge") if getattr(data, k) is not None}
    if not wanted:
        return
    kind = size_kind(image_processor)
    name = type(image_processor).__name__
    for key, value in wanted.items():
        takes = "pixels" if key in PIXEL_KEYS else "edge"
        if kind != takes:
            raise UserError(f"data.{key}={value}: {name} {_how(image_processor, kind)}; drop data.{key}")
    if kind == "pixels":
        _bound_pixels(image_processor, name, wanted)
    else:
        image_processor.size = type(image_processor.size)(longest_edge=int(wanted["image_longest_edge"]))
    log.info("data: %s resizes images within %s", name, dict(image_processor.size))


def size_kind(image_processor: Any) -> str:
    """How the image processor sizes an image: `pixels` (min/max pixel counts), `edge` (a longest edge)
    or `fixed` (one size for every image, or none this module knows)."""
    size = getattr(image_processor, "size", None)
    keys = {k for k in ("shortest_edge", "longest_edge", "height", "width") if _get(size, k) is not None}
    merged = getattr(image_processor, "merge_size", None) and getattr(image_processor, "patch_size", None)
    if keys == {"shortest_edge", "longest_edge"} and merged:
        return "pixels"
    return "edge" if keys == {"longest_edge"} else "fixed"


def _how(image_processor: Any, kind: str) -> str:
    """What the processor takes instead, for a refusal line."""
    if kind == "pixels":
        return "sizes images by pixel count; set data.image_max_pixels / data.image_min_pixels instead"
    if kind == "edge":
        return "sizes images by their longest edge; set data.image_longest_edge instead"
    size = {k: v for k, v in dict(getattr(image_processor, "size", None) or {}).items() if v is not None}
    crop = getattr(image_processor, "crop_size", None)
    crop_note = f", then crops {dict((k, v) for k, v in dict(crop).items() if v is not None)}" if crop else ""
    return (
        f"resizes every image to one size ({size}{crop_note}), so each image makes the same tokens and takes no bound"
    )


def _bound_pixels(image_processor: Any, name: str, wanted: dict) -> None:
    size = image_processor.size
    low = int(wanted.get("image_min_pixels", _get(size, "shortest_edge")))
    high = int(wanted.get("image_max_pixels", _get(size, "longest_edge")))
    unit = (int(image_processor.patch_size) * int(image_processor.merge_size)) ** 2  # one image token's pixels
    if high < unit:
        raise UserError(
            f"data.image_max_pixels={high} is less than one image token of {name} ({unit} pixels, "
            f"{int(unit**0.5)}x{int(unit**0.5)}); give at least {unit}"
        )
    if low > high:
        which = "data.image_min_pixels" if "image_min_pixels" in wanted else f"{name}'s own minimum"
        raise UserError(
            f"data.image_max_pixels={high} is below {which} ({low}); raise data.image_max_pixels or set "
            "data.image_min_pixels at most that"
        )
    image_processor.size = type(size)(shortest_edge=low, longest_edge=high)


def _get(size: Any, key: str) -> Any:
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)
