"""trainer.eval_batch_size=auto (the standard trainer's and every recipe's unless they say): the most
rows, up to 16, whose evaluation phase needs no more memory than training, so a long context is never
refused for its evaluation; resolved by the plan, said in one line, and what a run then uses."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.errors import UserError
from qlora_recipes.planner.peaks import device_peak
from qlora_recipes.units import GiB

EIGHT_B = ("recipe=llama3.1-8b-24gb", "trainer.micro_batch_size=1")


def _plan(*overrides):
    return planner.plan(compose_cfg(*EIGHT_B, *overrides), gpus=[80 * GiB], host_ram=128 * GiB)


def _eval_within_training(plan) -> bool:
    return all(device_peak(d, True) <= device_peak(d, False) for d in plan["devices"])


def test_longer_sequences_evaluate_fewer_rows_and_never_above_training():
    short, long = _plan("trainer.seq_len=1024"), _plan("trainer.seq_len=32768")
    rows = short["eval_batch_auto"]["rows"], long["eval_batch_auto"]["rows"]
    assert rows[0] > rows[1] >= 1, rows
    for plan, n in zip((short, long), rows, strict=True):
        assert plan["stack"]["eval_batch_size"] == n and _eval_within_training(plan)
        assert f"trainer.eval_batch_size=auto -> {n} (the most rows, up to 16" in " ".join(plan["notes"])
    # one row more than auto picked: evaluation would be the peak
    assert not _eval_within_training(_plan("trainer.seq_len=32768", f"trainer.eval_batch_size={rows[1] * 2}"))


def test_a_number_is_kept_and_a_run_uses_what_auto_resolved_to():
    fixed = compose_cfg(*EIGHT_B, "trainer.eval_batch_size=3")
    plan = planner.plan(fixed, gpus=[80 * GiB], host_ram=128 * GiB)
    assert "eval_batch_auto" not in plan and plan["stack"]["eval_batch_size"] == 3
    assert planner.settle_eval_batch(fixed, plan) is fixed
    auto = compose_cfg(*EIGHT_B)
    plan = planner.plan(auto, gpus=[80 * GiB], host_ram=128 * GiB)
    settled = planner.settle_eval_batch(auto, plan)
    assert settled.trainer.eval_batch_size == plan["eval_batch_auto"]["rows"] and auto.trainer.eval_batch_size == "auto"


@pytest.mark.parametrize("value", ["0", "many"])
def test_an_eval_batch_that_is_neither_rows_nor_auto_is_one_line(value):
    from qlora_recipes.config.checks import check_stack

    with pytest.raises(UserError, match=r"trainer.eval_batch_size=.* must be a positive number of rows, or auto"):
        check_stack(compose_cfg(f"trainer.eval_batch_size={value}"))
