"""The real entry point on the tiny model: NF4 loading by bitsandbytes, k-bit prep, LoRA, TRL: each
optimizer and stack variant takes its steps. The default run itself (its pinned curve, what it writes)
is checked on the README's `make train` run: tests/e2e/test_readme.py."""

import pytest


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
