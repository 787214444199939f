"""Vision-language models (LLaVA-style): what tells one apart, and how it loads and trains.

A model is a VLM when its config.json has a `vision_config`, or transformers maps its config to an
image-text-to-text class and not to a causal LM, or `model.vision=true` says so. It loads through
AutoModelForImageTextToText with its AutoProcessor (image-only without torchvision: model/processor.py):
the language model in 4 bits, the vision tower and projector unquantized in the compute dtype, LoRA on the
language model's linears only.

The modules kept out of bitsandbytes are named by their full prefixes (`model.vision_tower`): transformers
5.23 matches `llm_int8_skip_modules` against full module names, so the bare `vision_tower` skips
nothing and the tower is quantized silently. The prefixes come from the model transformers builds on
the meta device: every part of the base model beside its language model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from pathlib import Path

import torch

from ..config.model_dir import config_json_path
from ..config.schema import ModelConfig, PeftConfig
from ..errors import UserError

log = logging.getLogger(__name__)


def is_vision_language(model: ModelConfig) -> bool:
    """model.vision when set, else what the model's config.json says; without a config.json here, whether
    the conf/model entry carries the checkpoint's vision_config."""
    stated = getattr(model, "vision", None)
    if stated is not None:
        return bool(stated)
    path = config_json_path(model)
    if path is None:
        return bool(getattr(model, "vision_config", None))
    try:
        cj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # check_model_dir refuses it in its own line
    return isinstance(cj, dict) and config_is_vision_language(cj)


def config_is_vision_language(cj: dict) -> bool:
    """A config.json's shape: a vision sub-config, or a model_type transformers loads as image-text-to-text
    and not as a causal LM (a multimodal checkpoint whose text model also loads alone stays a causal LM
    unless it has a vision config)."""
    if isinstance(cj.get("vision_config"), dict):
        return True
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    kind = str(cj.get("model_type", "")).lower()
    return kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def refuse_untried(cfg) -> None:
    """One line for what a vision-language model does not train with yet (tried: one process or DDP,
    objective=sft, no offloading), before anything is planned, loaded or written."""
    from . import vision_tower

    vision_tower.check(cfg, is_vision_language(cfg.model))  # model.vision_tower: a choice it cannot carry out
    if not is_vision_language(cfg.model):
        return
    untried = {
        "objective": cfg.objective.name if cfg.objective.name != "sft" else None,
        "dist": cfg.dist.strategy if cfg.dist.strategy in ("fsdp", "zero3") else None,
        "offload.device_map": cfg.offload.device_map,
    }
    for key, value in untried.items():
        if value is not None:
            raise UserError(
                f"{key}={value}: a vision-language model trains with objective=sft, without sharding or "
                f"offloading, for now; drop {key}"
            )


def load_processor(model: ModelConfig, source: dict):
    """The model's AutoProcessor (its tokenizer, image processor and chat template), with a pad token;
    image-only when its video processor needs torchvision and torchvision is not installed."""
    from transformers import ProcessorMixin

    from . import processor as processors

    try:
        processor = processors.from_pretrained(source)
    except ImportError as err:  # a package the processor needs: SmolVLM's num2words, or torchvision itself
        first, fix = processors.import_failure(err)
        raise UserError(
            f"could not load the processor of vision-language model.name_or_path={model.name_or_path} ({first}); "
            f"install {fix}, then run again"
        ) from None
    except (OSError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"could not load the processor of vision-language model.name_or_path={model.name_or_path} ({first}); "
            "the dir needs processor_config.json (or preprocessor_config.json) beside its tokenizer"
        ) from None
    if not isinstance(processor, ProcessorMixin):
        raise UserError(
            f"model.name_or_path={model.name_or_path} is a vision-language model but has no processor (only "
            f"a {type(processor).__name__}); save its processor there (processor.save_pretrained)"
        )
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:  # Llama-style tokenizers ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return processor


