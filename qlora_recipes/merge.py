"""After training: merge a run's adapter into its base and save a standalone model, then measure the merge.

    merge(run_dir, out=None, from_original=False, shard_size="2GB", prompts_file=None, dtype=None) -> report

What is merged into what:

- default: the DEQUANTIZED 4-bit (or int8) base the adapter was trained against. The base is loaded
  exactly as the run loaded it (`modeling.load_model` with the run's `config.yaml`), each
  `Linear4bit` / `Linear8bitLt` weight is dequantized with bitsandbytes' own functional dequantize
  (in fp32), and the LoRA update is added with peft's merge math (`get_delta_weight`, which carries
  the LoRA or rsLoRA scaling; DoRA rescales each output row by magnitude / ||W + dW||, the same
  formula peft's `merge` uses). Everything else (embeddings, norms, lm_head, modules_to_save) is
  taken from the loaded stack, so the merged model is the trained model without the 4-bit packing.
- `from_original=True`: the original 16-bit weights of `model.name_or_path`, read tensor by tensor
  from its safetensors files, plus the same update. The result then differs from what was trained by
  the base's quantization error (the update was learnt against the quantized weights).

Streaming: tensors are produced one module at a time, decoder layer after decoder layer, cast to the
output dtype on the CPU and written to safetensors shards as soon as a shard is full, so CPU memory
stays near one shard (plus the 4-bit stack, which the run itself needed). Single shard:
`model.safetensors`; several: `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`.
The model is written to `<out>.partial` and renamed at the end: a failed merge leaves no half model.

Merge quality: the logits of the merged model (loaded with plain transformers, no peft, no
bitsandbytes, in fp32 where memory allows) against the base + adapter forward (the 4-bit stack with
its non-quantized parts and dequantization in fp32), on a few prompts from the run's eval data (or
`prompts_file`). The reference is the quantized stack, so the figure measures the merge, not
quantization; with `from_original` the same figure includes the quantization error, and a second
figure against the 16-bit original base + adapter (unmerged) measures the merge alone.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UserError

if TYPE_CHECKING:  # torch, transformers and peft load lazily: the checks of bad input answer fast
    import torch

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
REPORT = "merge_report.json"
DTYPES = ("bfloat16", "float16", "float32")
MAX_COMPARE_TOKENS = 64  # per prompt: the logits of every position are kept for the comparison
DEFAULT_COMPARE_PROMPTS = 8


# --------------------------------------------------------------------------------------------------
# Run dirs and merged dirs
# --------------------------------------------------------------------------------------------------


def is_merged_dir(path: Path) -> bool:
    """A standalone model dir: config.json with safetensors weights and no adapter."""
    return (
        (path / "config.json").is_file()
        and not (path / "adapter_config.json").is_file()
        and ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())
    )


def resolve_dir(path: str | Path, allow_merged: bool) -> tuple[str, Path]:
    """("run", run_dir) or ("merged", model_dir); a UserError naming what is missing otherwise.
    A run's `adapter/` dir is taken as its run dir."""
    raw = str(path)
    path = Path(raw).expanduser()
    usage = "pass a run dir (config.yaml + adapter/ written by train.py)" + (
        " or a merged model dir (config.json + safetensors, written by scripts/merge.py)" if allow_merged else ""
    )
    if not path.exists():
        raise UserError(f"{raw}: no such directory; {usage}")
    if not path.is_dir():
        raise UserError(f"{raw}: is a file, not a directory; {usage}")
    if (path / "adapter_config.json").is_file() and (path.parent / "config.yaml").is_file():
        path = path.parent  # run/adapter -> run
    if (path / "config.yaml").is_file():
        if not (path / "adapter" / "adapter_config.json").is_file():
            raise UserError(
                f"{raw}: a run dir without a saved adapter (no adapter/adapter_config.json); train.py saves it when "
                "training finishes, so let the run finish (or point at a finished run)"
            )
        if not (path / "adapter" / ADAPTER_WEIGHTS).is_file():
            raise UserError(
                f"{raw}: adapter/ has no {ADAPTER_WEIGHTS}; the adapter was not saved completely, re-run training"
            )
        return "run", path
    if is_merged_dir(path):
        if not allow_merged:
            raise UserError(f"{raw}: is already a merged model (config.json, no adapter); {usage}")
        return "merged", path
    if (path / "adapter_config.json").is_file():
        raise UserError(
            f"{raw}: a bare adapter dir with no run config next to it; {usage} (the run dir holds config.yaml, "
            "which says which base and quantization the adapter was trained with)"
        )
    merged = " and not a merged model (no config.json with safetensors weights)" if allow_merged else ""
    raise UserError(f"{raw}: not a run dir (no config.yaml and adapter/){merged}; {usage}")


