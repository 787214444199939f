"""objective=dpo on the embedded default: TRL's DPOTrainer under our guards learns the order sample's
preferences (eval reward accuracy from 0 before training to >= 0.8), records it in metrics.json, the
summary and the model card, saves one adapter (the reference is the base with the adapter off), and
measures the peak its plan predicts. One shared run."""

import pytest
from conftest import SMOKE, resumed_as_if_never_stopped, sample_subset, train_py

from qlora_recipes.console import summary_rows


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """The command as a user runs it, in its own process: its measured peak (process RSS) is a first
    run's, not that of a test process that trained before. (metrics, run dir, stdout)."""
    # the default's pairs and batch (conf/trainer/tiny.yaml: 8 pairs a step), 20 of its 40 steps; no
    # generation metric (SMOKE's choice: it would double the run)
    return train_py(
        tmp_path_factory.mktemp("dpo") / "run",
        *["objective=dpo", "trainer.max_steps=20", "trainer.progress_bar=false", "data.metric=null"],
    )


def test_dpo_learns_the_preferences_of_the_order_sample(dpo_run):
    metrics, run_dir, stdout = dpo_run
    assert metrics["objective"] == "dpo" and metrics["steps"] == 20
    assert metrics["eval_reward_accuracy_before"] == 0.0  # the policy is the reference before training
    assert metrics["eval_reward_accuracy"] >= 0.8
    assert metrics["eval_reward_margin"] > metrics["eval_reward_margin_before"] == 0.0
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    rows = dict(summary_rows(metrics))
    assert rows["objective"] == "dpo" and rows["reward accuracy"].startswith("0 -> ")
    assert "reward accuracy" in stdout  # the summary the user sees


def test_dpo_saves_one_adapter_and_its_card_names_the_objective(dpo_run):
    _, run_dir, _ = dpo_run
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "ref").exists()
    card = (adapter / "README.md").read_text()
    assert "TRL DPOTrainer" in card and "objective: dpo (loss sigmoid, beta 0.1" in card


def test_dpo_measured_peak_is_within_ten_percent_of_its_plan(dpo_run):
    metrics, _, _ = dpo_run
    assert 0.9 <= metrics["peak_mem_gib"] / metrics["planned_peak_gib"] <= 1.1, metrics


@pytest.mark.slow
def test_dpo_resumes_after_sigterm_as_if_never_stopped(tmp_path, monkeypatch):
    few = sample_subset(tmp_path, "preference/", 32, 8)
    whole, resumed = resumed_as_if_never_stopped(
        [*SMOKE, "objective=dpo", *few, "trainer.logging_steps=1"], tmp_path, monkeypatch
    )
    assert resumed["train_losses"] == whole["train_losses"]
    assert resumed["eval_reward_accuracy"] == whole["eval_reward_accuracy"]
