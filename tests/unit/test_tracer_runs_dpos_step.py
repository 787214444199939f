"""The memory tracer runs DPOTrainer's step (bench/trace/step.py): chosen and rejected of each pair in
one forward, the reference's no_grad forward with the adapter off as its own phase, the sigmoid loss,
backward; on the tiny model on the fake CUDA device, within the bounds the SFT trace of the same
model keeps to its plan."""

import shutil

import pytest

from qlora_recipes.units import GiB


def _can_build() -> bool:
    from bench.trace import fakecuda

    if fakecuda.library_path().is_file():
        return True
    return bool(shutil.which("c++") or shutil.which("g++")) and bool(shutil.which("ninja"))


DPO = ["objective=dpo", "trainer.micro_batch_size=2", "trainer.seq_len=32"]


@pytest.mark.skipif(not _can_build(), reason="the fake CUDA device is built once with a C++ compiler and ninja")
def test_the_dpo_step_is_traced_with_its_reference_forward():
    from bench.trace.run import compare, plan_for, run_child

    r = run_child({"overrides": DPO, "device": "cuda"})
    phases = {k.split("|")[1]: v["total"] for k, v in r["phases"].items()}
    assert {"forward", "loss", "reference", "backward", "optimizer"} <= set(phases)
    assert r["tokens"] == 2 * 2 * 32  # two answers per pair: 4 sequences of a 2-pair micro-batch
    plan = plan_for(DPO, [24 * GiB])
    assert plan["components"]["reference_forward"]["cuda:0"] > 0
    cmp = compare(r, plan, "cuda:0")
    assert "train: reference forward" in cmp["phases"]
    assert 0.8 < cmp["traced_gib"] / cmp["planned_train_gib"] < 1.25, cmp
