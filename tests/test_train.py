"""The real entry point on the tiny model: NF4 loading by bitsandbytes, k-bit prep, LoRA, TRL."""

import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from conftest import compose_cfg

from qlora_recipes import modeling
from qlora_recipes.training import train
from qlora_recipes.units import torch_dtype


def test_default_run_learns_and_writes_everything(run_dir):
    # In bf16, as pinned (recorded when bf16 was the default; precision=auto picks fp32 on CPUs without
    # native bf16), so the pin holds on every CPU the same stack ran on.
    cfg = compose_cfg("precision=bf16")
    m = train(cfg, run_dir)

    # The same seed trains the same curve as before the architecture move (tests/expected/).
    pinned = json.loads((Path(__file__).parent / "expected" / "default_run.json").read_text())
    assert m["train_losses"] == pytest.approx(pinned["train_losses"], rel=1e-4)
    assert m["eval_exact_match_before"] == pinned["eval_exact_match_before"]
    assert m["eval_exact_match"] == pinned["eval_exact_match"]
    assert m["eval_loss"] == pytest.approx(pinned["eval_loss"], rel=1e-4)
    assert m["steps"] == cfg.trainer.max_steps
    assert m["train_loss_last"] < 0.5 * m["train_loss_first"], m
    # Held-out exact match of greedy generations: near zero before, well above after.
    assert m["eval_exact_match_before"] <= 0.1
    assert m["eval_exact_match"] >= m["eval_exact_match_before"] + 0.3, m
    assert m["device"] == "cpu" and m["peak_mem_gib"] > 0 and m["tokens_per_s"] > 0
    saved = json.loads((run_dir / "metrics.json").read_text())
    for key in (
        "train_loss_first",
        "train_loss_last",
        "eval_loss",
        "eval_exact_match",
        "tokens_per_s",
        "peak_mem_gib",
        "device",
        "steps",
        "wall_s",
    ):
        assert saved[key] is not None, key
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (run_dir / "adapter" / "tokenizer.json").is_file()
    assert (run_dir / "config.yaml").is_file() and (run_dir / "plan.json").is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "quant,layer",
    [("nf4", bnb.nn.Linear4bit), ("fp4", bnb.nn.Linear4bit), ("int8", bnb.nn.Linear8bitLt), ("none", torch.nn.Linear)],
)
def test_each_quant_option_loads_the_right_layer(quant, layer, run_dir):
    cfg = compose_cfg(f"quant={quant}")
    model = modeling.load_model(cfg, run_dir)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is layer
    if quant in ("nf4", "fp4"):
        assert q_proj.weight.quant_type == quant
        assert q_proj.weight.quant_state.nested  # double quantization on
    assert model.lm_head.weight.dtype == torch_dtype(cfg.precision.dtype)  # non-quantized parts in the precision dtype


def _smoke(run_dir, *overrides):
    return train(compose_cfg("trainer=smoke", "data.metric=null", *overrides), run_dir)


@pytest.mark.parametrize("optim", ["paged8bit", "adamw8bit", "paged32bit", "adamw", "adafactor"])
def test_each_optim_option_takes_steps(optim, run_dir):
    m = _smoke(run_dir, f"optim={optim}")
    assert m["steps"] == 3 and m["train_loss_last"] > 0


@pytest.mark.parametrize(
    "stack",
    [
        ["quant=fp4"],
        ["quant=int8"],
        ["quant=none"],
        ["peft=dora"],
        ["peft=rslora"],
        ["precision=fp32"],
        ["trainer.checkpointing_mode=reentrant"],
        ["trainer.gradient_checkpointing=false"],
    ],
)
def test_stack_variants_train(stack, run_dir):
    m = _smoke(run_dir, *stack)
    assert m["steps"] == 3
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
