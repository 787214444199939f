"""The memory tracer runs each objective's step as its TRL trainer does (bench/trace/objectives.py):
DPO's chosen and rejected in one forward and the reference's no_grad forward with the adapter off as
its own phase; KTO's no_grad forward of its KL batch first; GRPO's sampling of the step's completions
(generate, its KV cache) before training on them with the head over the completions alone. On the
tiny model on the fake CUDA device, within the bounds the SFT trace of the same model keeps to its
plan."""

import shutil

import pytest
from helpers_forkserver import tracer

from qlora_recipes.units import GiB


def _can_build() -> bool:
    from bench.trace import fakecuda

    if fakecuda.library_path().is_file():
        return True
    return bool(shutil.which("c++") or shutil.which("g++")) and bool(shutil.which("ninja"))


@pytest.fixture(scope="module")
def traced():
    """traced(spec): run_child(spec) for a spec on the fake CUDA device, in a child forked from one
    server that imported the tracer's libraries once (a fresh Python spent most of a trace on them)."""
    with tracer() as trace:
        yield trace


DPO = [
    "objective=dpo",
    "trainer.micro_batch_size=2",
    "trainer.seq_len=32",
    "precision=bf16",
]  # pinned: one stack for the trace and the plan, whatever this CPU picks


@pytest.mark.skipif(not _can_build(), reason="the fake CUDA device is built once with a C++ compiler and ninja")
def test_the_dpo_step_is_traced_with_its_reference_forward(traced):
    from bench.trace.run import compare, plan_for

    r = traced({"overrides": DPO, "device": "cuda"})
    phases = {k.split("|")[1]: v["total"] for k, v in r["phases"].items()}
    assert {"forward", "loss", "reference", "backward", "optimizer"} <= set(phases)
    assert r["tokens"] == 2 * 2 * 32  # two answers per pair: 4 sequences of a 2-pair micro-batch
    plan = plan_for(DPO, [24 * GiB])
    assert plan["components"]["reference_forward"]["cuda:0"] > 0
    cmp = compare(r, plan, "cuda:0")
    assert "train: reference forward" in cmp["phases"]
    assert 0.8 < cmp["traced_gib"] / cmp["planned_train_gib"] < 1.25, cmp


KTO = ["objective=kto", "trainer.micro_batch_size=2", "trainer.seq_len=32", "precision=bf16"]
GRPO = [
    "objective=grpo",
    "objective.beta=0.04",
    "objective.num_generations=4",
    "objective.max_completion_length=16",
    "trainer.micro_batch_size=2",
    "trainer.grad_accum=2",
    "trainer.seq_len=32",
]


@pytest.mark.skipif(not _can_build(), reason="the fake CUDA device is built once with a C++ compiler and ninja")
def test_the_kto_step_is_traced_with_its_kl_batch_and_reference_forwards(traced):
    from bench.trace.run import compare, plan_for

    r = traced({"overrides": KTO, "device": "cuda"})
    phases = {k.split("|")[1] for k in r["phases"]}
    assert {"kl", "forward", "loss", "reference", "backward", "optimizer"} <= phases
    cmp = compare(r, plan_for(KTO, [24 * GiB]), "cuda:0")
    assert {"train: KL forward", "train: reference forward"} <= set(cmp["phases"])
    assert 0.8 < cmp["traced_gib"] / cmp["planned_train_gib"] < 1.25, cmp


@pytest.mark.skipif(not _can_build(), reason="the fake CUDA device is built once with a C++ compiler and ninja")
def test_the_grpo_step_samples_its_completions_then_trains_on_them(traced):
    from bench.trace.run import compare, plan_for

    r = traced({"overrides": GRPO, "device": "cuda"})
    phases = {k.split("|")[1] for k in r["phases"]}
    assert {"prefill", "decode", "forward", "loss", "reference", "backward"} <= phases
    assert r["tokens"] == 2 * (32 + 16)  # a micro-batch trains on prompt + completion rows
    assert r["kernels"]["ops"]["bool read"] > 0  # generate's reads of the prompts' mask, answered
    cmp = compare(r, plan_for(GRPO, [24 * GiB]), "cuda:0")
    sampling = cmp["phases"]["train: sampling"]
    assert 0.8 < sampling["traced_gib"] / sampling["planned_gib"] < 1.25, cmp


def test_the_committed_traces_hold_each_objective_on_the_8b_base_within_ten_percent():
    """bench/results/planner-traced.json (`python -m bench trace --suite`): DPO, KTO and GRPO each
    traced on Llama-3.1-8B within 10 % of the plan, GRPO's sampling phase among its phases."""
    import json

    from conftest import REPO

    cases = json.loads((REPO / "bench/results/planner-traced.json").read_text())["cases"]
    for name in ("dpo", "kto", "grpo"):
        traced = [c for c in cases if "8b" in c["case"] and f"objective={name}" in " ".join(c["overrides"])]
        traced += [c for c in cases if c["case"] == f"recipe llama3.1-8b-24gb-{name}"]
        assert traced and all(c["within"] and 0.9 <= c["ratio"] <= 1.1 for c in traced), name
    grpo = next(c for c in cases if c["case"] == "recipe llama3.1-8b-24gb-grpo")
    assert grpo["traced_peak_phase"] == "train: sampling" and "train: sampling" in grpo["phases"]
