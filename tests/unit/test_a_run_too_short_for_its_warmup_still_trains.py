"""A schedule whose warmup leaves no step with a non-zero learning rate (warmup rises from 0: one
step with one warmup step) runs without warmup, saying so in one line; longer runs keep theirs."""

import logging

import pytest
import torch
from transformers import TrainingArguments

from qlora_recipes.run.schedule import continue_schedule, lr_factors, scheduler_for


@pytest.mark.parametrize("scheduler", ["cosine", "linear", "constant_with_warmup"])
def test_one_step_with_one_warmup_step_trains_at_the_full_rate(scheduler, tmp_path, caplog):
    args = TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type=scheduler, warmup_steps=0.03)
    one, six = continue_schedule(None, args, 1), continue_schedule(None, args, 6)
    assert args.get_warmup_steps(1) == 1 and one["warmup"] == 0 and lr_factors(one, 0) == [1.0]
    # a longer run keeps its warmup: step 1 at 0 (as transformers has it), the next ones above 0
    assert six["warmup"] == 1 and lr_factors(six, 0) == [0.0] and lr_factors(six, 1)[0] > 0

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with caplog.at_level(logging.WARNING, logger="qlora_recipes.run.schedule"):
        assert scheduler_for(one, args, optimizer, resumed=False) is not None
        assert scheduler_for(six, args, torch.optim.SGD([torch.zeros(1)], lr=1.0), resumed=False) is None
    assert optimizer.param_groups[0]["lr"] == 1.0  # the one step's rate
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "learning rate 0" in lines[0] and "without warmup" in lines[0], lines
