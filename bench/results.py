"""The results file of a run: bench/results/<device>-<date>[-<suite>][-shrink].json and its markdown.

Runs of the same suite on the same device and day merge into one file: a stack or timing measured
again replaces its entry, and every run is listed with its command, start, end and load average.
The goals are recomputed and the file and its markdown rewritten after every entry, so an interrupted
run leaves what it measured (`--resume` keeps it). `rerender` does the same for files copied back from
another machine, and refreshes the README's table."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench import HERE, README
from bench.goals import goals_for
from bench.machine import environment, load_average, now_iso, today
from bench.report import render_markdown, update_readme
from bench.suite import Settings

SECTIONS = ("stacks", "timings", "slope", "seq_search", "goals")


class Results:
    """Today's results file for this device and suite, loaded (to merge into) or new."""

    def __init__(self, settings: Settings, command: str):
        self.s = settings
        suite = settings.suite
        suffix = "" if suite["name"] in ("cpu", "gpu") and not settings.shrink else f"-{suite['name']}"
        suffix += "-shrink" if settings.shrink else ""
        self.path = settings.results_dir / f"{settings.device['slug']}-{today()}{suffix}.json"
        self.res = self._load_or_new()
        self.run_meta = {
            "command": command,
            "started": now_iso(),
            "load_avg_before": load_average(),
            "shrink": settings.shrink,
            "stages": settings.args.stages,
            "settings": {"steps": settings.steps, "warmup_steps": settings.warmup, "repeats": settings.repeats},
        }
        self.res["runs"].append(self.run_meta)

    def _load_or_new(self) -> dict:
        s = self.s
        if self.path.is_file():
            old = json.loads(self.path.read_text())
            if old.get("suite") == s.suite["name"]:
                return old
            self.path = self.path.with_name(self.path.stem + f"-{s.suite['name']}.json")
        return {
            "suite": s.suite["name"],
            "device": s.device,
            "date": today(),
            "environment": environment(),
            "settings": {
                "steps": s.steps,
                "warmup_steps": s.warmup,
                "repeats": s.repeats,
                "job": s.suite.get("job", []),
            },
            "runs": [],
            **{section: [] for section in SECTIONS},
        }

    def kept(self, section: str, name: str) -> dict | None:
        """With --resume: the entry an earlier run of today's results file completed, else None."""
        if not self.s.args.resume:
            return None
        old = next((e for e in self.res.get(section, []) if e.get("name") == name), None)
        done = old and (old.get("median_s") is not None or (old.get("ours") or {}).get("status") == "ok")
        if done:
            print(f"[bench] {name}: kept from an earlier run (--resume)", flush=True)
        return old if done else None

    def put(self, section: str, entry: dict) -> None:
        """Add or replace (by name) an entry, then save."""
        items = [e for e in self.res[section] if e.get("name") != entry["name"]]
        items.append(entry)
        self.res[section] = items
        self.save()

    def error(self, stage: str, message: str) -> None:
        self.res.setdefault("errors", []).append({"stage": stage, "error": message})

    def save(self) -> None:
        self.run_meta["load_avg_after"] = load_average()
        self.run_meta["finished"] = now_iso()
        self.res["goals"] = goals_for(self.res, self.s.suite)
        self.s.results_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.res, indent=1, default=str) + "\n")
        self.path.with_suffix(".md").write_text(render_markdown(self.res))

    def finish(self) -> None:
        """Save, update the README's table (not for shrink runs or suites that say readme: false), print."""
        self.save()
        md = render_markdown(self.res)
        if self.s.suite.get("readme", True) and not self.s.args.no_readme and not self.s.shrink:
            update_readme(README, self.res, md, os.path.relpath(self.path, HERE))
        print(md)
        print(f"results: {self.path} (+ .md)")


def rerender(paths: list[str], no_readme: bool) -> None:
    """`python -m bench report FILE.json ...`: recompute the goals, rewrite each JSON and its markdown,
    and refresh the README's table (a shrink run's never)."""
    for p in paths:
        path = Path(p).resolve()
        res = json.loads(path.read_text())
        suite = {"name": res.get("suite"), "goals": "gpu" if res.get("device", {}).get("kind") == "cuda" else "cpu"}
        if res.get("suite") in ("cpu", "smoke", "gpu"):
            suite["goals"] = "gpu" if res["suite"] == "gpu" else "cpu"
        res["goals"] = goals_for(res, suite)
        md = render_markdown(res)
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        path.with_suffix(".md").write_text(md)
        shrink = any(r.get("shrink") for r in res.get("runs", []))
        if not no_readme and not shrink:
            update_readme(README, res, md, os.path.relpath(path, HERE))
        print(md)
