"""objective=kto on the embedded default: TRL's KTOTrainer under our guards learns the order sample's
unpaired rows (eval reward accuracy - the share of eval rows whose reward has their label's sign - from 0
before training to >= 0.8), records it in metrics.json, the summary and the model card, saves one
adapter (the reference is the base with the adapter off), measures the peak its plan predicts, merges,
generates and resumes after SIGTERM bit-exact."""

import pytest
from conftest import SMOKE, merge_and_generate, resumed_as_if_never_stopped, sample_subset, train_py

from qlora_recipes.console import summary_rows


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory):
    """The command as a user runs it, in its own process (its measured peak is a first run's): the
    default's rows and batch (conf/trainer/tiny.yaml: 8 rows a step), 20 of its 40 steps, no generation
    metric. (metrics, run dir, stdout)."""
    return train_py(
        tmp_path_factory.mktemp("kto") / "run",
        *["objective=kto", "trainer.max_steps=20", "trainer.progress_bar=false", "data.metric=null"],
    )


def test_kto_learns_the_labels_of_the_order_sample(kto_run):
    metrics, _, stdout = kto_run
    assert metrics["objective"] == "kto" and metrics["steps"] == 20
    assert metrics["data"]["format"] == "unpaired" and metrics["micro_batch_size"] == 8
    assert metrics["eval_reward_accuracy_before"] == 0.0  # the policy is the reference before training
    assert metrics["eval_reward_accuracy"] >= 0.8
    assert metrics["eval_reward_margin"] > metrics["eval_reward_margin_before"] == 0.0
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    rows = dict(summary_rows(metrics))
    assert rows["objective"] == "kto" and rows["reward accuracy"].startswith("0 -> ")
    assert "reward accuracy" in stdout


def test_kto_saves_one_adapter_and_its_card_names_the_objective(kto_run):
    _, run_dir, _ = kto_run
    adapter = run_dir / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "ref").exists()
    card = (adapter / "README.md").read_text()
    assert "TRL KTOTrainer" in card and "objective: kto (beta 0.1, desirable weight 1.0" in card


def test_kto_measured_peak_is_within_ten_percent_of_its_plan(kto_run):
    metrics, _, _ = kto_run
    assert 0.9 <= metrics["peak_mem_gib"] / metrics["planned_peak_gib"] <= 1.1, metrics


def test_a_kto_run_merges_and_generates_as_an_sft_run_does(kto_run):
    merge_and_generate(kto_run[1])


@pytest.mark.slow
def test_kto_resumes_after_sigterm_as_if_never_stopped(tmp_path, monkeypatch):
    few = sample_subset(tmp_path, "kto/", 32, 16)
    whole, resumed = resumed_as_if_never_stopped(
        [*SMOKE, "objective=kto", *few, "trainer.logging_steps=1"], tmp_path, monkeypatch
    )
    assert resumed["train_losses"] == whole["train_losses"]
    assert resumed["eval_reward_accuracy"] == whole["eval_reward_accuracy"]
