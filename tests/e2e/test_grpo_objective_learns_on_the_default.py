"""objective=grpo on the embedded default: TRL's GRPOTrainer under our guards samples completions of the
order sample's prompts, scores them with the default rewards against each row's answer, and the mean
reward rises (reward_last > reward_first in metrics.json and the summary); one adapter is saved (no
reference copy) and the model card names the objective. One shared run, as a user runs it. A smoke-sized
run merges and generates (in the fast suite)."""

import pytest
from conftest import SMOKE, merge_and_generate, resumed_as_if_never_stopped, sample_subset, train_py

from qlora_recipes.console import summary_rows


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """The default's prompts, batch and steps (conf/trainer/tiny.yaml), in its own process; exact match
    over 16 eval prompts before and after. (metrics, run dir, stdout)."""
    return train_py(
        tmp_path_factory.mktemp("grpo") / "run",
        *["objective=grpo", "trainer.progress_bar=false", "data.metric_examples=16"],
    )


@pytest.mark.slow
def test_grpo_raises_the_mean_reward_on_the_order_sample(grpo_run):
    metrics, _, stdout = grpo_run
    assert metrics["objective"] == "grpo" and metrics["steps"] == 40
    assert metrics["reward_last"] > metrics["reward_first"], metrics["rewards"]
    assert metrics["eval_exact_match_before"] is not None and metrics["eval_exact_match"] is not None
    rows = dict(summary_rows(metrics))
    assert rows["objective"] == "grpo" and " -> " in rows["reward"]
    assert "reward" in stdout  # the summary the user sees


@pytest.mark.slow
def test_grpo_saves_one_adapter_and_its_card_names_the_objective(grpo_run):
    _, run_dir, _ = grpo_run
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "ref").exists()
    card = (adapter / "README.md").read_text()
    assert "TRL GRPOTrainer" in card and "objective: grpo (rewards char_match, exact_match" in card


@pytest.mark.slow
def test_grpo_measured_peak_is_within_ten_percent_of_its_plan(grpo_run):
    metrics, _, _ = grpo_run
    assert 0.9 <= metrics["peak_mem_gib"] / metrics["planned_peak_gib"] <= 1.1, metrics


@pytest.mark.slow
def test_grpo_resumes_after_sigterm_as_if_never_stopped(tmp_path, monkeypatch):
    few = sample_subset(tmp_path, "grpo/", 32, 8)
    whole, resumed = resumed_as_if_never_stopped([*SMOKE, "objective=grpo", *few], tmp_path, monkeypatch)
    assert resumed["rewards"][-1] == whole["rewards"][-1]


def test_a_grpo_run_merges_and_generates_as_an_sft_run_does(smoke_run):
    """A smoke-sized GRPO run (3 steps of sampled completions): its adapter merges into the base and
    generates from the run dir."""
    _, run_dir = smoke_run("objective=grpo")
    merge_and_generate(run_dir)
