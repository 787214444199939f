"""Dequantization: the fp32 weight of a bitsandbytes 4-bit or int8 layer, by the libraries' own dequantizers.

The merge adds the LoRA update to exactly these weights (the ones the adapter was trained against),
and the quality check runs the quantized stack with them in fp32 as its reference.

peft's `dequantize_bnb_weight` does the int8 case; for 4 bit it would dequantize into the layer's compute
dtype (bf16 on the default stack) and round away what fp32 keeps, so the 4-bit case calls bitsandbytes'
`dequantize_4bit` (the function peft calls) with an fp32 output instead. MoE experts stored in 4 bits
(`model/moe_experts.py`: fused 3-D weights as Params4bit, no Linear4bit around them) are dequantized by
that module's own function, at their full shape, in fp32: what the experts' forward computed with.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and bitsandbytes load lazily: the checks of bad input answer fast
    import torch


def bnb_kind(module) -> str | None:
    """Which bitsandbytes layer this module itself is: "4bit", "8bit" or None (a peft wrapper's `weight`
    is its base layer's, so only the module's own parameters count)."""
    from peft.utils.integrations import get_bnb_param_type

    weight = module._parameters.get("weight")
    return (get_bnb_param_type(weight) or None) if weight is not None else None


def dequantize(module) -> torch.Tensor:
    """The fp32 weight of a bitsandbytes Linear4bit / Linear8bitLt (for 4 bit: the stored codes times the
    (double-quantized) block absmax, in fp32); any other module's weight as fp32."""
    import bitsandbytes.functional as F
    import torch
    from peft.utils.integrations import dequantize_bnb_weight

    kind = bnb_kind(module)
    weight = module.weight
    if kind == "4bit":
        state = weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            raise RuntimeError(
                f"{type(module).__name__} weight was repacked for CPU inference; load with model.loading.load_model"
            )
        state = copy.copy(state)  # shallow: only the output dtype changes
        state.dtype = torch.float32
        return F.dequantize_4bit(weight.data, state)
    if kind == "8bit":
        state = getattr(module, "state", None)
        if weight.dtype != torch.int8:  # int8 codes kept in the matmul state rather than in the weight
            return F.int8_vectorwise_dequant(state.CB, state.SCB.to(state.CB.device)).float()
        return dequantize_bnb_weight(weight, state).float()
    return weight.detach().float()


def dequantize_param(param) -> torch.Tensor:
    """The fp32 weight of a 4-bit parameter that no Linear4bit holds (a fused MoE expert weight, at its
    full [experts, ., .] shape); any other parameter as it is."""
    import torch

    from ..model.moe_experts import dequantized, is_4bit

    return dequantized(param, torch.float32) if is_4bit(param) else param.detach()
