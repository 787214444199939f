"""`peft.experts=lora`: LoRA on the fused 3-D expert weights of MoE layers, as peft does it.

peft 0.21 adapts an nn.Parameter through `target_parameters`: its `lora.ParamWrapper` holds one rank-r
pair (A, B) per expert and, in forward, parametrizes the weight as W + B@A. That needs the weight in 16
bits, and it refuses LoRA dropout. Here `ExpertLora`, a ParamWrapper peft dispatches to for every experts
module (LoraConfig._register_custom_module), keeps peft's adapter tensors, names, init, saving and
`get_delta_weight` (so merge, resume and init_from see a plain peft adapter), and differs in two ways:
- on 4-bit experts (model/moe_experts.py) it adds nothing to the packed weight: the experts' own forward
  reads its factors and adds x@A_e then @B_e to each expert's rows, beside the dequantized matmul, so no
  16-bit expert weight outlives that matmul and no delta of the weight's size is formed;
- it builds with dropout 0 (and plain LoRA under DoRA): the configured dropout stays on the linears.
16-bit experts (quant=none, quant.experts=16bit) run peft's own parametrized forward.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from peft.tuners.lora.layer import ParamWrapper

from ..config.schema import PeftConfig
from .moe_experts import expert_weights, experts_module, is_4bit, lora_on_linears

log = logging.getLogger(__name__)
# peft 0.21 checks rank_pattern keys against the targeted modules only, and warns that those naming
# expert parameters "were ignored"; they are not (the wrappers get that rank)
RANK_PATTERN_WARNING = "The following rank_pattern keys did not match any targeted module"


def _plain(config):
    """The wrapper's view of the LoraConfig: no dropout (peft's ParamWrapper refuses it: x cannot be
    factored out of B@A(dropout(x)) once the update is folded into the weight), no DoRA."""
    return dataclasses.replace(config, lora_dropout=0.0, use_dora=False)


class ExpertLora(ParamWrapper):
    """peft's ParamWrapper over a fused experts weight, 4-bit or 16-bit (see the module's docstring)."""

    def __init__(self, base_layer, adapter_name: str, parameter_name: str, config, **kwargs) -> None:
        super().__init__(base_layer, adapter_name, parameter_name=parameter_name, config=_plain(config), **kwargs)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        super().update_layer(adapter_name, r, lora_alpha, config=_plain(config), **kwargs)

    def _get_in_out_features(self, module):
        param = self.get_param()
        if not is_4bit(param):
            return super()._get_in_out_features(module)
        experts, first, second = param.quant_state.shape  # the packed codes are 2-D; the weight's shape is here
        self.num_experts, self._param_ndim = experts, 3
        return first, second

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        if not is_4bit(self.get_param()):
            return super()._move_adapter_to_device_of_base_layer(adapter_name, device)
        for part in (self.lora_A, self.lora_B):  # the codes' device; the adapter keeps its own dtype
            if adapter_name in part:
                part[adapter_name] = part[adapter_name].to(self.get_param().device)

    def io_factors(self, adapter: str, layout: str, dtype: torch.dtype):
        """(first [E, in, r], second [E, r, out], scaling): x @ first @ second * scaling is x times this
        adapter's update of each expert, for a weight stored [E, out, in] ("oi") or [E, in, out] ("io").
        peft's `get_delta_factors` gives the update as lhs @ rhs in the stored layout."""
        a = self.lora_A[adapter].weight
        b = self.lora_B[adapter].weight
        a = a.reshape(self.num_experts, -1, a.shape[-1])  # [E, r, in_features]
        b = b.reshape(b.shape[0], -1, self.num_experts).permute(2, 0, 1)  # [E, out_features, r]
        lhs, rhs = (b, a) if self._did_swap_in_out_features else (a.transpose(-2, -1), b.transpose(-2, -1))
        first, second = (lhs, rhs) if layout == "io" else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
        return first.to(dtype), second.to(dtype), self.scaling[adapter]

    def forward(self, x, *args, **kwargs):
        if not is_4bit(self.get_param()):
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        off = self.disable_adapters or self.merged
        adapters = [] if off else [a for a in self.active_adapters if a in self.lora_A]
        base = self.get_base_layer()
        # the experts' forward (moe_experts._lora_rows) reads this while this wrapper's forward runs
        active = base.__dict__.setdefault("_expert_lora", {})
        active[self.parameter_name] = (self, adapters)
        try:
            return self.base_layer(x, *args, **kwargs)
        finally:
            active.pop(self.parameter_name, None)


