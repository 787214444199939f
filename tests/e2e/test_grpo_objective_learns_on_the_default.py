"""objective=grpo on the embedded default: TRL's GRPOTrainer under our guards samples completions of the
order sample's prompts, scores them with the default rewards against each row's answer, and the mean
reward rises (reward_last > reward_first in metrics.json and the summary); one adapter is saved (no
reference copy) and the model card names the objective. One shared run, as a user runs it. A smoke-sized
run merges and generates (in the fast suite)."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, SMOKE, compose_cfg

from qlora_recipes.console import summary_rows


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """The default's prompts, batch and steps (conf/trainer/tiny.yaml), in its own process; exact match
    over 16 eval prompts before and after. (metrics, run dir, stdout)."""
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    overrides = ["objective=grpo", "trainer.progress_bar=false", "data.metric_examples=16"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "metrics.json").read_text()), run_dir, proc.stdout


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


@pytest.fixture
def few_prompts(tmp_path):
    """32 train and 8 eval prompts of the shipped sample: resumes stay short."""
    for name, keep in (("train", 32), ("eval", 8)):
        rows = (REPO / f"assets/data/order/grpo/{name}.jsonl").read_text().splitlines()[:keep]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    return [f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}"]


@pytest.mark.slow
def test_grpo_resumes_after_sigterm_as_if_never_stopped(few_prompts, tmp_path, monkeypatch):
    from qlora_recipes.run.lifecycle import Preempted
    from qlora_recipes.run.training import train

    stack = [*SMOKE, "objective=grpo", *few_prompts, "trainer.max_steps=4", "trainer.save_steps=2"]
    whole = train(compose_cfg(*stack), tmp_path / "whole")
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "sigterm_at_step=2")
    with pytest.raises(Preempted):
        train(compose_cfg(*stack), tmp_path / "stopped")
    monkeypatch.delenv("QLORA_RECIPES_FAULTS")
    resumed = train(compose_cfg(*stack, "resume=auto"), tmp_path / "stopped")
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["steps"] == 4
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    assert resumed["rewards"][-1] == whole["rewards"][-1]


def test_a_grpo_run_merges_and_generates_as_an_sft_run_does(smoke_run):
    """A smoke-sized GRPO run (3 steps of sampled completions): its adapter merges into the base and
    generates from the run dir."""
    _, run_dir = smoke_run("objective=grpo")
    for script, *args in (("merge.py",), ("generate.py", "order: dcba")):
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / script), str(run_dir), *args],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "merged" / "config.json").is_file()
    assert "order: dcba" in proc.stdout and proc.stdout.strip().splitlines()[-1]  # an answer after the prompt
