"""Each quant option loads the tiny model with the layer it names (bitsandbytes on CPU): NF4 and FP4 with
double quantization, int8, none; the non-quantized parts in the precision dtype."""

import bitsandbytes as bnb
import pytest
import torch
from conftest import compose_cfg

from qlora_recipes.model import loading
from qlora_recipes.units import torch_dtype


@pytest.mark.parametrize(
    "quant,layer",
    [("nf4", bnb.nn.Linear4bit), ("fp4", bnb.nn.Linear4bit), ("int8", bnb.nn.Linear8bitLt), ("none", torch.nn.Linear)],
)
def test_each_quant_option_loads_the_right_layer(quant, layer, run_dir):
    cfg = compose_cfg(f"quant={quant}")
    model = loading.load_model(cfg, run_dir)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is layer
    if quant in ("nf4", "fp4"):
        assert q_proj.weight.quant_type == quant
        assert q_proj.weight.quant_state.nested  # double quantization on
    assert model.lm_head.weight.dtype == torch_dtype(cfg.precision.dtype)  # non-quantized parts in the precision dtype
