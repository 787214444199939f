"""The claims of the README checked against a results file: the recipe layer costs nothing on the
CPU (time and memory ratios vs the baseline), whole-process timings, every quant x optim pair trains,
the planner within 10 %; on the GPU the 8B peak and speed-up, the 70B shape's extrapolated and
measured peaks and its longest sequence. Each goal is {claim, target, measured, pass}."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report import fmt, pct
from bench.stats import ratio
from qlora_recipes.units import GiB

PLANNER_CLAIM = "planner within 10 % of the measured peak, every stack"


def _goal(claim: str, target: str, measured: str, ok: bool | None) -> dict:
    return {"claim": claim, "target": target, "measured": measured, "pass": ok}


def _stack(res: dict, name: str) -> dict:
    return next((s for s in res.get("stacks", []) if s.get("name") == name), {})


def _ok_stacks(res: dict, keep: Callable[[str], bool]) -> list[dict]:
    """The stacks whose name `keep` accepts and whose own run succeeded."""
    return [s for s in res.get("stacks", []) if keep(s.get("name", "")) and (s.get("ours") or {}).get("status") == "ok"]


def _planner_goal(res: dict) -> dict:
    errs = []
    for s in res.get("stacks", []):
        for side, e in (s.get("plan_error_pct") or {}).items():
            if e.get("headline") is not None:
                errs.append((abs(e["headline"]), f"{s['name']} ({side})"))
    if not errs:
        return _goal(PLANNER_CLAIM, "≤ 10 %", "–", None)
    worst = max(errs)
    within = sum(1 for e, _ in errs if e <= 10)
    return _goal(
        PLANNER_CLAIM,
        "≤ 10 %",
        f"{within} of {len(errs)} within; worst {worst[0]:.1f} % ({worst[1]})",
        within == len(errs),
    )


def _ratio_goal(claim: str, v: float | None) -> dict:
    return _goal(claim, "ratio ≤ 1.05", "–" if v is None else f"{v:.3f}", None if v is None else v <= 1.05)


def _matrix_goal(res: dict) -> list[dict]:
    matrix = [s for s in res.get("stacks", []) if s.get("name") != "default" and s.get("ours")]
    if not matrix:
        return []
    ok = [s["name"] for s in matrix if s["ours"].get("status") == "ok"]
    bad = [s["name"] for s in matrix if s["ours"].get("status") != "ok"]
    measured = f"{len(ok)} of {len(matrix)}" + (f"; failed: {', '.join(bad)}" if bad else "")
    return [_goal("every quant × optim pair trains (ours)", f"{len(matrix)} of {len(matrix)}", measured, not bad)]


def goals_cpu(res: dict, suite: dict) -> list[dict]:
    r = _stack(res, "default").get("ratios") or {}
    goals = [
        _ratio_goal(f"train.py no more than 5 % slower than the baseline ({label}, default stack)", r.get(key))
        for key, label in (
            ("wall_s", "wall time"),
            ("cpu_s", "CPU time of the process"),
            ("s_per_step", "seconds/step after warm-up"),
            ("train_s", "training time"),
        )
    ]
    goals.append(_ratio_goal("the recipe layer costs no memory (peak RSS, default stack)", r.get("peak_gib")))
    for t in res.get("timings", []):
        measured = "–" if t.get("median_s") is None else f"{t['median_s']:.2f} s"
        goals.append(
            _goal(
                f"{t['name']}: `{t.get('command')}`, whole process", f"< {t.get('goal_s')} s", measured, t.get("pass")
            )
        )
    return [*goals, *_matrix_goal(res), _planner_goal(res)]


def _goal_8b_peak(res: dict) -> dict:
    s8 = _stack(res, "8b-nf4-paged8bit-ckpt").get("ours") or {}
    v = s8.get("peak_allocated_gib") or s8.get("peak_gib")
    if v is None:
        measured = "–"
    elif s8.get("peak_allocated_gib") is not None:
        measured = f"{v:.2f} GiB allocated, {fmt(s8.get('peak_reserved_gib'), 2)} GiB reserved"
    else:
        measured = f"{v:.2f} GiB peak RSS"
    claim = "8B (Llama-3.1-8B shape), seq 2048, bs 1, NF4 + paged8bit + checkpointing: peak"
    return _goal(claim, "≤ 7.0 GiB", measured, None if v is None else v <= 7.0)


def _goal_8b_speed(res: dict) -> dict:
    base = (_stack(res, "8b-mixed").get("baseline") or {}).get("tokens_per_s_steady")
    best, best_name = None, None
    for s in _ok_stacks(res, lambda name: name.startswith("8b-mixed")):
        t = s["ours"].get("tokens_per_s_steady")
        if t and (best is None or t > best):
            best, best_name = t, s["name"]
    r = ratio(best, base)
    return _goal(
        "8B tokens/s, our fastest option vs the baseline (mixed-length data, steady state)",
        "≥ 1.8×",
        "–" if r is None else f"{r:.2f}× ({best_name})",
        None if r is None else r >= 1.8,
    )


def _slope_goals(res: dict) -> list[dict]:
    goals = []
    for sec in res.get("slope", []):
        memory_fits = (
            f
            for f in sec.get("fits", [])
            if f.get("quantity") in ("peak_reserved_gib", "peak_rss_gib") and "at_target" in f
        )
        q = next(memory_fits, None)
        if q:
            gb = q["at_target"] * GiB / 1e9
            claim = (
                f"70B shape, {sec['target_layers']} layers (slope of layers {sec['layers']}), "
                f"seq 2048, bs 1: {q['quantity']}"
            )
            measured = (
                f"{gb:.1f} GB ({q['at_target']:.2f} GiB; planner {fmt(q.get('planner'), 2)} "
                f"GiB, {pct(q.get('planner_err_pct'))})"
            )
            goals.append(_goal(claim, "≤ 44 GB", measured, gb <= 44))
    return goals


def _prequantized_goals(res: dict) -> list[dict]:
    goals = []
    for s in _ok_stacks(res, lambda name: name.endswith("-prequantized")):
        v = s["ours"].get("peak_reserved_gib") or s["ours"].get("peak_gib")
        if v is not None:
            claim = f"{s['name']}: measured peak (GPU: max_memory_reserved), seq 2048, bs 1"
            goals.append(_goal(claim, "≤ 44 GB", f"{v * GiB / 1e9:.1f} GB", v * GiB / 1e9 <= 44))
    return goals


def goals_gpu(res: dict, suite: dict) -> list[dict]:
    seq = [
        _goal(
            f"longest sequence the 70B shape trains at here ({sec['name']})",
            "report",
            f"{sec.get('longest_seq')} (planner {sec.get('planner_longest_seq')})",
            None,
        )
        for sec in res.get("seq_search", [])
    ]
    return [
        _goal_8b_peak(res),
        _goal_8b_speed(res),
        *_slope_goals(res),
        *_prequantized_goals(res),
        *seq,
        _planner_goal(res),
    ]


GOALS: dict[str, Callable[[dict, dict], list[dict]]] = {"cpu": goals_cpu, "gpu": goals_gpu}


def goals_for(res: dict, suite: dict[str, Any]) -> list[dict]:
    """The goals of the suite's `goals` key (none when it has none)."""
    return GOALS.get(suite.get("goals"), lambda r, s: [])(res, suite)
