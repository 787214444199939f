"""The planner against the CPU (bench/planner_cpu.py): the committed results span sizes, families
and stacks, every measured case is within 10 % of its plan, and the planned figures in the
file are what the planner says today (a planner change must re-score them: `python -m bench
planner-cpu --replan`). The measuring itself is a benchmark, not a test."""

import json

import pytest
from conftest import REPO

from bench import planner_cpu
from bench.vlm_model import write_planning_dir

RESULTS = REPO / "bench" / "results" / "planner-cpu.json"


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RESULTS.read_text())


def test_the_suite_spans_sizes_families_and_stacks():
    cases = planner_cpu.cases()
    assert len(cases) >= 30
    families = {planner_cpu.MODELS[planner_cpu.VLM_MODELS.get(c["model"], c["model"])][0] for c in cases}
    assert families >= {"llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text", "smollm3"}
    assert families >= {"qwen3_5_text", "gemma4_text", "llama4_text"}
    per_model = {m: [c for c in cases if c["model"] == m] for m in planner_cpu.MODELS}
    assert all(len(v) >= 6 for m, v in per_model.items() if m not in planner_cpu.FAMILY_MODELS)
    joined = [" ".join(c["overrides"]) for c in cases]
    for knob in ("quant=fp4", "quant=int8", "quant=none", "optim=adamw", "optim=adamw8bit",
                 "gradient_checkpointing=false", "upcast_frozen=false", "eval_fraction=0.1"):  # fmt: skip
        assert any(knob in j for j in joined), knob


# Cases the planner misses by more than 10 %, each with what is known; they must not get worse.
KNOWN_MISSES: dict[str, float] = {
    # case name -> the largest |measured / planned - 1| accepted for a miss we understand but have
    # not yet modelled (each capped at 0.15); none today.
}


def test_every_measured_case_is_within_10_percent(results):
    ok = [e for e in results["cases"] if e["status"] == "ok"]
    assert ok and len(ok) == len(results["cases"])  # a failed run is fixed, not committed
    assert {e["name"] for e in ok} <= {c["name"] for c in planner_cpu.cases()}
    for e in ok:
        assert abs(e["measured_gib"] / e["planned_gib"] - 1) <= KNOWN_MISSES.get(e["name"], 0.10), e
        assert e["peak_quantity"] == "process RSS"
    sizes = sorted({e["params_total"] for e in ok})
    assert sizes[0] < 2e6 and len(sizes) >= 3  # from ~1 M parameters up
    assert results["date"] and results["device"] and results["environment"]["torch"]
    assert results["runs"] and all(r["command"].startswith("python -m bench planner-cpu") for r in results["runs"])


def test_committed_plans_are_todays_plans(results, tmp_path):
    """Re-plan every case from its overrides against a config-only copy of its model (the planner
    reads config.json, never the weights): the planned figure in the file must be today's."""
    for name in planner_cpu.MODELS:
        planner_cpu.model_config(name).save_pretrained(tmp_path / name)
    for name, text in planner_cpu.VLM_MODELS.items():
        write_planning_dir(tmp_path / name, planner_cpu.model_config(text))
    for e in results["cases"]:
        again = dict(e)
        planner_cpu.replan(again, tmp_path / e["model"])
        assert again["planned_gib"] == pytest.approx(e["planned_gib"], abs=0.002), e["name"]


def test_each_objective_is_measured_on_two_models(results):
    """DPO, KTO and GRPO each run on the 50M and the 300M model, measured within 10 % of their plan."""
    for name in ("dpo", "kto", "grpo"):
        measured = [e for e in results["cases"] if e["name"].endswith(f"/nf4-{name}")]
        assert {e["model"] for e in measured} == {"llama-50m", "llama-300m"}, name
        assert all(e["within"] for e in measured), name


def test_each_family_the_planner_knows_is_measured_within_10_percent(results):
    """Qwen3, Qwen3-MoE (4-bit experts), gpt-oss, Gemma 3's text model, SmolLM3, Qwen3.5 (Gated DeltaNet
    layers beside full attention), Gemma 4's text model and Llama 4's (MoE): a ~50 M model of each
    through the first stack, its peak RSS within 10 % of its plan."""
    from qlora_recipes.families import KNOWN_ARCHITECTURES

    measured = {e["model"]: e for e in results["cases"] if e["model"] in planner_cpu.FAMILY_MODELS}
    assert set(measured) == set(planner_cpu.FAMILY_MODELS)
    for name, e in measured.items():
        assert planner_cpu.MODELS[name][0] in KNOWN_ARCHITECTURES, name
        assert e["status"] == "ok" and abs(e["ratio"] - 1) <= 0.10, e


def test_a_vision_language_model_is_measured_within_10_percent(results):
    """A LLaVA-shaped model (a 12-layer CLIP-B/16 tower at 224 px, 196 image tokens a row) trained on
    image rows: its tower's weights, k-bit prep's fp32 copy of it and its forward in the plan."""
    measured = [e for e in results["cases"] if e["model"] in planner_cpu.VLM_MODELS]
    assert measured and all(e["status"] == "ok" and abs(e["ratio"] - 1) <= 0.10 for e in measured), measured
    assert all(e["params_total"] > 80e6 for e in measured)  # the tower's 86 M parameters are counted
