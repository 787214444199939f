"""bench/results/longest-context.json: every card of unsloth's table has a case, and a recorded
command, run again, prints the recorded longest_seq (two cases: each is a few plans)."""

from __future__ import annotations

import json
import shlex

import pytest

from bench.longest_context import CASE_OPTIONS, LEAN_OPTIONS, NOT_FOR, RESULTS, ROPE_X4, cases, command, run_command

RECORDED = json.loads(RESULTS.read_text())


def test_the_table_has_a_case_per_card_of_unsloths_table_with_its_source():
    got = {(c["model"], c["card_gb"]) for c in RECORDED["cases"]}
    assert got == {("llama3.1-8b", gb) for gb in (8, 12, 16, 24, 40, 48, 80)} | {
        ("llama3.1-70b", 48),
        ("llama3.1-70b", 80),
        ("gpt-oss-20b", 16),
        ("gpt-oss-20b", 80),
        ("qwen3-30b-a3b", 24),
        ("qwen3-30b-a3b", 80),
    }
    for c in RECORDED["cases"]:
        assert (c["unsloth_seq"] is None) == (c["source"] is None), c["command"]  # a figure has its source
        assert c["source"] is None or c["source"].startswith("https://unsloth.ai/")
        assert c["command"] == command(c["model"], c["card_gb"]), "regenerate: python -m bench longest-context"
        assert c["planned_gib"] <= c["budget_gib"]


def test_every_case_is_at_least_unsloths_length_and_traced_within_ten_percent_of_its_plan():
    for c in RECORDED["cases"]:
        assert c["longest_seq"] >= (c["unsloth_seq"] or 0), c["command"]
        assert 0.9 <= c["traced_over_planned_train"] <= 1.1, c["command"]


def test_an_extra_override_reaches_every_command_after_the_lean_and_the_cases_own_options():
    for case in cases(("trainer.example=true",)):
        own = CASE_OPTIONS.get((case["model"], case["card_gb"]), ())
        lean = [o for o in LEAN_OPTIONS if o not in NOT_FOR.get(case["model"], ())]  # what its family refuses out
        assert shlex.join([*lean, *own, "trainer.example=true"]) in case["command"]
        assert "peft.r=32" in case["command"] and "--host-ram 128GB" in case["command"]


def test_the_cases_past_the_models_positions_scale_rope_and_say_so():
    from bench.longest_context import _positions, overrides

    for c in RECORDED["cases"]:
        scaled = ROPE_X4 in CASE_OPTIONS.get((c["model"], c["card_gb"]), ())
        native = _positions({"overrides": [o for o in overrides(c["model"], c["card_gb"]) if o != ROPE_X4]})
        assert scaled == (max(c["unsloth_seq"] or 0, c["longest_seq"]) > native), c["command"]
        # a length the model's positions cut is no memory figure: only where the card holds more (the
        # MoE models on 80 GB: gpt-oss's 131,072 positions, Qwen3-30B-A3B's 40,960 with YaRN x4)
        assert not c["capped_by_positions"] or c["planned_gib"] < c["budget_gib"] - 1, c


@pytest.mark.parametrize("key", [("llama3.1-8b", 24), ("llama3.1-70b", 80)])
def test_a_recorded_command_prints_the_recorded_longest_seq(key):
    case = next(c for c in RECORDED["cases"] if (c["model"], c["card_gb"]) == key)
    assert run_command(case["command"]) == case["longest_seq"]


def test_the_gpu_suites_long_context_stage_trains_the_cases_the_gpu_holds_at_their_lengths():
    from bench.stages import long_context_cases

    h100 = 85_520_809_984  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB
    picked = long_context_cases(RECORDED["cases"], ["llama3.1-8b"], h100, None)
    assert [c["name"] for c in picked] == [f"long-llama3.1-8b-{gb}gb" for gb in (8, 12, 16, 24, 40, 48, 80)]
    by_card = {c["card_gb"]: c for c in RECORDED["cases"] if c["model"] == "llama3.1-8b"}
    for case in picked:
        card = by_card[int(case["name"].split("-")[-1][:-2])]
        assert case["overrides"][-1] == f"trainer.seq_len={card['longest_seq']}"
        assert {*LEAN_OPTIONS, "peft.r=32"} <= set(case["overrides"])
        assert not any(o.startswith(("model=", "trainer=", "--")) for o in case["overrides"])
    small = long_context_cases(RECORDED["cases"], ["llama3.1-8b"], 24 * 10**9, 128)
    assert [c["seq_len"] for c in small] == [128] * 4  # cards of 8 to 24 GB, capped for --shrink


def test_gpt_oss_at_its_positions_traces_its_layer_backward_within_five_percent_of_the_plan():
    """gpt-oss-20b at its 131,072 positions on 80 GB: the traced peak is the layer backward (the tracer
    builds flex attention's block mask a band at a time, as the compiled builder holds no seq^2 mask), its
    MoE blocks tiled (trainer.tiled_mlp), within 5 % of the plan's training peak; the recorded plan is the
    planner's today."""
    from bench.longest_context import planned

    case = next(c for c in RECORDED["cases"] if (c["model"], c["card_gb"]) == ("gpt-oss-20b", 80))
    assert case["traced_phase"] == "train: layer backward"
    assert 0.95 <= case["traced_over_planned_train"] <= 1.05, case["traced_over_planned_train"]
    today = next(c for c in cases(()) if (c["model"], c["card_gb"]) == ("gpt-oss-20b", 80))
    assert planned(today, case["longest_seq"])["planned_allocated_gib"] == case["planned_allocated_gib"]
