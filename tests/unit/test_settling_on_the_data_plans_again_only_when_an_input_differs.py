"""Once the data is tokenized, planner.settle_for_data hands back the plan made before the data where the
data changed none of its inputs (trainer.seq_len=auto resolved to exactly the cap it was planned at),
without planning again; it plans again where any input differs: seq_len resolved lower, the longest row
shorter than seq_len, fewer eval rows than the eval batch, data.images_per_row=auto resolved."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner


@pytest.fixture
def calls(monkeypatch) -> list:
    """The config of each plan made from here on (a plan's own plans for its auto values not counted)."""
    made: list = []
    real, depth = planner.plan, [0]

    def counted(*args, **kwargs):
        made.extend(args[:1] if not depth[0] else [])
        depth[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(planner, "plan", counted)
    return made


def _first(calls: list, *overrides: str):
    """(cfg, its plan before the data, the cap seq_len=auto was planned at), the plans counted after it."""
    cfg = compose_cfg("trainer=smoke", *overrides)
    first = planner.plan(cfg, ladder=False)
    calls.clear()
    return cfg, first, (first.get("seq_len_auto") or {}).get("cap")


def test_auto_resolved_to_its_cap_hands_back_the_first_plan_unplanned(calls):
    cfg, first, cap = _first(calls)
    settled, plan = planner.settle_for_data(cfg, first, {"seq_len": cap, "max_tokens": {"train": cap}})
    assert plan is first and calls == []
    assert settled.trainer.seq_len == cap and cfg.trainer.seq_len == "auto"
    again = planner.plan(settled, ladder=False)  # what planning again would give: the same figures
    assert again["devices"] == first["devices"] and again["components"] == first["components"]
    assert again["stack"] == first["stack"]


@pytest.mark.parametrize(
    "stats,differs",
    [
        ({"seq_len": 128}, "seq_len=auto resolved below its cap"),
        ({"seq_len": "cap", "max_tokens": {"train": 100}}, "the longest row shorter than seq_len"),
        ({"seq_len": "cap", "rows": {"eval": 1}}, "fewer eval rows than the eval batch"),
        ({"seq_len": "cap", "images_per_row": {"images": 2, "where": "rows.jsonl line 3"}}, "images_per_row"),
    ],
    ids=["lower-seq-len", "shorter-rows", "fewer-eval-rows", "images-per-row"],
)
def test_any_input_the_data_changes_is_planned_again(calls, stats, differs):
    cfg, first, cap = _first(calls)
    assert cap != 128 and cfg.trainer.eval_batch_size > 1 and cfg.data.images_per_row == "auto"
    stats = {**stats, "seq_len": cap if stats["seq_len"] == "cap" else stats["seq_len"]}
    settled, plan = planner.settle_for_data(cfg, first, stats)
    assert plan is not first and len(calls) == 1, differs
    assert plan["stack"]["seq_len"] == min(stats["seq_len"], (stats.get("max_tokens") or {}).get("train", cap))


def test_a_number_set_is_the_first_plan_as_before(calls):
    cfg, first, _ = _first(calls, "trainer.seq_len=64")
    settled, plan = planner.settle_for_data(cfg, first, {"seq_len": 64})
    assert settled is cfg and plan is first and calls == []
