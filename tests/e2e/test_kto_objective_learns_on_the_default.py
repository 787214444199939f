"""objective=kto on the embedded default: TRL's KTOTrainer under our guards learns the order sample's
unpaired rows (eval reward accuracy - the share of eval rows whose reward has their label's sign - from 0
before training to >= 0.8), records it in metrics.json, the summary and the model card, saves one
adapter (the reference is the base with the adapter off), measures the peak its plan predicts, merges,
generates and resumes after SIGTERM bit-exact."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, SMOKE, compose_cfg

from qlora_recipes.console import summary_rows


@pytest.fixture(scope="module")
def kto_run(tmp_path_factory):
    """The command as a user runs it, in its own process (its measured peak is a first run's): the
    default's rows and batch (conf/trainer/tiny.yaml: 8 rows a step), 20 of its 40 steps, no generation
    metric. (metrics, run dir, stdout)."""
    run_dir = tmp_path_factory.mktemp("kto") / "run"
    overrides = ["objective=kto", "trainer.max_steps=20", "trainer.progress_bar=false", "data.metric=null"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "metrics.json").read_text()), run_dir, proc.stdout


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
    _, run_dir, _ = kto_run
    for script, *args in (("merge.py",), ("generate.py", "order: dcba")):
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), str(run_dir), *args],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "merged" / "config.json").is_file()
    assert "### order: dcba" in proc.stdout and proc.stdout.strip().splitlines()[-1]  # an answer after the header


@pytest.fixture
def few_rows(tmp_path):
    """32 train and 16 eval rows of the shipped sample: resumes stay short."""
    for name, keep in (("train", 32), ("eval", 16)):
        rows = (REPO / f"assets/data/order/kto/{name}.jsonl").read_text().splitlines()[:keep]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    return [f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}"]


@pytest.mark.slow
def test_kto_resumes_after_sigterm_as_if_never_stopped(few_rows, tmp_path, monkeypatch):
    from qlora_recipes.run.lifecycle import Preempted
    from qlora_recipes.run.training import train

    stack = [*SMOKE, "objective=kto", *few_rows, "trainer.max_steps=4", "trainer.save_steps=2"]
    stack += ["trainer.logging_steps=1"]
    whole = train(compose_cfg(*stack), tmp_path / "whole")
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "sigterm_at_step=2")
    with pytest.raises(Preempted):
        train(compose_cfg(*stack), tmp_path / "stopped")
    monkeypatch.delenv("QLORA_RECIPES_FAULTS")
    resumed = train(compose_cfg(*stack, "resume=auto"), tmp_path / "stopped")
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["steps"] == 4
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    assert resumed["train_losses"] == whole["train_losses"]
    assert resumed["eval_reward_accuracy"] == whole["eval_reward_accuracy"]
