"""peft.adapter_dtype=bfloat16: the plan counts the adapters and their gradients at 2 bytes an element and
drops autocast's bf16 copies of fp32 adapters; the 8-bit optimizer state is the same; the table says bf16."""

from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.planner.report import render_table


def _plan(*overrides):
    cfg = compose_cfg("recipe=llama3.1-8b-24gb", "peft.dropout=0", "precision.upcast_frozen=false", *overrides)
    return planner.plan(cfg, gpus=[24 * 2**30], host_ram=128 * 2**30, world_size=1, ladder=False)


def test_bf16_adapters_halve_the_adapter_rows_and_keep_the_optimizer_state():
    fp32, bf16 = _plan("peft.adapter_dtype=float32"), _plan("peft.adapter_dtype=bfloat16")
    row = lambda p, k: p["components"][k]["cuda:0"]  # noqa: E731
    assert row(bf16, "lora_weights") * 2 == row(fp32, "lora_weights")
    assert row(bf16, "gradients") * 2 == row(fp32, "gradients")
    assert row(bf16, "optimizer_state") == row(fp32, "optimizer_state")
    # autocast copies fp32 adapters to bf16 in each layer's recompute; bf16 ones are used as they are
    assert row(bf16, "layer_working") < row(fp32, "layer_working")
    table = render_table(bf16)
    assert "adapter weights (bf16)" in table and "gradients (bf16)" in table
    assert "adapter weights (fp32)" in render_table(fp32) and "adapter_dtype" not in fp32["stack"]
