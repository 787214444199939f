"""Dequantization: the fp32 weight of a bitsandbytes 4-bit or int8 layer, by bitsandbytes' own functional dequantize.

The merge adds the LoRA update to exactly these weights (the ones the adapter was trained against),
and the quality check runs the quantized stack with them in fp32 as its reference.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and bitsandbytes load lazily: the checks of bad input answer fast
    import torch


def bnb_kind(module) -> str | None:
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

    kind = bnb_kind(module)
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