def load_run_config(run_dir: Path):
    """The run's fully resolved config.yaml, typed by the schema."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .schema import TrainConfig

    path = run_dir / "config.yaml"
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(path))
    except (OmegaConfBaseException, ValueError) as err:  # yaml errors are ValueErrors too
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{path}: not a config this version of train.py wrote ({first}); re-run training") from None
    return cfg


def run_prompt_style(run_dir: Path, cfg) -> str:
    """How the run's prompts were rendered: "chat" (messages / conversational prompt_completion),
    "alpaca" (instruction rows wrapped in the Alpaca template) or "plain"."""
    fmt, conversational = cfg.data.format, False
    metrics = run_dir / "metrics.json"
    if metrics.is_file():
        try:
            stats = json.loads(metrics.read_text()).get("data") or {}
        except (json.JSONDecodeError, OSError):
            stats = {}
        fmt = stats.get("format", fmt)
        conversational = bool(stats.get("conversational", False))
    if fmt == "messages" or conversational:
        return "chat"
    if fmt == "alpaca":
        return "alpaca"
    return "plain"


# --------------------------------------------------------------------------------------------------
# The adapter against its base
# --------------------------------------------------------------------------------------------------


def _adapter_config(adapter_dir: Path) -> dict:
    path = adapter_dir / "adapter_config.json"
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as err:
        raise UserError(
            f"{path}: not readable JSON ({err}); the adapter was not saved completely, re-run training"
        ) from None


def _same_base(a: str, b: str) -> bool:
    """Same base model: equal ids, the same existing dir, or the same last path component (a run dir
    moved with the repository, or a hub id against a local copy named after it)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists() and pa.resolve() == pb.resolve():
        return True
    return pa.name.lower() == pb.name.lower()


def check_adapter_base(cfg, run_dir: Path) -> dict:
    """The adapter must have been trained on the base the run's config loads (by name)."""
    adapter_cfg = _adapter_config(run_dir / "adapter")
    if adapter_cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(
            f"{run_dir}/adapter: a {adapter_cfg.get('peft_type')} adapter; only LoRA/DoRA/rsLoRA adapters merge"
        )
    trained_on = adapter_cfg.get("base_model_name_or_path")
    loads = cfg.model.name_or_path
    if trained_on and not _same_base(str(trained_on), str(loads)):
        raise UserError(
            f"{run_dir}/adapter was trained on base {trained_on} (adapter_config.json base_model_name_or_path) but "
            f"{run_dir}/config.yaml loads model.name_or_path={loads}; an adapter only fits the base it was trained on: "
            "set model.name_or_path in config.yaml to that base (if it is the same model at another path, fix "
            "base_model_name_or_path in adapter_config.json)"
        )
    return adapter_cfg


def check_adapter_shapes(model, run_dir: Path, adapter_cfg: dict) -> None:
    """Every adapter tensor must fit a module of the loaded base (shapes), before peft loads it (peft
    would fail with a size-mismatch traceback, or skip modules it cannot find with only a warning)."""
    from safetensors import safe_open

    path = run_dir / "adapter" / ADAPTER_WEIGHTS
    trained_on = adapter_cfg.get("base_model_name_or_path") or "an unknown base"
    fix = f"the adapter was trained on {trained_on}: load that base (model.name_or_path in {run_dir}/config.yaml)"
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise UserError(f"{path}: not a readable safetensors file ({err}); re-run training") from None
    for key, shape in shapes.items():
        name = key.removeprefix("base_model.model.")
        marker = next((m for m in (".lora_A.", ".lora_B.", ".lora_magnitude_vector") if m in name), None)
        if marker is None:
            continue  # modules_to_save copies, trainable tokens: peft checks those itself
        module_name, side = name.split(marker)[0], "in" if marker == ".lora_A." else "out"
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise UserError(
                f"{run_dir}/adapter does not fit the loaded base {model.name_or_path}: it has weights for "
                f"{module_name}, which the base does not have; {fix}"
            ) from None
        if not hasattr(module, "in_features"):
            continue  # embeddings / convolutions: shapes checked by peft
        want = module.in_features if side == "in" else module.out_features
        got = shape[1] if marker == ".lora_A." else shape[0]
        if got != want:
            raise UserError(
                f"{run_dir}/adapter does not fit the loaded base {model.name_or_path}: {module_name} has "
                f"{side}_features={want} in the base but the adapter's {name} has shape {list(shape)}; {fix}"
            )


