"""The real entry point on the tiny model: NF4 loading by bitsandbytes, k-bit prep, LoRA, TRL."""

import json
from pathlib import Path

import pytest
from conftest import compose_cfg

from qlora_recipes.run.training import train


def test_default_run_learns_and_writes_everything(run_dir):
    cfg = compose_cfg("precision=fp32")  # the reproducible curve; precision=auto's pick: test_precision_auto.py
    m = train(cfg, run_dir)

    # The same seed trains the same curve (tests/expected/).
    pinned = json.loads((Path(__file__).parents[1] / "expected" / "default_run.json").read_text())
    assert m["train_losses"] == pytest.approx(pinned["train_losses"], rel=1e-4)
    assert m["eval_exact_match_before"] == pinned["eval_exact_match_before"]
    assert m["eval_exact_match"] == pinned["eval_exact_match"]
    assert m["eval_loss"] == pytest.approx(pinned["eval_loss"], rel=1e-4)
    assert m["steps"] == cfg.trainer.max_steps
    assert m["train_loss_last"] < 0.5 * m["train_loss_first"], m
    # Held-out exact match of greedy generations: near zero before, well above after.
    assert m["eval_exact_match_before"] <= 0.15  # 7 of 64 in fp32
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


# paged8bit is the default: every smoke run of the suite takes its steps with it.
@pytest.mark.parametrize("optim", ["adamw8bit", "paged32bit", "adamw", "adafactor"])
def test_each_optim_option_takes_steps(optim, smoke_run):
    m, _ = smoke_run(f"optim={optim}")
    assert m["steps"] == 3 and m["train_loss_last"] > 0


@pytest.mark.parametrize(
    "stack",
    [
        ["quant=fp4"],
        ["quant=int8"],
        # quant=none: test_frozen_parts_train_in_the_dtype_asked_for[none-False] trains it (without
        # quantization there is no k-bit prep for precision.upcast_frozen to turn off: the same run)
        ["peft=dora"],
        ["peft=rslora"],
        ["precision=fp32"],
        ["trainer.checkpointing_mode=reentrant"],
        ["trainer.gradient_checkpointing=false"],
    ],
)
def test_stack_variants_train(stack, run_dir, smoke_run):
    m, _ = smoke_run(*stack)
    assert m["steps"] == 3
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
