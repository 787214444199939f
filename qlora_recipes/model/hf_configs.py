"""Library objects built from a composed stack: BitsAndBytesConfig, LoraConfig, SFTConfig.

All translation from our option names to the libraries' arguments lives here, so a new option is
one file in conf/ plus, at most, one branch below.
"""

import logging
from pathlib import Path

from ..config.schema import ModelConfig, OffloadConfig, PeftConfig, QuantConfig
from ..units import torch_dtype

log = logging.getLogger("train")


def skip_modules(quant: QuantConfig, model: ModelConfig) -> list[str] | None:
    """What bitsandbytes leaves unquantized. None: transformers' default (the output embedding, tied
    weights). A `quant.skip_modules` list *replaces* that default in transformers, which would
    quantize the output head (TRL's fused LM head then fails in training), so the default is added
    back: the output embedding always stays unquantized."""
    user = [str(m) for m in quant.skip_modules]
    if not user:
        return None
    return sorted(set(user) | set(output_modules(model)))


def output_modules(model: ModelConfig) -> list[str]:
    """transformers' own default skip list for this model (output embedding, tied weights, last
    module: `get_keys_to_not_convert`), from an empty-weights skeleton of its config; `lm_head`
    when the config cannot be read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    path = str(model.name_or_path)
    local = Path(path).expanduser()
    remote = model.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(
            str(local) if local.is_dir() else path, trust_remote_code=remote, revision=model.revision
        )
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
        return sorted(get_keys_to_not_convert(skeleton))
    except (OSError, ValueError, KeyError, ImportError):  # no config here: the name every known family uses
        return ["lm_head"]


def bnb_config(quant: QuantConfig, offload: OffloadConfig, model: ModelConfig):
    """The quantization config for from_pretrained, or None for quant=none."""
    from transformers import BitsAndBytesConfig

    # Quantized layers offloaded to CPU/disk must stay unquantized fp32 there (transformers rule).
    cpu_offload = offload.device_map == "auto"
    if quant.method in ("nf4", "fp4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant.method,
            bnb_4bit_use_double_quant=quant.double_quant,
            bnb_4bit_compute_dtype=torch_dtype(quant.compute_dtype),
            bnb_4bit_quant_storage=torch_dtype(quant.storage_dtype),
            llm_int8_skip_modules=skip_modules(quant, model),
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    if quant.method == "int8":
        return BitsAndBytesConfig(
            load_in_8bit=True,
            llm_int8_threshold=quant.int8_threshold,
            llm_int8_skip_modules=skip_modules(quant, model),
            llm_int8_enable_fp32_cpu_offload=cpu_offload,
        )
    return None


def lora_config(peft_cfg: PeftConfig):
    from peft import LoraConfig

    p = peft_cfg
    targets = p.target_modules if isinstance(p.target_modules, str) else list(p.target_modules)
    return LoraConfig(
        r=p.r,
        lora_alpha=p.alpha,
        lora_dropout=p.dropout,
        target_modules=targets,
        modules_to_save=list(p.modules_to_save) if p.modules_to_save else None,
        use_dora=p.method == "dora",
        use_rslora=p.method == "rslora",
        bias="none",
        task_type="CAUSAL_LM",
    )