@functools.lru_cache(maxsize=4)
def meta_model(config_dir: str, trust_remote_code: bool):
    """The VLM transformers builds from config_dir's config.json, on the meta device (no weights): its
    module names and parameter counts, for the loader's prefixes and the planner's vision row."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        return AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)


def language_model(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """(full prefix, module) of the VLM's language model (its decoder), as transformers names it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for name, module in model.named_modules():
        if module is decoder and name:
            return name, module
    raise UserError(
        f"{type(model).__name__}: no language model found inside it (get_decoder); this vision-language "
        "family cannot be trained here yet"
    )


def vision_prefixes(model: torch.nn.Module) -> list[str]:
    """Full prefixes of the parts beside the language model that hold weights (vision tower, projector):
    the siblings of the language model inside the base model, never the output head."""
    lm_name, _ = language_model(model)
    parent_name = lm_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    head = model.get_output_embeddings()
    found = []
    for child, module in parent.named_children():
        full = f"{parent_name}.{child}" if parent_name else child
        if full == lm_name or module is head or not any(True for _ in module.parameters()):
            continue
        found.append(full)
    return found


def skipped_from_quantization(model: ModelConfig, user: list[str] | None) -> list[str]:
    """What bitsandbytes leaves unquantized in a VLM: transformers' own default (the output head, tied
    weights), the user's quant.skip_modules, and the vision parts by their full prefixes."""
    from transformers.quantizers.base import get_keys_to_not_convert

    meta = meta_model(_config_dir(model), bool(model.trust_remote_code))
    from .vision_tower import left_unquantized

    default = set(get_keys_to_not_convert(meta))
    return sorted(default | set(user or ()) | set(left_unquantized(meta, vision_prefixes(meta), model.vision_tower)))


def _config_dir(model: ModelConfig) -> str:
    path = config_json_path(model)
    if path is None:
        raise UserError(
            f"model.name_or_path={model.name_or_path}: no config.json to read here; a vision-language model "
            "loads from a local dir in the HF layout (or a hub id already in the HF cache)"
        )
    return str(Path(path).parent)


def keep_vision_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The vision parts back in the compute dtype after k-bit prep (which upcasts every non-4-bit weight
    to fp32): they are frozen and unquantized, and fp32 copies would double their memory."""
    from .vision_tower import cast_unquantized

    for prefix in vision_prefixes(model):  # a quantized tower's 4-bit weights stay as they are
        cast_unquantized(model.get_submodule(prefix), dtype)


def lora_on_language_model(peft_cfg: PeftConfig, model: torch.nn.Module, tower: bool = False) -> PeftConfig:
    """`peft_cfg` with its target modules limited to the language model: all-linear, or a list of leaf
    names, becomes a regular expression over the language model's linears. A regular expression the
    user wrote is theirs and stays as given."""
    targets = peft_cfg.target_modules
    lm_name, lm = language_model(model)
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and n})
    if isinstance(targets, str) and targets != "all-linear":
        return peft_cfg
    names = linears if targets == "all-linear" else [str(t) for t in targets]
    missing = [n for n in names if n not in linears]
    if missing:
        raise UserError(
            f"peft.target_modules: {missing} name no linear layer of the language model ({', '.join(linears)}); "
            "LoRA on a vision-language model adapts its language model"
        )
    pattern = rf"{re.escape(lm_name)}\..*\.({'|'.join(map(re.escape, names))})"
    if tower:  # model.vision_tower=lora: the tower's linears too
        from .vision_tower import lora_pattern

        tower_pattern, tower_names = lora_pattern(model, vision_prefixes(model))
        log.info("peft: LoRA on the vision tower's linears too (%s)", ", ".join(tower_names))
        return dataclasses.replace(peft_cfg, target_modules=f"(?:{pattern})|(?:{tower_pattern})")
    log.info(
        "peft: LoRA on the language model's linears (%s); the vision tower and projector stay frozen", ", ".join(names)
    )
    return dataclasses.replace(peft_cfg, target_modules=pattern)
