"""The measured peak of a run stays within 10 % of its plan (R = measured / planned, on CPU the process
RSS) where the plan once missed what the run holds: a `peft.modules_to_save` copy of a tied lm_head
(a trainable fp32 V x h table with its gradient and optimizer state; planned as nothing, R 1.21 at
V = 100,000), and an eval split of fewer rows than trainer.eval_batch_size (planned as a full batch, the
eval phase being the peak: R 0.79). Each run is its own process, as a user runs it."""

import json
import random

import pytest
from conftest import SMOKE, train_py, write_jsonl
from helpers_models import build_llama

VOCAB = 100_000  # the table is what these stacks hold most of: a plan that misses it shows


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("big-vocab")
    return {tied: build_llama(root / f"tied-{tied}", tied, VOCAB) for tied in (True, False)}


def test_a_tied_lm_head_trained_in_full_is_planned_as_the_run_holds_it(big_vocab, tmp_path):
    saved, run_dir, _ = train_py(
        tmp_path / "run", *SMOKE, f"model.name_or_path={big_vocab[True]}", "peft.modules_to_save=[lm_head]"
    )
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["counts"]["trainable_params"] > VOCAB * 128  # the copy of the table, beside the adapters
    assert 0.9 <= saved["plan_ratio"] <= 1.1, saved


def test_an_eval_split_smaller_than_its_batch_is_planned_as_the_run_evaluates_it(big_vocab, tmp_path):
    """12 eval rows of 250 tokens at trainer.eval_batch_size=16: evaluation, over a 100,000-entry vocabulary,
    is the run's peak."""
    rng = random.Random(0)
    letters = ["".join(rng.choice("abcdefghij") for _ in range(120)) for _ in range(52)]
    rows = [{"prompt": f"order: {w}\n", "completion": "".join(sorted(w))} for w in letters]
    train, evals = write_jsonl(tmp_path / "train.jsonl", rows[:40]), write_jsonl(tmp_path / "eval.jsonl", rows[40:])
    saved, run_dir, _ = train_py(
        tmp_path / "run",
        *SMOKE,
        f"model.name_or_path={big_vocab[False]}",
        f"data.path={train}",
        f"data.eval_path={evals}",
        "trainer.seq_len=256",
        "trainer.eval_batch_size=16",
    )
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["stack"]["eval_batch_size"] == plan["data_eval_rows"] == 12
    (cpu,) = [d for d in plan["devices"] if d["device"] == "cpu"]
    assert cpu["peak_phase"] == "eval"
    assert 0.9 <= saved["plan_ratio"] <= 1.1, saved
