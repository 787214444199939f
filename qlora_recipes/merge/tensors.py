"""The merge itself: each LoRA update added into its base weight, streamed module by module.

    merged_tensors(model)                 # the dequantized base the adapter was trained against + update
    original_merged_tensors(model, cfg)   # the original 16-bit checkpoint (read from disk) + update

Both yield (name, fp32 tensor) one module at a time, decoder layer after decoder layer, so the caller
can write each tensor out and drop it. The update is peft's own `get_delta_weight` (B @ A times the
LoRA or rsLoRA scaling); DoRA rescales each output row by magnitude / ||W + dW||, the formula peft's
`merge` uses. Everything the adapter does not target is taken from the loaded stack (or checkpoint).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from .dequantize import bnb_kind, dequantize, dequantize_param

if TYPE_CHECKING:  # torch and peft load lazily: the checks of bad input answer fast
    import torch

log = logging.getLogger(__name__)


def _merged_adapters(module) -> list[str]:
    """The module's active adapters that hold a LoRA update (in activation order)."""
    embedding = getattr(module, "lora_embedding_A", {})
    return [a for a in module.active_adapters if a in module.lora_A or a in embedding]


def _add_update(module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (fp32) with the module's adapters merged in."""
    from peft.utils.other import transpose

    fan_in_fan_out = getattr(module, "fan_in_fan_out", False)
    variants = getattr(module, "lora_variant", {})
    for adapter in _merged_adapters(module):
        delta = module.get_delta_weight(adapter).float().to(weight.device)  # B @ A * scaling (LoRA, rsLoRA)
        variant = variants.get(adapter)
        if variant is None:
            weight = weight + delta
        elif type(variant).__name__ == "DoraLinearVariant":
            # DoRA: W' = m / ||W + dW||_row * (W + dW), the norm detached as in training (peft's merge).
            magnitude = module.lora_magnitude_vector[adapter]
            norm = magnitude.get_weight_norm(weight, transpose(delta, fan_in_fan_out), scaling=1).detach()
            weight = transpose((magnitude.weight.float() / norm).view(-1, 1), fan_in_fan_out) * (weight + delta)
        else:
            raise UserError(
                f"{type(variant).__name__} adapters cannot be merged by this script; merge LoRA, rsLoRA or DoRA"
            )
    return weight


def _merge_lora(module) -> dict[str, torch.Tensor]:
    """{"weight": W', ["bias": b']} of one peft LoRA layer, in fp32 on the layer's device."""
    base = module.get_base_layer()
    out = {"weight": _add_update(module, dequantize(base))}
    bias = base.bias.detach().float() if getattr(base, "bias", None) is not None else None
    for adapter in _merged_adapters(module):
        if module.lora_bias.get(adapter, False):
            extra = module.lora_B[adapter].bias.detach().float()
            bias = extra if bias is None else bias + extra
    if bias is not None:
        out["bias"] = bias
    return out


def _param_wrappers(module) -> tuple[dict, object]:
    """({weight name: its wrapper}, the wrapped module) of peft's nested parameter wrappers (LoRA on fused
    MoE expert weights, model/expert_lora.py); ({}, module) for any other module."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = {}
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return wrappers, module


def _peft_types():
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    return LoraLayer, BaseTunerLayer, ModulesToSaveWrapper, AuxiliaryTrainingWrapper


def _aligned(module):
    """Offloaded (accelerate hook) weights on the execution device while a module is read."""
    from contextlib import nullcontext

    if getattr(module, "_hf_hook", None) is None:
        return nullcontext()
    from accelerate.utils import align_module_device

    return align_module_device(module)


def merged_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged state dict of a peft stack, one tensor at a time in module order (so decoder layer
    by decoder layer), as fp32 tensors on the module's device. Tied weights come once."""
    LoraLayer, BaseTunerLayer, ModulesToSaveWrapper, AuxiliaryTrainingWrapper = _peft_types()
    seen: set[int] = set()

    def walk(module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        wrappers, module = _param_wrappers(module)
        if isinstance(module, LoraLayer):
            with _aligned(module.get_base_layer()):
                for name, tensor in _merge_lora(module).items():
                    yield prefix + name, tensor
            return
        if isinstance(module, ModulesToSaveWrapper):
            yield from walk(
                module.modules_to_save[module.active_adapters[0]] if module.active_adapters else module.original_module,
                prefix,
            )
            return
        if isinstance(module, (AuxiliaryTrainingWrapper, BaseTunerLayer)):
            raise UserError(
                f"{prefix.rstrip('.')}: a {type(module).__name__} adapter layer, which this script cannot merge"
            )
        with _aligned(module):
            if bnb_kind(module):  # a quantized layer the adapter does not target
                yield prefix + "weight", dequantize(module)
                if getattr(module, "bias", None) is not None:
                    yield prefix + "bias", module.bias.detach().float()
                return
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:  # tied weights: the first name only
                    continue
                seen.add(id(param))
                tensor = dequantize_param(param)  # 4-bit experts at their full shape
                yield prefix + name, _add_update(wrappers[name], tensor) if name in wrappers else tensor
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield prefix + name, buf.detach()
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(model.get_base_model(), "")


def _checkpoint_files(cfg) -> tuple[Path, list[tuple[Path, list[str]]]]:
    """The original checkpoint's safetensors files and their keys, in file order (local dir or hub cache)."""
    from ..model import loading

    source = loading.source(cfg.model)["pretrained_model_name_or_path"]
    folder = Path(source)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(
                snapshot_download(source, revision=cfg.model.revision, allow_patterns=["*.safetensors", "*.json"])
            )
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"--from-original: the original weights of model.name_or_path={source} are not here and could not be "
                f"downloaded ({first}); point model.name_or_path in config.yaml at a local copy, or merge into the "
                "dequantized base (without --from-original)"
            ) from None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, []).append(key)
        return folder, [(folder / f, keys) for f, keys in sorted(by_file.items())]
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return folder, [(single, list(f.keys()))]
    raise UserError(
        f"--from-original: {folder} has no model.safetensors or model.safetensors.index.json; the original weights "
        "must be in safetensors (convert them, or merge without --from-original)"
    )


