"""A vision-language model's processor, image-only when its video processor cannot be built.

transformers 5.23's Qwen2-VL, Qwen2.5-VL, Qwen3-VL and SmolVLM processors always build a video processor,
and video processors need torchvision, which a CPU-only stack may not have (its wheel for a given torch
can pull a CUDA torch). Image rows never reach the video processor, so when AutoProcessor fails for its
sake the same processor class is built from the dir without it: the family's image processor
(AutoImageProcessor picks the backend that works without torchvision), the tokenizer and the chat
template, through the class's own from_pretrained. It renders image rows as the full processor does,
saves as the same class (merge and generate load it back the same way), and refuses video in one line.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# an image-only class's __qualname__: the prefix, then the class it is made from
_IMAGE_ONLY = "ImageOnly_"
# where AutoProcessor looks for the processor class, in its order, before the model's config
_CLASS_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


class NoVideoProcessor:
    """The image-only processor's video processor: the settings some families read on every chat template
    (SmolVLM's num_frames and fps: none, as no video is sampled), and a refusal for video itself."""

    num_frames = None
    fps = None

    def __call__(self, *args, **kwargs):
        raise ValueError(
            "this processor was built without its video processor (it needs torchvision, which is not installed): "
            "it renders text and image rows only"
        )


def from_pretrained(source: dict):
    """AutoProcessor's processor for `source` (from_pretrained's arguments); when it fails for the video
    processor's sake, the same class without one. Any other failure propagates as AutoProcessor raised it."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(**source)
    except (ImportError, OSError, ValueError):  # how it fails without torchvision depends on the dir's files
        cls = _video_blocked_class(source)
        if cls is None:
            raise
    log.info(
        "processor: %s built without its video processor (torchvision is not installed): image and text rows only",
        cls.__name__,
    )
    return image_only(cls).from_pretrained(**source)


def import_failure(err: ImportError) -> tuple[str, str]:
    """What a processor's ImportError says (its first sentence) and what to install for it."""
    first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__).split(". ")[0]
    fix = "the torchvision built for your torch" if "torchvision" in first.lower() else "the package it names"
    return first, fix


def _video_blocked_class(source: dict) -> type | None:
    """The processor class of `source` when torchvision is missing and the class builds a video processor
    (AutoProcessor cannot build it then, whatever else it failed on), else None."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return None
    cls = processor_class(source)
    return cls if cls is not None and "video_processor" in cls.get_attributes() else None


def processor_class(source: dict) -> type | None:
    """The processor class AutoProcessor picks for `source`: the processor_class its processor, image
    processor or tokenizer config names, else the one transformers maps its model_type to; None for a
    class transformers does not ship (remote code)."""
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING, processor_class_from_name

    for name in _CLASS_FILES:
        found = _config_file(source, name).get("processor_class")
        if isinstance(found, str):
            return processor_class_from_name(found)
    try:
        config = AutoConfig.from_pretrained(**source)
    except (OSError, ValueError):
        return None
    return PROCESSOR_MAPPING[type(config)] if type(config) in PROCESSOR_MAPPING else None


def _config_file(source: dict, name: str) -> dict:
    """One of the dir's (or cached hub repo's) json configs, {} when it is missing or unreadable."""
    from transformers.utils import cached_file

    path = cached_file(
        source["pretrained_model_name_or_path"],
        name,
        revision=source.get("revision"),
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        _raise_exceptions_for_gated_repo=False,
    )
    if path is None:
        return {}
    try:
        found = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


@functools.cache
def image_only(cls: type) -> type:
    """`cls` without its video processor, saved under the same name (save_pretrained writes __name__ as its
    processor_class): its sub-processors are the rest of its attributes, and it is built with
    video_processor=None, which the processors' __init__ passes on and ProcessorMixin no longer checks.
    One class per family, found by pickle under its __qualname__ here (data loader workers, dataset maps)."""

    class ImageOnly(cls):
        video_processor = NoVideoProcessor()

        @classmethod
        def get_attributes(klass):
            return [name for name in cls.get_attributes() if name != "video_processor"]

        @classmethod
        def from_args_and_dict(klass, args, processor_dict, **kwargs):
            return super().from_args_and_dict(args, processor_dict, video_processor=None, **kwargs)

    ImageOnly.__name__ = cls.__name__
    ImageOnly.__qualname__ = _IMAGE_ONLY + cls.__name__
    ImageOnly.__module__ = __name__
    return ImageOnly


def __getattr__(name: str):
    """An image-only class by its __qualname__, made on first use (pickle looks it up here)."""
    if name.startswith(_IMAGE_ONLY):
        from transformers.models.auto.processing_auto import processor_class_from_name

        cls = processor_class_from_name(name[len(_IMAGE_ONLY) :])
        if cls is not None:
            return image_only(cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
