"""Markdown of a results JSON: the header (commands, load, versions, settings), the stacks, ours /
baseline ratios, timings, the GPU suite's slope fits and sequence search, and the goals; and the
README's "Latest results" section, one block per device and suite, replaced in place."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    """A number with thousands separators, yes/no for a bool, – for None."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}{suffix}"
    return str(value)


def pct(value: Any) -> str:
    return "–" if value is None else f"{value:+.1f} %"


def _x(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def pass_mark(ok: bool | None) -> str:
    return "–" if ok is None else ("pass" if ok else "FAIL")


def _side_row(s: dict, side: str, r: dict, gpu: bool) -> str:
    if r.get("status") != "ok":
        return f"| {s['name']} | {side}: error | | | | | | | | | | | | {str(r.get('error', ''))[:160]} |"
    m = (
        f"{fmt(r.get('peak_allocated_gib'), 2)} / {fmt(r.get('peak_reserved_gib'), 2)}"
        if gpu
        else fmt(r.get("peak_rss_gib"), 3)
    )
    err = (s.get("plan_error_pct") or {}).get(side, {}).get("headline")
    return (
        f"| {s['name']} | {side} | {r.get('n')} | {fmt(r.get('max_others_cores'), 2)} | {fmt(r.get('wall_s'), 1)} | "
        f"{fmt(r.get('cpu_s'), 1)} | "
        f"{fmt(r.get('train_s'), 2)} | "
        f"{fmt(r.get('s_per_step'), 3)} | {fmt(r.get('tokens_per_s'), 0)} | {fmt(r.get('tokens_per_s_steady'), 0)} | "
        f"{m} | {fmt((s.get('plan') or {}).get('peak_gib'), 2)} | {pct(err)} | "
        f"{fmt(r.get('loss_first'), 3)} → {fmt(r.get('loss_last'), 3)} |"
    )


def _stack_rows(stacks: list[dict], gpu: bool) -> list[str]:
    mem = "alloc / reserved GiB" if gpu else "peak RSS GiB"
    lines = [
        f"| stack | run | n | others | wall s | CPU s | train s | s/step | tokens/s | tokens/s steady | {mem} | plan GiB | "
        "plan err | loss first → last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in stacks:
        if s.get("status") == "skipped":
            lines.append(f"| {s['name']} | skipped: {s.get('reason', '')} | | | | | | | | | | | | |")
            continue
        lines += [_side_row(s, side, s[side], gpu) for side in ("ours", "baseline") if s.get(side)]
    return lines


def _efficiency_rows(stacks: list[dict]) -> list[str]:
    """Token efficiency of our runs that report it: real tokens / computed tokens (padded slots computed)."""
    shown = [
        (s["name"], s["ours"]["token_efficiency"]) for s in stacks if (s.get("ours") or {}).get("token_efficiency")
    ]
    if not shown:
        return []
    return [
        "",
        "Token efficiency (ours; real / computed tokens, padded slots computed): "
        + ", ".join(f"{name} {value:.2f}" for name, value in shown),
    ]


def _note_rows(stacks: list[dict]) -> list[str]:
    """What a stack's figures need said beside them (a note written into its entry)."""
    return [f"- {s['name']}: {s['note']}" for s in stacks if s.get("note")]


def _ratio_rows(stacks: list[dict]) -> list[str]:
    with_base = [s for s in stacks if s.get("ratios")]
    if not with_base:
        return []
    lines = [
        "",
        "Ours / baseline (medians; < 1 is faster or smaller for time and memory, > 1 is faster for tokens/s):",
        "",
        "| stack | wall | CPU time | train | s/step | tokens/s | tokens/s steady | peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in with_base:
        r = s["ratios"]
        lines.append(
            f"| {s['name']} | {_x(r.get('wall_s'))} | {_x(r.get('cpu_s'))} | {_x(r.get('train_s'))} | "
            f"{_x(r.get('s_per_step'))} | "
            f"{_x(r.get('tokens_per_s'))} | {_x(r.get('tokens_per_s_steady'))} | {_x(r.get('peak_gib'))} |"
        )
    return lines


def _profile_rows(stacks: list[dict]) -> list[str]:
    """Each profiled run's key-averages table (bench/profile_step.py), ours and the baseline in turn."""
    lines: list[str] = []
    for s in stacks:
        for side in ("ours", "baseline"):
            prof = next((r["profile"] for r in (s.get(side) or {}).get("runs", []) if r.get("profile")), None)
            if prof is None:
                continue
            by = "device" if prof["sort_by"].startswith("device") else "CPU"
            lines += _titled(
                f"torch.profiler, {s['name']} ({side}), step {prof['step']}: {fmt(prof['step_wall_s'], 3)} s wall, "
                f"all ops' own time {fmt(prof['self_device_ms_all'], 1)} ms device, "
                f"{fmt(prof['self_cpu_ms_all'], 1)} ms CPU; top {len(prof['rows'])} ops by total {by} time; "
                f"chrome trace: {prof.get('trace', 'none')}",
                "| op | calls | self device ms | device total ms | self CPU ms | CPU total ms |",
                6,
            )
            lines += [
                f"| `{r['op']}` | {r['calls']} | {fmt(r['self_device_ms'], 2)} | {fmt(r['device_total_ms'], 2)} | "
                f"{fmt(r['self_cpu_ms'], 2)} | {fmt(r['cpu_total_ms'], 2)} |"
                for r in prof["rows"]
            ]
    return lines


def _header(res: Mapping[str, Any]) -> list[str]:
    lines = [f"### {res.get('suite')} suite — {res['device']['name']} — {res.get('date')}", ""]
    for run in res.get("runs", []):
        load = run.get("load_avg_before")
        after = run.get("load_avg_after")
        lines.append(
            f"- `{run.get('command')}` at {run.get('started')}; load average (1, 5, 15 min) before "
            f"{load}, after {after}{'; SHRINK mode (small shapes, not real figures)' if run.get('shrink') else ''}"
            + (f"; {run['note']}" if run.get("note") else "")
        )
    env = res.get("environment", {})
    lines.append("- " + ", ".join(f"{k} {v}" for k, v in env.items() if v))
    s = res.get("settings", {})
    if s:
        lines.append(
            f"- {s.get('steps')} optimizer steps per run, the first {s.get('warmup_steps')} excluded from "
            f"s/step; ours and baseline alternated (ABAB), {s.get('repeats')} pair(s) per stack unless "
            "the stack says n; medians"
        )
    return lines


def _timing_rows(timings: list[dict]) -> list[str]:
    if not timings:
        return []
    lines = ["", "| timing | command | runs (s) | median s | goal | |", "|---|---|---|---|---|---|"]
    for t in timings:
        runs = ", ".join(fmt(x, 2) for x in t.get("runs_s", []))
        lines.append(
            f"| {t['name']} | `{t.get('command')}` | {runs} | {fmt(t.get('median_s'), 2)} | "
            f"< {t.get('goal_s')} s | {pass_mark(t.get('pass'))} |"
        )
        if t.get("error"):
            lines.append(f"| | error: {str(t['error'])[:200]} | | | | |")
    return lines


def _titled(title: str, header: str, columns: int) -> list[str]:
    """A blank line, a title paragraph, and the head of a table with this header row."""
    return ["", title, "", header, "|" + "---|" * columns]


def _slope_rows(sec: dict) -> list[str]:
    layers = ", ".join(sec.get("layers", []) and map(str, sec["layers"]))
    lines = _titled(
        f"Per-layer slope: {sec['name']} (layers {layers} → {sec.get('target_layers')})",
        "| quantity | per layer | constant | r² | at target | planner at target | planner err |",
        7,
    )
    for q in sec.get("fits", []):
        if q.get("error"):
            lines.append(f"| {q['quantity']} | {q['error']} | | | | | |")
            continue
        lines.append(
            f"| {q['quantity']} | {fmt(q.get('per_layer'), 4)} | {fmt(q.get('constant'), 3)} | "
            f"{fmt(q.get('r2'), 4)} | {fmt(q.get('at_target'), 2)} | {fmt(q.get('planner'), 2)} | "
            f"{pct(q.get('planner_err_pct'))} |"
        )
    return lines


def _seq_rows(sec: dict) -> list[str]:
    lines = _titled(
        f"Longest sequence: {sec['name']} — mode {sec.get('mode')}: longest that fits "
        f"**{sec.get('longest_seq')}** (planner: {sec.get('planner_longest_seq')}); probes:",
        "| seq | fits | predicted / measured GiB | note |",
        4,
    )
    for p in sec.get("probes", []):
        lines.append(f"| {p['seq_len']} | {fmt(p.get('fits'))} | {fmt(p.get('peak_gib'), 2)} | {p.get('note', '')} |")
    return lines


def _goal_rows(goals: list[dict]) -> list[str]:
    rows = [f"| {g['claim']} | {g['target']} | {g.get('measured', '–')} | {pass_mark(g.get('pass'))} |" for g in goals]
    return ["", "| goal | target | measured | |", "|---|---|---|---|", *rows] if goals else []


def render_markdown(res: Mapping[str, Any]) -> str:
    """One results JSON as markdown: header, stacks, ratios, timings, GPU sections, goals."""
    gpu = res.get("device", {}).get("kind") == "cuda"
    lines = _header(res)
    stacks = res.get("stacks", [])
    if stacks:
        notes = _note_rows(stacks)
        lines += ["", *_stack_rows(stacks, gpu), *(["", "Notes:", *notes] if notes else [])]
        lines += [*_efficiency_rows(stacks), *_ratio_rows(stacks)]
        lines += _profile_rows(stacks)
    lines += _timing_rows(res.get("timings", []))
    for sec in res.get("slope", []):
        lines += _slope_rows(sec)
    for sec in res.get("seq_search", []):
        lines += _seq_rows(sec)
    lines += _goal_rows(res.get("goals", []))
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, res: Mapping[str, Any], markdown: str, results_file: str) -> None:
    """Replace (or add) this device and suite's section of bench/README.md with the latest table."""
    key = f"{res['device']['slug']}:{res.get('suite')}"
    begin, end = f"<!-- BEGIN {key} -->", f"<!-- END {key} -->"
    block = f"{begin}\n{markdown}\nFull results: [`{results_file}`]({results_file})\n{end}"
    text = readme.read_text() if readme.is_file() else "# Benchmarks\n\n## Latest results\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        anchor = "<!-- RESULTS -->"
        if anchor in text:
            text = text.replace(anchor, anchor + "\n\n" + block, 1)
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)
