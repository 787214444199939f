"""What the planner suites (planner-cpu, planner-sharded) share: their command line, their start
(model cache, work dir, the cases --only picks, the results already there) and their results files
(JSON with every case, and a Markdown table with the runs that made it)."""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from bench import REPO
from bench.machine import describe_device, environment, load_average, now_iso

TOLERANCE = 0.10


def parser(prog: str, doc: str, results: Path, names: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    p.add_argument("--only", help=f"comma-separated globs of case names ({names})")
    p.add_argument("--resume", action="store_true", help="keep the cases the results file already has")
    p.add_argument("--cache", default=None, help="where the built models go (both suites share them)")
    p.add_argument("--work-dir", default=None, help="run dirs and logs")
    p.add_argument("--results", default=str(results), help="results path without suffix")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    p.add_argument("--collect", help="no runs: read the finished run dirs under this work dir into the results")
    p.add_argument("--replan", action="store_true", help="no runs: re-score the measured cases with today's planner")
    return p


def suite_start(args, prog: str, argv: list[str], suite: str, all_cases: list[dict], **extra) -> tuple:
    """The model cache (the same models for both suites), the work dir, the cases --only picks, the
    cases and runs its results file already holds, and the results' header with this run appended."""
    cache = Path(args.cache or Path(os.environ.get("QLORA_RECIPES_CACHE", Path.home() / ".cache/qlora-recipes")))
    cache = cache / "bench" / "planner-cpu"
    work = Path(args.work_dir or REPO / "runs" / "bench" / f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}")
    results = Path(args.results)
    todo = all_cases
    if args.only:
        globs = args.only.split(",")
        todo = [c for c in todo if any(fnmatch.fnmatch(c["name"], g) for g in globs)]
    kept: dict[str, dict] = {}
    runs: list[dict] = []
    if results.with_suffix(".json").is_file():
        old = json.loads(results.with_suffix(".json").read_text())
        kept, runs = {e["name"]: e for e in old["cases"]}, old.get("runs", [])
    runs.append({"command": " ".join([prog, *argv]), "started": now_iso(), "load_average_before": load_average()})
    meta = {
        "suite": suite,
        "date": now_iso()[:10],
        "device": describe_device(True)["name"],
        "environment": environment(),
        "tolerance": TOLERANCE,
        **extra,
        "runs": runs,
    }
    return cache, work, todo, kept, meta


def write_results(
    path: Path, meta: dict, entries: list[dict], summary: dict, title: str, notes: list[str], table: list[str]
) -> None:
    """path.json: the header, the summary and every case; path.md: the title, the runs that made
    the results, the notes and the table (its header rows first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({**meta, "summary": summary, "cases": entries}, indent=1) + "\n")
    lines = [
        f"### {title} — {meta['device']} — {meta['date']}",
        "",
        *(
            f"- `{r['command']}` at {r['started']}; load average before {r['load_average_before']}"
            for r in meta["runs"]
        ),
        f"- {meta['environment']}",
        *(f"- {note}" for note in notes),
        "",
        *table,
    ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def in_suite_order(kept: dict[str, dict], all_cases: list[dict]) -> list[dict]:
    """The cases of the suite as it is now (in its order) that have a result."""
    return [kept[c["name"]] for c in all_cases if c["name"] in kept]


def worst_ratio(ratios: list[float]) -> float | None:
    return max(ratios, key=lambda r: abs(r - 1), default=None)


def collect(todo: list[dict], collect_dir: str, finished: Callable[[Path], bool], read: Callable) -> dict[str, dict]:
    """The finished run dirs (of a harness that was stopped while its processes ran on) as results."""
    out = {}
    for case in todo:
        run_dir = Path(collect_dir) / case["name"].replace("/", "--")
        if finished(run_dir):
            out[case["name"]] = read(case, run_dir, 0, None)
    return out
