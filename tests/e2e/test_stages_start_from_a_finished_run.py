"""Stages: `init_from=<run dir>` starts a run's adapter from a finished run's (a smoke SFT run, then DPO
from it). The DPO stage starts from the SFT adapter exactly (its step-0 digest is the SFT run's final
one), records the stage in metrics.json and the model card, saves one adapter, merges and generates.
Its reference is the base with the adapter off by default (so the SFT policy already has rewards before
training) or, with objective.ref_adapter=true, the SFT adapter frozen (the policy equals the reference
before training: rewards 0). Runs shared by the module: one SFT run, two DPO stages on few pairs."""

import json

import pytest
from conftest import REPO, SMOKE, compose_cfg, train_smoke


def _few(folder, sample: str, train: int, evals: int) -> list[str]:
    for name, keep in (("train", train), ("eval", evals)):
        rows = (REPO / f"assets/data/order/{sample}{name}.jsonl").read_text().splitlines()[:keep]
        (folder / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    return [f"data.path={folder / 'train.jsonl'}", f"data.eval_path={folder / 'eval.jsonl'}"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft")
    return train_smoke(folder / "run", *_few(folder, "", 32, 8))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> list[str]:
    return _few(tmp_path_factory.mktemp("pairs"), "preference/", 16, 8)


@pytest.fixture(scope="module")
def dpo_stage(sft_run, pairs, tmp_path_factory):
    run = tmp_path_factory.mktemp("dpo") / "run"
    return train_smoke(run, "objective=dpo", *pairs, f"init_from={sft_run[1]}")


@pytest.fixture(scope="module")
def dpo_ref_stage(sft_run, pairs, tmp_path_factory):
    run = tmp_path_factory.mktemp("dpo-ref") / "run"
    return train_smoke(run, "objective=dpo", *pairs, f"init_from={sft_run[1]}", "objective.ref_adapter=true")


def test_dpo_stage_starts_from_the_sft_adapter_and_records_it(sft_run, dpo_stage):
    sft_metrics, sft_dir = sft_run
    metrics, run_dir = dpo_stage
    assert metrics["adapter_sha256_step0"] == sft_metrics["adapter_sha256"]  # exactly the SFT run's adapter
    assert metrics["adapter_sha256"] != sft_metrics["adapter_sha256"] and metrics["steps"] == 3
    assert metrics["init_from"] == {"path": str(sft_dir.resolve()), "objective": "sft"}
    assert json.loads((run_dir / "metrics.json").read_text())["init_from"]["objective"] == "sft"
    card = (run_dir / "adapter" / "README.md").read_text()
    assert "Stage: the adapter started from run `run` (objective sft)" in card
    assert "reference: the base with the adapter off" in card
    # the SFT adapter differs from the base: the policy scores the pairs before the first DPO step
    assert metrics["eval_reward_margin_before"] != 0.0


def test_dpo_stage_with_the_earlier_adapter_as_reference(sft_run, dpo_ref_stage):
    sft_metrics, _ = sft_run
    metrics, run_dir = dpo_ref_stage
    assert metrics["adapter_sha256_step0"] == sft_metrics["adapter_sha256"]
    # the policy is the reference before training: every reward is 0
    assert metrics["eval_reward_margin_before"] == 0.0 and metrics["eval_reward_accuracy_before"] == 0.0
    assert metrics["eval_reward_margin"] != 0.0
    adapter = run_dir / "adapter"
    assert not (adapter / "ref").exists() and not list((run_dir / "checkpoints").rglob("ref"))
    assert "reference: the earlier stage's adapter, frozen" in (adapter / "README.md").read_text()


@pytest.mark.slow
def test_a_stages_precomputed_reference_is_the_one_it_scores_per_step(sft_run, pairs, dpo_stage, tmp_path):
    """precompute_ref_log_probs scores the reference before training: the base with the adapter off
    unless ref_adapter=true, as the per-step reference does (TRL would score its copy of the adapter)."""
    stage = ["objective=dpo", *pairs, f"init_from={sft_run[1]}", "objective.precompute_ref_log_probs=true"]
    metrics, _ = train_smoke(tmp_path / "pre", *stage)
    assert metrics["eval_reward_margin_before"] == pytest.approx(dpo_stage[0]["eval_reward_margin_before"], rel=1e-4)
    with_ref, _ = train_smoke(tmp_path / "pre-ref", *stage, "objective.ref_adapter=true")
    assert with_ref["eval_reward_margin_before"] == 0.0


def test_the_plan_counts_the_reference_adapter_weights_only(sft_run):
    from qlora_recipes import planner

    stage = ["objective=dpo", f"init_from={sft_run[1]}"]
    off = planner.plan(compose_cfg(*SMOKE, *stage))["components"]
    ref = planner.plan(compose_cfg(*SMOKE, *stage, "objective.ref_adapter=true"))["components"]
    pre = planner.plan(
        compose_cfg(*SMOKE, *stage, "objective.ref_adapter=true", "objective.precompute_ref_log_probs=true")
    )
    assert ref["lora_weights"] == {dev: 2 * b for dev, b in off["lora_weights"].items()}
    assert ref["reference_forward"] == off["reference_forward"] and ref["gradients"] == off["gradients"]
    assert pre["components"]["lora_weights"] == off["lora_weights"] and not any(
        pre["components"].get("reference_forward", {}).values()
    )


def test_a_dpo_stage_merges_and_generates(dpo_stage, tmp_path):
    from qlora_recipes.merge.pipeline import merge
    from qlora_recipes.outputs.generation import generate, load_for_generation
    from qlora_recipes.outputs.prompts import Prompt

    _, run_dir = dpo_stage
    report = merge(run_dir, tmp_path / "merged")
    assert (tmp_path / "merged" / "config.json").is_file(), report
    answers = {}
    for name, folder in (("run", run_dir), ("merged", tmp_path / "merged")):
        model, tokenizer, info = load_for_generation(folder)
        assert info["format"].prefix == "order: "  # a preference run's prompts are wrapped as trained
        answers[name] = generate(model, tokenizer, [Prompt("text", "dcba"), Prompt("text", "fed")], info["format"], 8)
    assert all(answers["run"]) and answers["merged"] == answers["run"], answers


@pytest.mark.slow
def test_a_stage_with_its_reference_adapter_resumes_after_sigterm_as_if_never_stopped(
    sft_run, pairs, tmp_path, monkeypatch
):
    """The reference adapter is copied afresh from the earlier stage's adapter by the resumed run (it is
    never in a checkpoint): the resumed run ends bit-exact where the uninterrupted one does."""
    from qlora_recipes.run.lifecycle import Preempted
    from qlora_recipes.run.training import train

    stack = [*SMOKE, "objective=dpo", *pairs, f"init_from={sft_run[1]}", "objective.ref_adapter=true"]
    stack += ["trainer.max_steps=4", "trainer.save_steps=2"]
    whole = train(compose_cfg(*stack), tmp_path / "whole")
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "sigterm_at_step=2")
    with pytest.raises(Preempted):
        train(compose_cfg(*stack), tmp_path / "stopped")
    monkeypatch.delenv("QLORA_RECIPES_FAULTS")
    assert not list((tmp_path / "stopped" / "checkpoints").rglob("ref"))  # one adapter in a checkpoint
    resumed = train(compose_cfg(*stack, "resume=auto"), tmp_path / "stopped")
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["steps"] == 4
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    assert resumed["train_losses"] == whole["train_losses"]
    assert resumed["eval_reward_margin"] == whole["eval_reward_margin"]
    assert resumed["init_from"] == whole["init_from"]
