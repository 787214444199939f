"""Load the tokenizer and the (quantized) base, then make it trainable: k-bit prep and adapters."""

import logging
import os
from pathlib import Path

import torch
from omegaconf import DictConfig

from .errors import UserError
from .stack import bnb_config, lora_config, torch_dtype

log = logging.getLogger(__name__)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def device_name() -> str:
    return torch.cuda.get_device_name() if on_gpu() else "cpu"


def _source(cfg: DictConfig) -> dict:
    """from_pretrained's source arguments: a local dir if one exists, else a hub id."""
    path = cfg.model.name_or_path
    local = Path(path).expanduser()
    if not local.is_dir() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise UserError(f"model.name_or_path={path}: no such directory; give a local model dir in the HF layout or a hub id")
    return {
        "pretrained_model_name_or_path": str(local) if local.is_dir() else path,
        "trust_remote_code": cfg.model.trust_remote_code,
        "revision": cfg.model.revision,
    }


def _load_failed(cfg: DictConfig, what: str, err: Exception) -> UserError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return UserError(
        f"could not load the {what} of model.name_or_path={cfg.model.name_or_path} ({first}); "
        "offline, point model.name_or_path at a local dir in the HF layout"
    )


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(**_source(cfg))
    except (OSError, ValueError) as err:
        raise _load_failed(cfg, "tokenizer", err) from None
    if tokenizer.pad_token is None:  # Llama-style tokenizers ship without one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def parse_bytes(text: str, key: str) -> int:
    """'75GiB' / '80GB' / '512MiB' -> bytes; a clear error otherwise."""
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    s = str(text).strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if s.endswith(unit):
            try:
                value = float(s[: -len(unit)])
            except ValueError:
                break
            if value <= 0:
                raise UserError(f"offload.max_memory.{key}={text}: a budget must be positive")
            return int(value * scale)
    raise UserError(f"offload.max_memory.{key}={text}: not a size; write e.g. 75GiB, 80GB or auto")


def max_memory_map(cfg: DictConfig) -> dict | None:
    """The `max_memory` dict for from_pretrained: "gpu" expands to every visible GPU, "auto" is
    90 % of a GPU's memory and 80 % of host RAM."""
    import psutil

    spec = dict(cfg.offload.max_memory or {})
    if not spec:
        return None
    n_gpus = torch.cuda.device_count()
    result: dict = {}
    for key, value in spec.items():
        if key == "cpu":
            ram = psutil.virtual_memory().total
            result["cpu"] = int(0.8 * ram) if value == "auto" else parse_bytes(value, key)
            continue
        indices = range(n_gpus) if key == "gpu" else [int(key)] if str(key).isdigit() else None
        if indices is None:
            raise UserError(f"offload.max_memory has key {key!r}; use gpu, cpu or a GPU index like 0")
        for i in indices:
            if i >= n_gpus:
                raise UserError(f"offload.max_memory.{key}: GPU {i} does not exist here ({n_gpus} visible)")
            total = torch.cuda.get_device_properties(i).total_memory
            result[i] = int(0.9 * total) if value == "auto" else parse_bytes(value, key)
    return result


def device_map(cfg: DictConfig):
    if cfg.offload.device_map is None:
        # One device: this rank's GPU under torchrun, else GPU 0, else the CPU.
        return {"": int(os.environ.get("LOCAL_RANK", 0))} if on_gpu() else {"": "cpu"}
    return cfg.offload.device_map


def load_model(cfg: DictConfig, run_dir: Path):
    from transformers import AutoModelForCausalLM

    kwargs = dict(
        quantization_config=bnb_config(cfg),
        dtype=torch_dtype(cfg.precision.dtype),
        device_map=device_map(cfg),
        max_memory=max_memory_map(cfg),
        use_safetensors=True,
        attn_implementation=cfg.model.attn_implementation,
    )
    if cfg.offload.folder:
        folder = Path(cfg.offload.folder)
        kwargs["offload_folder"] = str(folder if folder.is_absolute() else run_dir / folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(**_source(cfg), **kwargs)
    except (OSError, ValueError) as err:
        raise _load_failed(cfg, "weights", err) from None
    model.config.use_cache = False  # the KV cache only costs memory while training
    _keep_4bit_layout_trainable(model)
    return model


def _keep_4bit_layout_trainable(model) -> None:
    """bitsandbytes 0.50 repacks a CPU Linear4bit's weight for AVX512-BF16 inference the first
    time it runs in eval mode, and that packed path (gemv_4bit) has no backward: training after an
    evaluation (our exact-match before training) would get no gradient through the frozen base.
    Keep the trainable layout; inference on CPU uses the dequantize path instead."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def make_trainable(cfg: DictConfig, model):
    """prepare_model_for_kbit_training for quantized bases, then the adapters from `peft`."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    t = cfg.trainer
    ckpt_kwargs = {"use_reentrant": t.checkpointing_mode == "reentrant"}
    if cfg.quant.method != "none":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=t.gradient_checkpointing, gradient_checkpointing_kwargs=ckpt_kwargs
        )
    elif t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
        model.enable_input_require_grads()
    try:
        return get_peft_model(model, lora_config(cfg))
    except ValueError as err:  # e.g. target modules not found in the base
        raise UserError(f"peft: {str(err).splitlines()[0]} (check peft.target_modules)") from None