def load_stack(cfg, run_dir: Path, adapter_cfg: dict | None = None):
    """The stack the run trained and evaluated: its (quantized) base via `modeling.load_model`, plus
    the saved adapter, in eval mode."""
    adapter_cfg = adapter_cfg if adapter_cfg is not None else check_adapter_base(cfg, run_dir)
    from peft import PeftModel

    from . import modeling

    base = modeling.load_model(cfg, run_dir)
    check_adapter_shapes(base, run_dir, adapter_cfg)
    try:
        model = PeftModel.from_pretrained(base, str(run_dir / "adapter"), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{run_dir}/adapter could not be loaded onto {cfg.model.name_or_path} ({first})") from None
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------
# Merge math
# --------------------------------------------------------------------------------------------------


def _bnb_kind(module) -> str | None:
    """Which bitsandbytes layer this module itself is: "4bit", "8bit" or None (a peft wrapper's `weight`
    is its base layer's, so only the module's own parameters count)."""
    weight = module._parameters.get("weight")
    name = type(weight).__name__ if weight is not None else ""
    return "4bit" if name == "Params4bit" else "8bit" if name == "Int8Params" else None


def dequantize(module) -> torch.Tensor:
    """The fp32 weight of a bitsandbytes Linear4bit / Linear8bitLt, by bitsandbytes' own functional
    dequantize (for 4 bit: the stored codes times the (double-quantized) block absmax, in fp32)."""
    import bitsandbytes.functional as F
    import torch

    kind = _bnb_kind(module)
    weight = module.weight
    if kind == "4bit":
        state = weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            raise RuntimeError(
                f"{type(module).__name__} weight was repacked for CPU inference; load with modeling.load_model"
            )
        state = copy.copy(state)  # shallow: only the output dtype changes
        state.dtype = torch.float32
        return F.dequantize_4bit(weight.data, state)
    if kind == "8bit":
        state = getattr(module, "state", None)
        cb = weight.data if weight.dtype == torch.int8 else state.CB
        scb = getattr(weight, "SCB", None)
        if scb is None:
            scb = state.SCB
        return F.int8_vectorwise_dequant(cb, scb.to(cb.device)).float()
    return weight.detach().float()


def _merge_lora(module) -> dict[str, torch.Tensor]:
    """{"weight": W', ["bias": b']} of one peft LoRA layer, in fp32 on the layer's device."""
    from peft.utils.other import transpose

    base = module.get_base_layer()
    weight = dequantize(base)
    bias = base.bias.detach().float() if getattr(base, "bias", None) is not None else None
    fan_in_fan_out = getattr(module, "fan_in_fan_out", False)
    variants = getattr(module, "lora_variant", {})
    for adapter in module.active_adapters:
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        delta = module.get_delta_weight(adapter).float().to(weight.device)  # B @ A * scaling (LoRA, rsLoRA)
        variant = variants.get(adapter)
        if variant is None:
            weight = weight + delta
        elif type(variant).__name__ == "DoraLinearVariant":
            # DoRA: W' = m / ||W + dW||_row * (W + dW), the norm detached as in training (peft's merge).
            magnitude = module.lora_magnitude_vector[adapter]
            norm = magnitude.get_weight_norm(weight, transpose(delta, fan_in_fan_out), scaling=1).detach()
            factor = transpose((magnitude.weight.float() / norm).view(-1, 1), fan_in_fan_out)
            weight = factor * (weight + delta)
        else:
            raise UserError(
                f"{type(variant).__name__} adapters cannot be merged by this script; merge LoRA, rsLoRA or DoRA"
            )
        if module.lora_bias.get(adapter, False):
            extra = module.lora_B[adapter].bias.detach().float()
            bias = extra if bias is None else bias + extra
    out = {"weight": weight}
    if bias is not None:
        out["bias"] = bias
    return out


def _adapter_delta(module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (a 16-bit original, as fp32) with the module's adapters merged in."""
    from peft.utils.other import transpose

    fan_in_fan_out = getattr(module, "fan_in_fan_out", False)
    for adapter in module.active_adapters:
        if adapter not in module.lora_A and adapter not in getattr(module, "lora_embedding_A", {}):
            continue
        delta = module.get_delta_weight(adapter).float().to(weight.device)
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is None:
            weight = weight + delta
        elif type(variant).__name__ == "DoraLinearVariant":
            magnitude = module.lora_magnitude_vector[adapter]
            norm = magnitude.get_weight_norm(weight, transpose(delta, fan_in_fan_out), scaling=1).detach()
            weight = transpose((magnitude.weight.float() / norm).view(-1, 1), fan_in_fan_out) * (weight + delta)
        else:
            raise UserError(
                f"{type(variant).__name__} adapters cannot be merged by this script; merge LoRA, rsLoRA or DoRA"
            )
    return weight


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
            if _bnb_kind(module):  # a quantized layer the adapter does not target
                yield prefix + "weight", dequantize(module)
                if getattr(module, "bias", None) is not None:
                    yield prefix + "bias", module.bias.detach().float()
                return
            for name, param in module._parameters.items():
                if param is None or id(param) in seen:  # tied weights: the first name only
                    continue
                seen.add(id(param))
                yield prefix + name, param.detach()
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield prefix + name, buf.detach()
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(model.get_base_model(), "")


def _checkpoint_files(cfg) -> tuple[Path, list[tuple[Path, list[str]]]]:
    """The original checkpoint's safetensors files and their keys, in file order (local dir or hub cache)."""
    from . import modeling

    source = modeling._source(cfg)["pretrained_model_name_or_path"]
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
    lora_modules = {name for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    saved_modules = {name: m for name, m in base.named_modules() if isinstance(m, ModulesToSaveWrapper)}
    merged: set[str] = set()
    _, files = _checkpoint_files(cfg)
    for path, keys in files:
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                module_name, _, attr = key.rpartition(".")
                if module_name in lora_modules and attr == "weight":
                    module = base.get_submodule(module_name)
                    device = next(module.lora_A.parameters()).device if len(module.lora_A) else torch.device("cpu")
                    yield key, _adapter_delta(module, f.get_tensor(key).to(device).float())
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
    missing = sorted(lora_modules - merged)
    if missing:
        raise UserError(
            f"--from-original: the original checkpoint has no weight for {len(missing)} adapted module(s) (e.g. "
            f"{missing[0]}.weight); its tensor names differ from the loaded model's, merge without --from-original"
        )


# --------------------------------------------------------------------------------------------------
# Writing shards
# --------------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """--shard-size: '2GB' / '500MB' / '512MiB' / a number of bytes."""
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    s = str(text).strip().lower().replace(" ", "")
    value = None
    for unit, scale in units.items():
        if s.endswith(unit):
            try:
                value = float(s[: -len(unit)]) * scale
            except ValueError:
                value = None
            break
    else:
        try:
            value = float(s)
        except ValueError:
            value = None
    if value is None or not math.isfinite(value) or value < 1:
        raise UserError(f"--shard-size {text}: not a positive size; write e.g. 2GB, 500MB or 512MiB")
    return int(value)


class ShardWriter:
    """Accumulate tensors (on the CPU, in the output dtype) and write a safetensors shard whenever the
    next tensor would take the current one past `max_bytes`; `close` names the shards as
    transformers does and writes the index when there is more than one."""

    def __init__(self, folder: Path, max_bytes: int, dtype: torch.dtype):
        self.folder, self.max_bytes, self.dtype = folder, max_bytes, dtype
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0
        self.params = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise RuntimeError(f"tensor {name} written twice")
        self.names.add(name)
        out = tensor.to("cpu", dtype=self.dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        nbytes = out.numel() * out.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = out
        self.size += nbytes
        self.total += nbytes
        self.params += out.numel()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buffer:
            return
        name = f"shard-{len(self.files) + 1:05d}.tmp"
        save_file(self.buffer, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def close(self) -> list[str]:
        self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for (tmp, keys), final in zip(self.files, names, strict=True):
            (self.folder / tmp).rename(self.folder / final)
            weight_map.update(dict.fromkeys(keys, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total, "total_parameters": self.params}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return names


def _write_config(model, folder: Path, dtype: torch.dtype, names: set[str]) -> None:
    """The base's config.json without quantization, with the merged dtype; its generation config.
    An adapted lm_head of a tied model is written separately, so the merged model is untied."""
    config = copy.deepcopy(model.get_base_model().config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in names:
        config.tie_word_embeddings = False
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(str(folder))
    gen = getattr(model.get_base_model(), "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(folder))


def _prepare_out(out: Path, run_dir: Path) -> Path:
    out = out.expanduser()
    if out.resolve() in (run_dir.resolve(), (run_dir / "adapter").resolve()):
        raise UserError(
            f"--out {out}: is the run dir (or its adapter dir); choose a new dir, e.g. {run_dir / 'merged'}"
        )
    if out.exists():
        if not out.is_dir():
            raise UserError(f"--out {out}: exists and is a file; choose a dir")
        if any(out.iterdir()) and not (is_merged_dir(out) or (out / REPORT).is_file()):
            raise UserError(
                f"--out {out}: exists and holds other files (not a merged model); choose a new or empty dir"
            )
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


# --------------------------------------------------------------------------------------------------
# Comparing logits
# --------------------------------------------------------------------------------------------------


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def to_fp32_reference(model) -> None:
    """Run the quantized stack in fp32: non-quantized parameters upcast (exactly), 4-bit layers
    dequantized to and computing in fp32, so only the merge (not bf16 rounding) separates it from
    the merged model loaded in fp32."""
    import torch

    for module in model.modules():
        if _bnb_kind(module) == "4bit":
            module.compute_dtype = torch.float32
            module.compute_type_is_set = True
            module.weight.quant_state.dtype = torch.float32
        if _bnb_kind(module) == "8bit" and module.weight.device.type == "cpu":
            # bitsandbytes' CPU int8 path used in training multiplies by the dequantized weight; its
            # inference path also quantizes the activations. The layer itself has no dropout.
            module.train()
        for param in module._parameters.values():
            if (
                param is not None
                and param.is_floating_point()
                and param.dtype != torch.float32
                and not _bnb_kind(module)
            ):
                param.data = param.data.float()
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[name] = buf.float()


def _reload_saved_modules(model, run_dir: Path) -> None:
    """modules_to_save copies were trained (and saved) in fp32 but load into the base's dtype; once
    upcast, load their saved values again so they are exactly the trained ones."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    _, _, ModulesToSaveWrapper, _ = _peft_types()
    if any(isinstance(m, ModulesToSaveWrapper) for m in model.modules()):
        set_peft_model_state_dict(model, load_file(str(run_dir / "adapter" / ADAPTER_WEIGHTS)))


def prompt_logits(model, batches: list[dict], pad_id: int = 0) -> list[torch.Tensor]:
    """fp32 CPU logits of each prompt, all prompts in one right-padded forward (causal attention: the
    padding after a prompt cannot change its positions); the padded positions are dropped."""
    import torch

    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    lengths = [b["input_ids"].shape[1] for b in batches]
    ids = torch.full((len(batches), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, b in enumerate(batches):
        ids[i, : lengths[i]] = b["input_ids"][0]
        mask[i, : lengths[i]] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    return [logits[i, :n].float().cpu() for i, n in enumerate(lengths)]


def logit_diff(merged: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    import torch

    diffs = [(m - r).abs() for m, r in zip(merged, ref, strict=True)]
    allref = torch.cat([r.flatten() for r in ref])
    agree = sum(int((m.argmax(-1) == r.argmax(-1)).sum()) for m, r in zip(merged, ref, strict=True))
    tokens = sum(r.shape[0] for r in ref)
    return {
        "max_abs_diff": max(float(d.max()) for d in diffs),
        "mean_abs_diff": float(sum(float(d.sum()) for d in diffs) / sum(d.numel() for d in diffs)),
        "ref_logit_absmax": float(allref.abs().max()),
        "ref_logit_std": float(allref.std()),
        "argmax_agreement": agree / tokens,
    }


def compare_prompts(cfg, run_dir: Path, tokenizer, prompts_file: str | None, style: str) -> tuple[list[dict], str]:
    """Tokenized prompts for the comparison (at most MAX_COMPARE_TOKENS each) and where they came from."""
    from . import data
    from .generation import Prompt, read_prompts, render

    if prompts_file:
        prompts, source = read_prompts(prompts_file), str(prompts_file)
    else:
        try:
            train_ds, eval_ds, stats = data.load_splits(cfg.data, None, cfg.trainer.seq_len, cfg.seed)
            ds = eval_ds if eval_ds is not None else train_ds
            if stats["format"] == "text":
                prompts = [
                    Prompt("formatted", t) for t in ds.select(range(min(DEFAULT_COMPARE_PROMPTS, len(ds))))["text"]
                ]
            else:
                pairs = data.generation_pairs(ds, stats["format"], DEFAULT_COMPARE_PROMPTS)
                prompts = [Prompt("messages" if isinstance(p, list) else "formatted", p) for p, _ in pairs]
            split = "eval" if eval_ds is not None else "train"
            source = f"{split} data of the run ({stats['eval_source'] if eval_ds is not None else stats['source']})"
        except UserError as err:
            log.warning("the run's data cannot be read (%s); comparing on generic prompts", err)
            prompts, source = (
                [Prompt("text", t) for t in GENERIC_PROMPTS],
                "generic prompts (the run's data is unavailable)",
            )
    batches = []
    for prompt in prompts:
        text, special = render(tokenizer, prompt, style)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"][:, :MAX_COMPARE_TOKENS]
        if ids.shape[1]:
            batches.append({"input_ids": ids})
    if not batches:
        raise UserError(f"{source}: every prompt is empty after tokenization; give prompts with text")
    return batches, source


GENERIC_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def _compare_dtype(total_bytes: int, saved_dtype: torch.dtype) -> torch.dtype:
    """fp32 for the merged model's forward when an fp32 copy fits comfortably, else its saved dtype."""
    import psutil
    import torch

    fp32 = total_bytes * 4 // torch.tensor([], dtype=saved_dtype).element_size()
    budget = 0.6 * psutil.virtual_memory().available
    if torch.cuda.is_available():
        budget += sum(0.8 * torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return torch.float32 if fp32 < budget else saved_dtype


def _load_plain(folder: Path, dtype: torch.dtype):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype}
    if torch.cuda.is_available():
        kwargs["device_map"] = "auto"
    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------
# The whole step
# --------------------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def quality_line(report: dict) -> str:
    c = report["compare"]
    main = c["vs_base_plus_adapter"]
    line = (
        f"merge quality: max |dlogit| {_fmt(main['max_abs_diff'])}, mean {_fmt(main['mean_abs_diff'])} "
        f"(logit absmax {main['ref_logit_absmax']:.3g}, argmax agrees {100 * main['argmax_agreement']:.1f}%) "
        f"vs {main['reference']} on {c['prompts']} prompts / {c['tokens']} tokens, {c['dtype']}"
    )
    if "vs_original_plus_adapter" in c:
        orig = c["vs_original_plus_adapter"]
        line += (
            f"; this includes the {report['quant']} quantization error: vs the 16-bit original + adapter "
            f"max {_fmt(orig['max_abs_diff'])}, mean {_fmt(orig['mean_abs_diff'])}"
        )
    return line


def merge(
    run_dir: str | Path,
    out: str | Path | None = None,
    from_original: bool = False,
    shard_size: str | int = "2GB",
    prompts_file: str | Path | None = None,
    dtype: str | None = None,
) -> dict:
    """Merge the run's adapter, save the standalone model in `out` (default `<run_dir>/merged`),
    compare logits, write `merge_report.json` there; returns the report."""
    from .generation import read_prompts

    started = time.time()
    _, run_dir = resolve_dir(run_dir, allow_merged=False)
    cfg = load_run_config(run_dir)
    max_bytes = shard_size if isinstance(shard_size, int) else parse_size(shard_size)
    if max_bytes < 1:
        raise UserError(f"--shard-size {shard_size}: must be positive")
    dtype = dtype or cfg.precision.dtype
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if prompts_file:
        read_prompts(prompts_file)  # a bad prompts file fails before any work
    out = Path(out).expanduser() if out else run_dir / "merged"
    adapter_cfg = check_adapter_base(cfg, run_dir)
    partial = _prepare_out(out, run_dir)
    try:
        report = _merge_into(partial, run_dir, cfg, adapter_cfg, from_original, max_bytes, prompts_file, dtype)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    report["out_dir"] = str(out)
    report["wall_s"] = time.time() - started
    (partial / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return report


def _merge_into(
    partial: Path,
    run_dir: Path,
    cfg,
    adapter_cfg: dict,
    from_original: bool,
    max_bytes: int,
    prompts_file,
    dtype_name: str,
) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from . import modeling

    out_dtype = getattr(torch, dtype_name)
    style = run_prompt_style(run_dir, cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "adapter"))
    except (OSError, ValueError):
        tokenizer = modeling.load_tokenizer(cfg)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batches, prompts_source = compare_prompts(
        cfg, run_dir, tokenizer, str(prompts_file) if prompts_file else None, style
    )

    # 1. The stack the run trained, in fp32: reference logits (and the base alone, for scale).
    model = load_stack(cfg, run_dir, adapter_cfg)
    to_fp32_reference(model)
    _reload_saved_modules(model, run_dir)
    ref = prompt_logits(model, batches, tokenizer.pad_token_id)
    with model.disable_adapter():
        base_only = prompt_logits(model, batches, tokenizer.pad_token_id)

    # 2. Stream the merged tensors into shards, module by module (decoder layer by decoder layer).
    merge_started = time.time()
    writer = ShardWriter(partial, max_bytes, out_dtype)
    tensors = original_merged_tensors(model, cfg) if from_original else merged_tensors(model)
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UserError(f"the merged {name} has NaN/inf values; the adapter is broken (check the run's loss)")
        writer.add(name, tensor)
    files = writer.close()
    _write_config(model, partial, out_dtype, writer.names)
    tokenizer.save_pretrained(str(partial))
    merge_s = time.time() - merge_started
    base_name = model.get_base_model().config._name_or_path
    tensors = model = None  # the generator holds the stack too
    _free()

    # 3. With --from-original: the 16-bit original base + adapter (unmerged), the merge-only reference.
    orig_ref = None
    compare_dtype = _compare_dtype(writer.total, out_dtype)
    if from_original:
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": compare_dtype}
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto"
        original = AutoModelForCausalLM.from_pretrained(**modeling._source(cfg), **kwargs)
        original = PeftModel.from_pretrained(original, str(run_dir / "adapter"), is_trainable=False).eval()
        orig_ref = prompt_logits(original, batches, tokenizer.pad_token_id)
        original = None
        _free()

    # 4. The merged model as anyone would load it: plain transformers, no quantization config.
    merged_model = _load_plain(partial, compare_dtype)
    got = prompt_logits(merged_model, batches, tokenizer.pad_token_id)
    merged_model = None

    bits = {"nf4": "4-bit nf4", "fp4": "4-bit fp4", "int8": "int8"}.get(cfg.quant.method)
    compare = {
        "dtype": str(compare_dtype).removeprefix("torch."),
        "prompts": len(batches),
        "tokens": sum(b["input_ids"].shape[1] for b in batches),
        "prompts_source": prompts_source,
        "vs_base_plus_adapter": {
            **logit_diff(got, ref),
            "reference": f"{bits} base + adapter" if bits else "base + adapter",
            "includes_quantization_error": bool(from_original and bits),
        },
        # how far the adapter moves the base's logits: the scale a merge error is small against
        "adapter_effect": {
            k: v for k, v in logit_diff(ref, base_only).items() if k in ("max_abs_diff", "mean_abs_diff")
        },
    }
    if orig_ref is not None:
        compare["vs_original_plus_adapter"] = {
            **logit_diff(got, orig_ref),
            "reference": "16-bit original base + adapter",
        }
    return {
        "run_dir": str(run_dir),
        "merged_into": "original 16-bit weights" if from_original else (f"dequantized {bits} base" if bits else "base"),
        "base": base_name or cfg.model.name_or_path,
        "quant": cfg.quant.method,
        "peft": cfg.peft.method,
        "dtype": dtype_name,
        "files": files,
        "total_bytes": writer.total,
        "shard_size_bytes": max_bytes,
        "prompt_style": style,
        "max_new_tokens": cfg.data.max_new_tokens,
        "compare": compare,
        "merge_s": merge_s,
    }
