"""Packed rows train on CPU with each packing strategy, on the attention auto picks, and each run reports
its token efficiency (real tokens / computed tokens: a padded slot is computed too)."""

import logging

import pytest
from conftest import SMOKE, compose_cfg

from qlora_recipes.console import summary_rows


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_packed_training_runs_on_cpu(strategy, smoke_run, caplog):
    with caplog.at_level(logging.INFO, logger="qlora_recipes"):
        m, _ = smoke_run("data.packing=true", f"data.packing_strategy={strategy}")
    assert m["steps"] == compose_cfg(*SMOKE).trainer.max_steps
    assert m["train_loss_first"] > 0 and m["train_loss_last"] > 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention: ")]
    if strategy == "bfd":  # padding-free: every computed token is a real one, on the unmasked path
        assert m["token_efficiency"] == 1.0 and m["tokens_real"] == m["tokens_computed"] > 0
        assert said == [
            "attention: sdpa_varlen for padding-free micro-batches (SDPA per packed sequence from the collator's "
            "cu_seq_lens, no [n, n] mask)"
        ]
    else:  # wrapped rows fill seq_len but are not padding-free: plain sdpa, no line
        assert said == [] and 0 < m["token_efficiency"] <= 1.0


def test_padded_run_reports_the_pads_it_computed(smoke_run):
    """Rows of mixed lengths padded to the longest of each micro-batch: fewer real tokens than computed,
    in metrics.json and the end-of-run summary."""
    m, _ = smoke_run("trainer.micro_batch_size=4")
    assert 0 < m["tokens_real"] < m["tokens_computed"]
    assert m["token_efficiency"] == pytest.approx(m["tokens_real"] / m["tokens_computed"])
    [row] = [value for key, value in summary_rows({**m, "objective": "sft"}) if key == "tokens/s"]
    assert f"(token efficiency {m['token_efficiency']:.2f}: real / computed tokens)" in row