# peft's injection tells its parameter wrappers (which it nests, one per targeted weight) from other tuner
# layers by the class name
ExpertLora.__name__ = "ParamWrapper"


def expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{name: module} of the model's fused experts modules (4-bit or 16-bit)."""
    return {name: m for name, m in model.named_modules() if experts_module(m)}


def _weight_names(module: torch.nn.Module) -> list[str]:
    own = dict(module.named_parameters(recurse=False))
    return [
        n
        for n in ("gate_up_proj", "up_proj", "down_proj")
        if n in own and (is_4bit(own[n]) or n in expert_weights(module))
    ]


def expert_rank(peft_cfg: PeftConfig, num_experts: int) -> int:
    """peft.expert_r, or peft's advice for it: max(1, r // num_experts)."""
    return int(peft_cfg.expert_r) if peft_cfg.expert_r else max(1, int(peft_cfg.r) // max(1, num_experts))


def peft_config(peft_cfg: PeftConfig, model: torch.nn.Module):
    """The LoraConfig of this run's peft group on `model`: LoRA on the linears (all-linear spelled out on
    MoE models, moe_experts.lora_on_linears) and, under peft.experts=lora, on every experts module's fused
    weights at rank peft.expert_r (rank_pattern), peft's wrapper replaced by ExpertLora (register)."""
    from .hf_configs import lora_config

    config = lora_config(lora_on_linears(peft_cfg, model))
    experts = expert_modules(model) if peft_cfg.experts == "lora" else {}
    if not experts:
        return config
    leaf = {name.rsplit(".", 1)[-1] for name in experts}
    weights = sorted({w for m in experts.values() for w in _weight_names(m)})
    targets = [f"{lf}.{w}" for lf in sorted(leaf) for w in weights]
    count = next(iter(experts.values())).num_experts
    rank = expert_rank(peft_cfg, count)
    config.target_parameters = targets
    config.rank_pattern = {**(config.rank_pattern or {}), **dict.fromkeys(targets, rank)}
    register(config, model)
    dropout = f"; peft.dropout={peft_cfg.dropout} on the linears only" if peft_cfg.dropout else ""
    dora = "; plain LoRA there under DoRA" if peft_cfg.method == "dora" else ""
    log.info(
        "peft: LoRA on the experts of %d MoE layers (%s), rank %d per expert (%d experts)%s%s",
        len(experts),
        ", ".join(weights),
        rank,
        count,
        dropout,
        dora,
    )
    return config


def register(config, model: torch.nn.Module):
    """`config` with ExpertLora as the LoRA layer of the model's experts classes, when it targets
    parameters (a saved adapter's config too: peft's own wrapper would refuse its dropout and cannot
    read 4-bit weights)."""
    if getattr(config, "target_parameters", None):
        config._register_custom_module({type(m): ExpertLora for m in expert_modules(model).values()})
    return config


def saved_as_peft_loads_it(model) -> None:
    """The adapter config a run saves says lora_dropout 0 when it targets expert parameters: peft's own
    ParamWrapper refuses any other value, and so plain peft (AutoPeftModelForCausalLM on the 16-bit base,
    what a pushed adapter's card shows) could not load it. The modules are built already: the linears keep
    the configured dropout while training, as the run's config.yaml records."""
    for config in model.peft_config.values():
        if getattr(config, "target_parameters", None):
            config.lora_dropout = 0.0


def load_adapter(base: torch.nn.Module, adapter_dir: str, is_trainable: bool = False):
    """peft's PeftModel.from_pretrained with the experts' wrapper registered."""
    from peft import LoraConfig, PeftModel

    config = register(LoraConfig.from_pretrained(adapter_dir), base)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", RANK_PATTERN_WARNING, RuntimeWarning)
        return PeftModel.from_pretrained(base, adapter_dir, config=config, is_trainable=is_trainable)
