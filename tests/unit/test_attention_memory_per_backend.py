"""Attention memory as each backend keeps it at long sequences: sdpa and flash-attention linear in
seq_len, eager quadratic (batch x heads x seq_len^2 fp32 scores and their compute-dtype cast, kept
for backward and held again by the checkpointed recompute); past the length where eager fits, the
plan's ladder and the refusal name the fix (sdpa, flash-attention for a family without sdpa, or the
longest length that fits)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.planner import components
from qlora_recipes.planner.ladder import _candidates
from qlora_recipes.planner.single import plan_single
from qlora_recipes.planner.spec import spec_from_cfg
from qlora_recipes.units import GiB

CARD = [int(23.5 * GiB)]  # a 24 GB card


def _spec(*overrides: str):
    return spec_from_cfg(compose_cfg("precision=bf16", "trainer=standard", "trainer.eval_batch_size=1", *overrides), 1)


def _quadratic(st, seq: int) -> int:
    """f(4s) - 3 f(2s) + 2 f(s) of the layer working set f = A + B s + C s^2: 6 C s^2, only its seq^2 part."""
    return _working(st, 4 * seq) - 3 * _working(st, 2 * seq) + 2 * _working(st, seq)


def _working(st, seq: int) -> int:
    """The layer working set of the checkpointed recompute on a GPU at `seq` tokens."""
    plan = plan_single(dataclasses.replace(st, seq_len=seq), devices.hardware(CARD, 128 * GiB))
    return plan["components"]["layer_working"]["cuda:0"]


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_sdpa_and_flash_working_sets_grow_linearly_with_the_sequence(attn):
    st = _spec("model=llama3.1-8b", f"model.attn_implementation={attn}")
    assert not components.eager(st) and components.eager_scores_bytes(st, 1) == 0
    assert _quadratic(st, 8192) == 0
    assert _working(st, 32768) - _working(st, 16384) == 2 * (_working(st, 16384) - _working(st, 8192)) > 0


def test_eager_adds_heads_x_seq_squared_scores_that_quadruple_when_the_sequence_doubles():
    eager, sdpa = _spec("model=llama3.1-8b", "model.attn_implementation=eager"), _spec("model=llama3.1-8b")
    for seq in (4096, 8192, 16384):
        st = dataclasses.replace(eager, seq_len=seq)
        # the fp32 softmax and its bf16 cast, per head and micro-batch row
        assert components.eager_scores_bytes(st, 1) == 32 * seq * seq * (4 + 2)
    # the recompute holds the scores, the softmax and its cast again, and backward the fp32 gradient of the softmax
    assert _quadratic(eager, 4096) == 6 * 32 * 4096**2 * (4 + 2 + 4)
    assert _quadratic(eager, 8192) == 4 * _quadratic(eager, 4096)
    assert _working(eager, 16384) > 5 * _working(sdpa, 16384)


def test_gemma2_is_eager_under_the_sdpa_default_but_not_under_flash_attention():
    assert components.eager(_spec("model=gemma2-9b"))
    assert not components.eager(_spec("model=gemma2-9b", "model.attn_implementation=flash_attention_2"))
    gemma = _spec("model=gemma2-9b")
    st = dataclasses.replace(gemma, seq_len=4096)
    # Gemma 2 also keeps the tanh of its soft-capped scores
    assert components.eager_scores_bytes(st, 1) == 16 * 4096 * 4096 * (4 + 2 + 2)


def test_an_eager_stack_too_long_for_its_card_is_refused_naming_sdpa():
    cfg = compose_cfg("precision=bf16", "trainer=standard", "model=llama3.1-8b", "model.attn_implementation=eager")
    cfg.trainer.seq_len = 16384
    plan = planner.plan(cfg, gpus=CARD, host_ram=128 * GiB, world_size=1)
    assert not plan["fits"] and plan["ladder"][0]["adds"] == "model.attn_implementation=sdpa"
    with pytest.raises(planner.DoesNotFit) as err:
        planner.refuse_unless_fits(plan, force=False)
    line = str(err.value)
    assert "\n" not in line and "attention eager keeps batch x heads x seq_len^2 scores: 48.0 GiB" in line
    assert "try: model.attn_implementation=sdpa" in line


def test_a_family_without_sdpa_is_offered_flash_attention_on_a_gpu_and_the_length_that_fits():
    gemma = _spec("model=gemma2-9b", "trainer.seq_len=8192")
    gpu, cpu = devices.hardware(CARD, 128 * GiB), devices.hardware([], 128 * GiB)
    plan = plan_single(gemma, gpu)
    assert _candidates("attention", gemma, gpu, plan)[0][1] == {"model.attn_implementation": "flash_attention_2"}
    assert _candidates("attention", gemma, cpu, plan) == []  # no flash kernels on a CPU
    (fit, ov), *halves = _candidates("seq_len", gemma, gpu, plan)
    assert ov == {"trainer.seq_len": fit.seq_len} and fit.seq_len % 64 == 0 and fit.seq_len > halves[0][0].seq_len
    fits = plan_single(fit, gpu)
    over = plan_single(dataclasses.replace(gemma, seq_len=fit.seq_len + 64), gpu)
    budget = fits["devices"][0]["budget"]
    assert fits["devices"][0]["peak"] <= budget and over["devices"][0]["peak"] > fits["devices"][0]["peak"]
