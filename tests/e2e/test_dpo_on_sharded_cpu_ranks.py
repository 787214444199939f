"""objective=dpo with QLoRA as 2 sharded CPU ranks (FSDP2, and DeepSpeed ZeRO-3), the reference scored
with the adapter off (no second copy of the base): the same steps as one process on the same global
batch, within the tolerance of the SFT sharded tests (test_sharded_training_on_cpu_ranks.py, whose
helpers these are).

What was ours to fix: the evaluation before training (the before figures of metrics.json) ran
before train(), where FSDP2 refuses a model prepared without its optimizer; sharded runs evaluate as
training begins (run/callbacks.py EvalBeforeTraining). TRL's adapter-off reference itself works on
this path: the rewards move away from 0 after the first update and match one process's.

Each comparison is two trainings (~45 s for the ranks on 2 cores, ZeRO-3 ~2 min): `slow`, run by
`make test-dist`."""

import pytest
from conftest import SMOKE
from test_sharded_training_on_cpu_ranks import (
    TOLERANCE,
    assert_one_adapter_file,
    assert_ranks_agree,
    assert_sharded,
    needs_deepspeed,
    train_one,
    train_ranks,
)

# The global batch of the SFT comparison (4 pairs a step: 4 in one process, 2 per rank), LoRA dropout
# off (its masks are drawn per rank), plain AdamW, fp32: the tightest tolerance.
SAME_PAIRS = (*SMOKE, "objective=dpo", "peft.dropout=0", "optim=adamw", "precision=fp32")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train_one(tmp_path_factory.mktemp("dpo-one") / "run", *SAME_PAIRS, "trainer.micro_batch_size=4")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("zero3", marks=needs_deepspeed)])
def test_dpo_as_two_sharded_ranks_matches_one_process(strategy, one_process, tmp_path):
    run = tmp_path / "run"
    ranks = train_ranks(run, f"dist={strategy}", *SAME_PAIRS)
    assert_ranks_agree(ranks, steps=3)
    assert_sharded(strategy, ranks)
    assert_one_adapter_file(run, ranks)  # the adapter alone: no "ref" copy saved beside it
    two, one = ranks[0], one_process
    assert two["objective"] == "dpo" and two["adapter_sha256_step0"] == one["adapter_sha256_step0"]
    assert two["train_losses"][0] == one["train_losses"][0]  # policy = reference before any update: log 2
    assert two["train_losses"] == pytest.approx(one["train_losses"], rel=TOLERANCE["fp32"])
    # the reference is the base with the adapter off: before training the policy is the reference
    # (no margin), after it the trained adapter scores the pairs apart from it, as in one process
    assert two["eval_reward_accuracy_before"] == 0.0 and two["eval_reward_margin_before"] == 0.0
    assert two["eval_reward_margin"] != 0.0 and two["eval_reward_accuracy"] == one["eval_reward_accuracy"]
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=TOLERANCE["fp32"])
    # the margin is beta times a difference of sums of log-probs (each ~ -20 to -40): their fp32
    # rounding (rel 1e-6 of each sum, ZeRO-3's CPU Adam ulps) is absolute in it (seen: 1e-6 under ZeRO-3)
    assert two["eval_reward_margin"] == pytest.approx(one["eval_reward_margin"], abs=1e-5)
    print(f"dpo dist={strategy}: 2 ranks {two['train_losses']} margin {two['eval_reward_margin']}")
    print(f"  one process {one['train_losses']} margin {one['eval_reward_margin']}")
