"""Packed rows train on CPU with each packing strategy."""

import pytest
from conftest import SMOKE, compose_cfg


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_packed_training_runs_on_cpu(strategy, smoke_run):
    m, _ = smoke_run("data.packing=true", f"data.packing_strategy={strategy}")
    assert m["steps"] == compose_cfg(*SMOKE).trainer.max_steps
    assert m["train_loss_first"] > 0 and m["train_loss_last"] > 0