def original_merged_tensors(model, cfg) -> Iterator[tuple[str, torch.Tensor]]:
    """The original 16-bit checkpoint, tensor by tensor from disk, with the adapter merged into the
    modules it targets (and modules_to_save replaced by their trained copies)."""
    import torch
    from safetensors import safe_open

    LoraLayer, _, ModulesToSaveWrapper, _ = _peft_types()
    base = model.get_base_model()
    lora_modules = {name for name, m in base.named_modules() if isinstance(m, LoraLayer) and not _param_wrappers(m)[0]}
    experts = {name: _param_wrappers(m)[0] for name, m in base.named_modules() if _param_wrappers(m)[0]}
    experts = {name: w for name, w in experts.items() if not name.endswith(".base_layer")}  # peft nests them
    saved_modules = {name: m for name, m in base.named_modules() if isinstance(m, ModulesToSaveWrapper)}
    merged: set[str] = set()
    _, files = _checkpoint_files(cfg)
    for path, keys in files:
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                module_name, _, attr = key.rpartition(".")
                if attr in experts.get(module_name, {}):  # a fused expert weight as the loaded model names it
                    wrapper = experts[module_name][attr]
                    device = next(wrapper.lora_A.parameters()).device
                    yield key, _add_update(wrapper, f.get_tensor(key).to(device).float())
                    merged.add(f"{module_name}.{attr}")
                elif module_name in lora_modules and attr == "weight":
                    module = base.get_submodule(module_name)
                    device = next(module.lora_A.parameters()).device if len(module.lora_A) else torch.device("cpu")
                    yield key, _add_update(module, f.get_tensor(key).to(device).float())
                    merged.add(module_name)
                elif module_name in lora_modules and attr == "bias":
                    module = base.get_submodule(module_name)
                    bias = f.get_tensor(key).float()
                    for adapter in module.active_adapters:
                        if module.lora_bias.get(adapter, False):
                            bias = bias + module.lora_B[adapter].bias.detach().float().cpu()
                    yield key, bias
                elif saved := next((n for n in saved_modules if key.startswith(n + ".")), None):
                    wrapper = saved_modules[saved]  # modules_to_save: the trained copy replaces the original
                    trained = wrapper.modules_to_save[wrapper.active_adapters[0]]
                    yield key, trained.get_parameter(key[len(saved) + 1 :]).detach()
                else:
                    yield key, f.get_tensor(key)
    merged_keys = {f"{m}.weight" for m in merged} | merged
    wanted = {f"{m}.weight" for m in lora_modules} | {f"{m}.{w}" for m, ws in experts.items() for w in ws}
    missing = sorted(wanted - merged_keys)
    if missing:
        raise UserError(
            f"--from-original: the original checkpoint has no weight for {len(missing)} adapted module(s) (e.g. "
            f"{missing[0]}); its tensor names differ from the loaded model's, merge without --from-original"
        )


def vision_keys(model) -> set[str]:
    """The checkpoint names of a vision-language model's vision tower and projector tensors that the run
    held as the base stored them (none for a text model): not under a LoRA layer (model.vision_tower=lora:
    those merge like the language model's) nor quantized (model.vision_tower=quantized: the dequantized
    weights the run trained with are written, as for the language model)."""
    from ..model.vision import config_is_vision_language, vision_prefixes

    base = model.get_base_model()
    if not config_is_vision_language(base.config.to_dict()):
        return set()
    names = {}
    for prefix in vision_prefixes(base):
        part = base.get_submodule(prefix)
        touched = [name for name, module in part.named_modules() if name and _adapted_or_quantized(module)]
        for name, tensor in part.state_dict().items():
            if not any(name.startswith(t + ".") for t in touched):
                names[f"{prefix}.{name}"] = tensor
    if getattr(base, "_weight_conversions", None):
        from transformers.core_model_loading import revert_weight_conversion

        names = revert_weight_conversion(base, names)
    return set(names)


def _adapted_or_quantized(module) -> bool:
    _, BaseTunerLayer, ModulesToSaveWrapper, AuxiliaryTrainingWrapper = _peft_types()
    wrapped = isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper, AuxiliaryTrainingWrapper))
    return wrapped or bool(bnb_kind(module)) or bool(_param_wrappers(module)[0])


def original_vision(cfg, keys: set[str], tensors: Iterator[tuple[str, torch.Tensor]]):
    """The merged stream with the vision parts' tensors (`keys`) read from the base checkpoint as stored:
    the adapter never touched them, and the run held them in its compute dtype, which may round them."""
    if not keys:
        yield from tensors
        return
    from contextlib import ExitStack

    from safetensors import safe_open

    _, files = _checkpoint_files(cfg)
    where = {key: path for path, names in files for key in names if key in keys}
    if len(where) < len(keys):  # a layout the checkpoint does not share: the loaded copies go instead
        log.warning(
            "%d vision tensor(s) (e.g. %s) are not in the base checkpoint under that name; written from the loaded model",
            len(keys) - len(where),
            sorted(keys - set(where))[0],
        )
    with ExitStack() as stack:
        opened = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in set(where.values())}
        for name, tensor in tensors:
            yield name, opened[where[name]].get_tensor(name) if name in where else tensor
