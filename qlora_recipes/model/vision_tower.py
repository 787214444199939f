"""What a vision-language model's vision tower does in training: model.vision_tower.

- frozen (the default): the tower and the projector load unquantized, stay in the compute dtype and train
  nothing; LoRA is on the language model only.
- quantized: the tower's linears load in quant's format (NF4/FP4/int8, as the language model's), frozen;
  the projector stays unquantized. Its weights take about a quarter of their bf16 bytes in NF4.
- lora: the tower stays unquantized in the compute dtype, and LoRA adapts its linears too (the adapters
  train, the base weights stay frozen), so the tower learns the run's images.

The tower is the vision part with the most parameters (model/vision.py's vision_prefixes names every
part beside the language model; the projector, or Idefics3's connector, is the smaller one).
"""

from __future__ import annotations

import re

import torch

from ..errors import UserError

CHOICES = ("frozen", "quantized", "lora")


def check(cfg, vision_language: bool) -> None:
    """One line for a tower choice the stack cannot carry out, before anything is planned or loaded."""
    choice = getattr(cfg.model, "vision_tower", "frozen")
    if choice == "frozen":
        return
    if not vision_language:
        raise UserError(
            f"model.vision_tower={choice}: model.name_or_path={cfg.model.name_or_path} is a text model, with no "
            "vision tower; drop model.vision_tower"
        )
    if choice == "quantized" and cfg.quant.method == "none":
        raise UserError(
            "model.vision_tower=quantized puts the tower's linears in quant's format, and quant=none quantizes "
            "nothing; set quant=nf4 (or fp4, int8), or drop model.vision_tower"
        )
    if choice == "lora" and isinstance(cfg.peft.target_modules, str) and cfg.peft.target_modules != "all-linear":
        raise UserError(
            "model.vision_tower=lora adds LoRA to the tower's linears, and peft.target_modules is a regular "
            "expression of yours that decides alone; name the tower's modules in it and drop model.vision_tower, "
            "or use all-linear or a list of names"
        )


def tower_prefix(model: torch.nn.Module, parts: list[str]) -> str:
    """The full prefix of the vision tower: of the vision parts (full prefixes), the one with the most
    parameters."""
    if not parts:
        raise UserError(f"{type(model).__name__}: no vision tower found beside its language model")
    return max(parts, key=lambda p: sum(t.numel() for t in model.get_submodule(p).parameters()))


def left_unquantized(model: torch.nn.Module, parts: list[str], choice: str) -> list[str]:
    """The vision parts bitsandbytes must skip: all of them, or all but the tower under `quantized`."""
    return [p for p in parts if p != tower_prefix(model, parts)] if choice == "quantized" else parts


def cast_unquantized(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """The module's floating-point weights and buffers in `dtype`; quantized weights (stored as integers)
    stay as they are."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)


def lora_pattern(model: torch.nn.Module, parts: list[str]) -> tuple[str, list[str]]:
    """A regular expression over the tower's linears (every leaf name of an nn.Linear in it), and those
    names: what model.vision_tower=lora adds to the language model's targets."""
    prefix = tower_prefix(model, parts)
    tower = model.get_submodule(prefix)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in tower.named_modules() if isinstance(m, torch.nn.Linear) and n})
    if not names:
        raise UserError(f"model.vision_tower=lora: the vision tower {prefix} has no linear layers to adapt")
    return rf"{re.escape(prefix)}\..*\.({'|'.join(map(re.escape, names))})", names


def unhook_frozen_tower(model: torch.nn.Module, parts: list[str]) -> None:
    """transformers' enable_input_require_grads (called by our checkpointing, peft, TRL's trainers and the
    Trainer's own checkpointing) hooks the input embeddings of every PreTrainedModel in `model`, the vision
    tower's patch embeddings too: a tower that trains nothing would then build its forward's autograd graph
    and keep each checkpointed layer's input. Drop that hook now and after every later call, while no
    tower parameter requires grad (the language model's hook stays: its LoRA needs the gradient)."""
    tower = model.get_submodule(tower_prefix(model, parts))
    if "enable_input_require_grads" not in model.__dict__:  # an instance attribute: every later call too
        own = model.enable_input_require_grads

        def language_model_only() -> None:
            own()
            _drop_hooks(tower)

        model.enable_input_require_grads = language_model_only
    _drop_hooks(tower)


def _drop_hooks(tower: torch.nn.Module) -> None:
    """Remove every hook enable_input_require_grads put on the tower's input embeddings (whichever call
    put it, its handle kept or not), unless the tower trains; and the tower's layers' checkpointing: with
    no graph they have nothing to recompute (reentrant checkpointing would warn at each of them)."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    if any(p.requires_grad for p in tower.parameters()):  # e.g. LoRA on it: its layers need the gradient
        return
    for layer in tower.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer.gradient_checkpointing = False
    ours = {c for c in PreTrainedModel.enable_input_require_grads.__code__.co_consts if hasattr(c, "co_name")}
    for embedding in _input_embeddings(tower):
        for key, hook in list(embedding._forward_hooks.items()):
            if getattr(hook, "__code__", None) in ours:
                embedding._forward_hooks.pop(key)
                embedding._forward_hooks_with_kwargs.pop(key, None)
                embedding._forward_hooks_always_called.pop(key, None)


def _input_embeddings(tower: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embeddings of each PreTrainedModel in the tower, as enable_input_require_grads finds them."""
    from transformers import PreTrainedModel

    found = []
    for sub in tower.modules():
        if isinstance(sub, PreTrainedModel):
            try:
                embedding = sub.get_input_embeddings()
            except NotImplementedError:
                continue
            if embedding is not None and hasattr(embedding, "_forward_hooks"):
                found.append(embedding)
    return found
