"""peft.adapter_dtype=auto, the default: bf16 adapters under bf16 compute (as TRL and the QLoRA paper
train them; the H200 step of bench/results/nvidia-h200-2026-11-28-gpu-check.md), float32 under fp32 or
fp16 compute and where bf16 adapters are refused (another optimizer, DoRA, several processes). The plan
counts what auto resolves to for the precision it plans, and `--fastest` adds no bf16 step it already has."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.config.adapters import adapter_dtype, settled
from qlora_recipes.config.checks import check_stack
from qlora_recipes.units import GiB

EIGHT_B = ("recipe=llama3.1-8b-24gb", "peft.dropout=0")


def _plan(*overrides: str, gpus=(24 * GiB,)) -> dict:
    cfg = compose_cfg(*EIGHT_B, *overrides)
    return planner.plan(cfg, gpus=list(gpus), host_ram=128 * GiB, world_size=1, ladder=False)


def test_auto_is_the_default():
    assert compose_cfg().peft.adapter_dtype == "auto"


@pytest.mark.parametrize(
    "overrides,resolved",
    [
        (["precision=bf16"], "bfloat16"),
        (["precision=fp32"], "float32"),
        (["precision=fp16"], "float32"),  # fp16 adapters would need a grad scaler of their own
        (["precision=bf16", "optim=adamw"], "float32"),  # bf16 adapters: the 8-bit optimizers only
        (["precision=bf16", "peft=dora"], "float32"),  # DoRA's magnitude trains in fp32
        (["precision=bf16", "dist=ddp"], "float32"),  # tested in one process
        (["precision=bf16", "peft=rslora", "optim=adamw8bit"], "bfloat16"),
        (["precision=bf16", "peft.adapter_dtype=float32"], "float32"),  # an explicit dtype is kept
        (["precision=fp32", "peft.adapter_dtype=bfloat16"], "bfloat16"),
    ],
)
def test_auto_resolves_for_the_compute_dtype_and_the_stack(overrides, resolved):
    cfg = compose_cfg(*overrides)
    check_stack(cfg)  # auto never resolves to a dtype the checks refuse
    assert adapter_dtype(cfg, world_size=1) == resolved
    assert settled(cfg, world_size=1).peft.adapter_dtype == resolved


def test_auto_keeps_float32_under_several_processes(monkeypatch):
    """torchrun with dist=none runs DDP: auto reads WORLD_SIZE, as the run's validation does."""
    cfg = compose_cfg("precision=bf16")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert adapter_dtype(cfg) == "float32" and settled(cfg).peft.adapter_dtype == "float32"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert adapter_dtype(cfg) == "bfloat16"


def test_the_plan_counts_bf16_adapters_under_bf16_compute_and_float32_under_fp32():
    auto, fp32, bf16 = _plan(), _plan("peft.adapter_dtype=float32"), _plan("peft.adapter_dtype=bfloat16")
    assert auto["stack"]["adapter_dtype"] == "bfloat16" and "adapter_dtype" not in fp32["stack"]
    assert auto["components"] == bf16["components"] and auto["peak_gib"] == bf16["peak_gib"]
    row = lambda p, k: p["components"][k]["cuda:0"]  # noqa: E731
    assert row(auto, "lora_weights") * 2 == row(fp32, "lora_weights")
    assert auto["peak_gib"] < fp32["peak_gib"]
    auto, fp32 = _plan("precision=fp32"), _plan("precision=fp32", "peft.adapter_dtype=float32")
    assert "adapter_dtype" not in auto["stack"]
    assert auto["components"] == fp32["components"] and auto["peak_gib"] == fp32["peak_gib"]


def test_precision_auto_planned_for_gpus_plans_the_adapters_it_picks():
    """precision=auto on this CPU is fp32; planned for GPUs it picks bf16, and so do the adapters."""
    cfg = compose_cfg("model=llama3.1-8b", "precision=auto")
    on_gpu = planner.plan(cfg, gpus=[24 * GiB], host_ram=128 * GiB, world_size=1, ladder=False)
    assert on_gpu["stack"]["dtype"] == "bfloat16" and on_gpu["stack"]["adapter_dtype"] == "bfloat16"
    old_gpu = compose_cfg("model=llama3.1-8b", "precision=auto", "hardware.bf16=false")
    on_t4 = planner.plan(old_gpu, gpus=[16 * GiB], host_ram=128 * GiB, world_size=1, ladder=False)
    assert on_t4["stack"]["dtype"] == "float16" and "adapter_dtype" not in on_t4["stack"]


def test_fastest_adds_no_bf16_adapter_step_that_auto_already_takes():
    cfg = compose_cfg(*EIGHT_B, "trainer.seq_len=16384")
    found = planner.fastest_stack(cfg, gpus=[24 * GiB], host_ram=128 * GiB)
    assert found is not None and "peft.adapter_dtype" not in found[0]
    assert found[2]["stack"]["adapter_dtype"] == "bfloat16"


def test_resume_compares_what_auto_resolves_to_with_what_the_run_saved():
    """A run saves auto resolved (config.yaml); a config.yaml from before the key trained float32."""
    from dataclasses import replace

    from qlora_recipes.run.resume import stack_changes

    bf16, fp32 = compose_cfg("precision=bf16"), compose_cfg("precision=fp32")
    assert stack_changes(settled(bf16, world_size=1), bf16) == []
    assert "peft.adapter_dtype" in stack_changes(settled(bf16, world_size=1), fp32)
    before_the_key = replace(fp32, peft=replace(fp32.peft, adapter_dtype="auto"))  # read_saved's default
    assert stack_changes(before_the_key, fp32) == []
    assert "peft.adapter_dtype" in stack_changes(replace(bf16, peft=replace(bf16.peft, adapter_dtype="auto")), bf16)
