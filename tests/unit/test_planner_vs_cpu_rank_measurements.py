"""The planner per rank against CPU ranks (bench/planner_sharded.py): the committed results cover
DDP, FSDP, ZeRO-2 and ZeRO-3 at 2 ranks for several model sizes, every rank's measured peak RSS is
within 10 % of its plan (known misses listed and capped), and the planned figures in the file are
what the planner says today (a planner change must re-score them: `python -m bench
planner-sharded --replan`). The measuring itself is a benchmark, not a test."""

import json

import pytest
from conftest import REPO, compose_cfg

from bench import planner_cpu, planner_sharded
from qlora_recipes import planner

RESULTS = REPO / "bench" / "results" / "planner-sharded.json"
GiB = 2**30


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RESULTS.read_text())


# Cases whose ranks the planner misses by more than 10 %, each with what is known; they must not get worse.
KNOWN_MISSES: dict[str, float] = {}


def test_the_suite_spans_strategies_and_sizes():
    cases = planner_sharded.cases()
    assert {c["strategy"] for c in cases} == {"ddp", "fsdp", "zero2", "zero3"}
    assert len({c["model"] for c in cases}) >= 3 and "llama-1m" in {c["model"] for c in cases}
    assert all(c["model"] in planner_cpu.MODELS for c in cases)  # planner-cpu's builder


def test_every_rank_is_within_10_percent_of_its_plan(results):
    ok = [e for e in results["cases"] if e["status"] == "ok"]
    assert ok and len(ok) == len(results["cases"])  # a failed run is fixed, not committed
    assert {e["name"] for e in ok} == {c["name"] for c in planner_sharded.cases()}
    for e in ok:
        assert len(e["ranks"]) == results["world_size"] == 2, e["name"]
        for r in e["ranks"]:
            assert r["peak_quantity"] == "process RSS"
            assert abs(r["measured_gib"] / e["planned_gib"] - 1) <= KNOWN_MISSES.get(e["name"], 0.10), (e["name"], r)
    sizes = sorted({e["params_total"] for e in ok})
    assert sizes[0] < 2e6 and len(sizes) >= 3
    assert results["date"] and results["device"] and results["environment"]["torch"]
    assert results["runs"] and all(r["command"].startswith("python -m bench planner-sharded") for r in results["runs"])


def test_the_ranks_really_were_sharded(results):
    """The measured shares recorded by each rank (dist.sharding_figures): FSDP and ZeRO-3 halve the
    4-bit base, ZeRO-2 halves the optimizer partition, DDP holds everything."""
    for e in results["cases"]:
        for r in e["ranks"]:
            s = r.get("sharding")
            if e["strategy"] == "ddp":
                assert s is None
                continue
            assert s["world_size"] == 2
            halved = s["base_4bit_local"] * 2 == s["base_4bit_whole"]
            assert halved == (e["strategy"] in ("fsdp", "zero3")), (e["name"], s)


def test_committed_plans_are_todays_plans(results, tmp_path):
    """Re-plan every case from its overrides against a config-only copy of its model (the planner
    reads config.json, never the weights): the planned figure in the file must be today's."""
    for name in {e["model"] for e in results["cases"]}:
        planner_cpu.model_config(name).save_pretrained(tmp_path / name)
    for e in results["cases"]:
        again = json.loads(json.dumps(e))
        planner_sharded.replan(again, tmp_path / e["model"])
        assert again["planned_gib"] == pytest.approx(e["planned_gib"], abs=0.002), e["name"]


def test_cpu_rank_plans_share_what_the_strategy_shards():
    """One CPU rank's plan per strategy: FSDP and ZeRO-3 hold half the 4-bit data, ZeRO-2 half the
    optimizer state, DDP a full replica; every rank first loads the whole model (the load phase is
    one process's); the host RAM budget is split between the ranks."""
    host = 64 * GiB

    def rank(strategy: str) -> dict:
        cfg = compose_cfg(f"dist={strategy}", "model=tiny", "trainer=smoke")
        return planner.plan(cfg, gpus=[], host_ram=host, world_size=2, ladder=False)

    def one(strategy: str) -> dict:
        cfg = compose_cfg(f"dist={strategy}", "model=tiny", "trainer=smoke")
        return planner.plan(cfg, gpus=[], host_ram=host, world_size=1, ladder=False)

    plans = {s: rank(s) for s in ("ddp", "fsdp", "zero2", "zero3")}
    for s, p in plans.items():
        assert p["dist"]["strategy"] == s and p["dist"]["world_size"] == 2 and p["dist"]["cpu_ranks"]
        assert p["devices"][0]["budget"] == host // 2
        single = one(s)
        assert p["devices"][0]["peak_by_phase"]["load"] >= single["devices"][0]["peak_by_phase"]["load"]
    q = {s: p["components"]["quantized_weights"]["cpu"] for s, p in plans.items()}
    state = plans["ddp"]["counts"]["quant_state_bytes"]
    assert q["fsdp"] - state == pytest.approx((q["ddp"] - state) / 2, rel=1e-6)
    assert q["zero2"] == q["ddp"]
    o = {s: p["components"]["optimizer_state"]["cpu"] for s, p in plans.items()}
    assert o["zero2"] < o["ddp"]
