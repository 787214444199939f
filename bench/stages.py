"""The suites' stages (the CPU suite's: packing, a `stacks` stage): `stacks` (named stacks on one random-weight model,
e.g. the 8B shape's baseline comparison and speed options), `slope` (the 70B shape at a few depths,
peak and seconds/step per layer fitted and extrapolated to the full depth beside the planner's plan)
and `prequantized` (the full-depth model from a pre-quantized NF4 checkpoint written layer by layer).
Each takes the harness (`b`: settings, assets, measure, results), the stage's key and its entry."""

from __future__ import annotations

import shlex
from typing import Any

from bench import planning as P
from bench.models import figure_overrides
from bench.stats import extrapolate_layers, pct_error
from bench.suite import compose, expand_stacks, one_line
from qlora_recipes.units import GiB


def quantities(gpu: bool) -> list[str]:
    """What the slope fits: the memory figures of the device, and seconds per step."""
    return ["peak_allocated_gib", "peak_reserved_gib", "s_per_step"] if gpu else ["peak_rss_gib", "s_per_step"]


def plan_for(b: Any, overrides: list[str]) -> dict | None:
    """The planner's summary for a stack without a model dir (the option's figures), or its error."""
    try:
        cfg = compose(b.measure.child_overrides(overrides, b.settings.steps))
        return P.summary(cfg, b.settings.gpus_decl)
    except Exception as err:  # noqa: BLE001
        return {"error": one_line(err)}


def stage_stacks(b: Any, key: str, st: dict) -> None:
    option, fig = b.assets.model_fig(st["model"])
    path = b.assets.build_model(option, fig)
    seq = int(st.get("seq_len", b.assets.job_seq_len()))  # a stage may train longer rows than the job
    longer = [f"trainer.seq_len={seq}"] if "seq_len" in st else []
    for s in expand_stacks(st.get("stacks", [])):
        if not b.settings.selected(s["name"]):
            continue
        data = b.assets.stage_data(s, fig["vocab_size"], seq, b.settings.steps)
        ov = [*b.assets.model_overrides(option, fig, path), f"data.path={data}", *longer, *s.get("overrides", [])]
        b.measure.stack(
            s["name"],
            ov,
            baseline=s.get("baseline", False),
            repeats=s.get("repeats"),
            requires=tuple(s.get("requires", ())),
            profile_step=s.get("profile_step"),
        )


def _slope_fits(points: dict[str, dict[int, float]], target: int, plan: dict | None, gpu: bool) -> list[dict]:
    fits = []
    for q in quantities(gpu):
        pts = {k: v for k, v in points.get(q, {}).items() if v is not None}
        if len(pts) < 2:
            fits.append({"quantity": q, "error": f"{len(pts)} measured point(s); need 2"})
            continue
        ex = extrapolate_layers(pts, target)
        planner = P.comparable(plan, q)
        fits.append(
            {
                "quantity": q,
                **ex,
                "planner": planner,
                "planner_err_pct": pct_error(planner, ex["at_target"]),
                "at_target_gb": ex["at_target"] * GiB / 1e9 if q.endswith("_gib") else None,
            }
        )
    return fits


def stage_slope(b: Any, key: str, st: dict) -> None:
    seq = b.assets.job_seq_len()
    option, full_fig = b.assets.model_fig(st["model"])
    target = int(st.get("target_layers", full_fig["num_layers"]))
    points: dict[str, dict[int, float]] = {}
    names = []
    for layers in st["layers"]:
        _, fig = b.assets.model_fig(st["model"], num_layers=layers)
        path = b.assets.build_model(option, fig)
        data = b.assets.stage_data(st, fig["vocab_size"], seq, b.settings.steps)
        name = f"{key}-{option}-L{layers}"
        names.append(name)
        e = b.measure.stack(
            name,
            [*b.assets.model_overrides(option, fig, path), f"data.path={data}", *st.get("overrides", [])],
            baseline=st.get("baseline", False),
        )
        o = e.get("ours", {})
        if o.get("status") == "ok":
            for q in quantities(b.settings.gpu):
                points.setdefault(q, {})[layers] = o.get(q)
    # the planner for the full depth: the model option's figures, no model dir
    _, tfig = b.assets.model_fig(st["model"], num_layers=target)
    plan = plan_for(b, [f"model={option}", *figure_overrides(tfig), *st.get("overrides", [])])
    entry = {
        "name": f"{key}-{option}",
        "option": option,
        "layers": list(st["layers"]),
        "target_layers": target,
        "stacks": names,
        "plan_at_target": plan,
        "fits": _slope_fits(points, target, plan, b.settings.gpu),
    }
    b.results.put("slope", entry)


def stage_prequantized(b: Any, key: str, st: dict) -> None:
    seq = b.assets.job_seq_len()
    option, fig = b.assets.model_fig(st["model"], num_layers=st.get("num_layers"))
    path = b.assets.build_model(option, fig, quantize="nf4")
    data = b.assets.stage_data(st, fig["vocab_size"], seq, b.settings.steps)
    b.measure.stack(
        f"{key}-{option}-L{fig['num_layers']}-prequantized",
        [*b.assets.model_overrides(option, fig, path), f"data.path={data}", *st.get("overrides", [])],
        baseline=st.get("baseline", False),
    )


def long_context_cases(cases: list[dict], models: list[str], gpu_bytes: int | None, seq_cap: int | None) -> list[dict]:
    """The recorded longest-context cases (bench/results/longest-context.json) a GPU of `gpu_bytes`
    can train as planned: the stage's models, cards no larger than this GPU (None: every card), each
    at its longest_seq (at most `seq_cap`: --shrink), with the case's overrides less the model and
    trainer options the stage's own job and model dir set."""
    out = []
    for c in cases:
        if c["model"] not in models or not c.get("longest_seq"):
            continue
        if gpu_bytes is not None and c["card_gb"] * 10**9 > gpu_bytes * 1.02:  # an 80 GB card reports ~79.2 GiB
            continue
        seq = min(c["longest_seq"], seq_cap) if seq_cap else c["longest_seq"]
        keep = [o for o in shlex.split(c["command"])[2:] if "=" in o and not o.startswith(("model=", "trainer="))]
        out.append(
            {
                "name": f"long-{c['model']}-{c['card_gb']}gb",
                "model": c["model"],
                "seq_len": seq,
                "overrides": [*keep, f"trainer.seq_len={seq}"],
                "planned_allocated_gib": c.get("planned_allocated_gib"),
            }
        )
    return out


def stage_long_context(b: Any, key: str, st: dict) -> None:
    """The cases of bench/results/longest-context.json this GPU holds, each trained at its longest_seq:
    max_memory_allocated beside the plan (the table's command planned the card; this GPU may be larger)."""
    import json

    from bench.longest_context import RESULTS

    cases = json.loads(RESULTS.read_text())["cases"]
    gpu = b.settings.gpus_decl[0] if b.settings.gpus_decl else None
    picked = long_context_cases(cases, st["models"], gpu, st.get("seq_cap"))[: st.get("max_cases")]
    for case in picked:
        if not b.settings.selected(case["name"]):
            continue
        option, fig = b.assets.model_fig({"option": case["model"]})
        path = b.assets.build_model(option, fig)
        data = b.assets.stage_data(st, fig["vocab_size"], case["seq_len"], b.settings.steps)
        own = [o for o in case["overrides"] if o not in st.get("drop", ())]  # --shrink: no GPU-only options
        ov = [*b.assets.model_overrides(option, fig, path), f"data.path={data}", *own]
        b.measure.stack(case["name"], ov, baseline=False)
