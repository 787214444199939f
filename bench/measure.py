"""Measuring one stack and one timing. A stack is ours (`python train.py <job> <stack overrides>`)
and, where the suite asks, the baseline with the same job, alternated (A B A B ...) `repeats` times;
its entry holds the composed command, the planner's figures, every run, medians, ours / baseline
ratios and the planner's error on each side. A timing is a whole command (plan.py, train.py) run
`repeats` times against a goal in seconds."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench import REPO
from bench import planning as P
from bench.report import fmt
from bench.results import Results
from bench.runner import baseline_argv, log_tail, ratios, read_baseline, read_ours, run_child, summarize
from bench.stats import median
from bench.suite import Settings, compose, one_line

# What a timing keeps of a train.py run's metrics.json.
TIMING_METRICS = (
    "train_loss_first",
    "train_loss_last",
    "eval_exact_match_before",
    "eval_exact_match",
    "steps",
    "train_s",
    "peak_mem_gib",
)


# A profiled step's chrome trace larger than this (gzipped) stays in the work dir, out of the results.
TRACE_KEEP_BYTES = 8 << 20


def tidy(run_dir: Path) -> None:
    """Drop the adapters and checkpoints (hundreds of MB at 70B); keep metrics, plans and logs."""
    for sub in ("adapter", "checkpoints", "tb"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)


class Measure:
    """Runs stacks and timings for a suite run and records them in its results file."""

    def __init__(self, settings: Settings, results: Results):
        self.s, self.results = settings, results

    def child_overrides(self, overrides: list[str], steps: int) -> list[str]:
        return [
            *self.s.suite.get("job", []),
            *overrides,
            f"trainer.max_steps={steps}",
            # step-end times come from train.py's memory log (memory.jsonl); on a CPU every step's
            # TensorBoard scalars would cost ours time the baseline does not spend, so the CPU suite
            # logs every warm-up-many steps
            f"trainer.memory_log_steps={self.s.memory_log_steps}",
            "trainer.progress_bar=false",
        ]

    def stack(
        self,
        name: str,
        overrides: list[str],
        baseline: bool = False,
        repeats: int | None = None,
        requires: tuple = (),
        steps: int | None = None,
        warmup: int | None = None,
        record: bool = True,
        launcher: tuple = (),
        extra: dict | None = None,
        profile_step: int | None = None,
    ) -> dict:
        """Measure one stack (ours, and the baseline when asked); record it unless record=False.
        `launcher`: a module that runs ours's train.py (`python -m MODULE ARGS train.py ...`, e.g. the
        card-size cap of bench/card_check.py); `extra`: fields recorded in the entry; `profile_step`:
        that optimizer step of the first pair's runs under torch.profiler (bench/profile_step.py)."""
        steps, warmup = steps or self.s.steps, self.s.warmup if warmup is None else warmup
        kept = self.results.kept("stacks", name) if record else None
        if kept:
            return kept
        entry: dict = {
            "name": name,
            "overrides": list(overrides),
            "steps": steps,
            "warmup_steps": warmup,
            **(extra or {}),
            **({"profile_step": profile_step} if profile_step else {}),
        }
        full = self.child_overrides(overrides, steps)
        entry["train_py"] = "python train.py " + " ".join(full)
        cfg = self._compose_or_skip(entry, full, requires)
        if cfg is not None:
            self._plan(entry, cfg)
            self._alternate(entry, cfg, full, baseline, repeats or self.s.repeats, warmup, launcher)
        if record:
            self.results.put("stacks", entry)
        if cfg is not None:
            self._say(entry)
        return entry

    @staticmethod
    def _compose_or_skip(entry: dict, full: list[str], requires: tuple) -> Any:
        """The composed config, or None with the entry marked skipped: a package it requires is missing
        or an option it names does not exist here (reported, not fatal)."""
        missing = [m for m in requires if importlib.util.find_spec(m) is None]
        if missing:
            entry.update(status="skipped", reason=f"{', '.join(missing)} not installed")
        else:
            try:
                return compose(full)
            except Exception as err:  # noqa: BLE001
                entry.update(status="skipped", reason=f"not a stack option here: {one_line(err)[:200]}")
        print(f"[bench] {entry['name']}: skipped ({entry['reason']})", flush=True)
        return None

    def _plan(self, entry: dict, cfg: Any) -> None:
        try:
            entry["plan"] = P.summary(cfg, self.s.gpus_decl)
        except Exception as err:  # noqa: BLE001 - a planner failure is recorded beside the measurement
            entry["plan"] = None
            entry["plan_error"] = one_line(err)

    def _alternate(
        self, entry: dict, cfg: Any, full: list[str], baseline: bool, repeats: int, warmup: int, launcher: tuple = ()
    ) -> None:
        """Ours and the baseline alternated `repeats` times; medians, ratios and planner errors."""
        name, with_base = entry["name"], False
        if baseline:
            try:
                baseline_argv(cfg, Path("OUT"), Path("METRICS"))  # the baseline can run this job
                with_base = True
            except ValueError as err:
                entry["baseline"] = {"status": "skipped", "error": str(err)}
        ours_runs, base_runs = [], []
        profile = entry.get("profile_step")
        for i in range(repeats):
            step = profile if i == 0 else None  # one profiled pair; the medians barely feel it
            ours_runs.append(self._run_ours(name, i, full, warmup, launcher, step))
            if with_base:
                base_runs.append(self._run_baseline(name, i, cfg, warmup, step))
        entry["status"] = "ok"
        entry["ours"] = {**summarize(ours_runs), "runs": ours_runs}
        if with_base:
            entry["baseline"] = {**summarize(base_runs), "runs": base_runs}
            if entry["ours"]["status"] == "ok" and entry["baseline"]["status"] == "ok":
                entry["ratios"] = ratios(entry["ours"], entry["baseline"])
        entry["plan_error_pct"] = {
            side: P.plan_errors(entry.get("plan"), entry[side], self.s.gpu)
            for side in ("ours", "baseline")
            if isinstance(entry.get(side), dict) and entry.get("plan")
        }

    @staticmethod
    def _say(e: dict) -> None:
        o, b = e.get("ours", {}), e.get("baseline") or {}
        msg = (
            f"[bench] {e['name']}: ours {o.get('status')} wall {fmt(o.get('wall_s'), 1)} s, s/step "
            f"{fmt(o.get('s_per_step'), 3)}, peak {fmt(o.get('peak_gib'), 3)} GiB"
        )
        if b:
            msg += (
                f" | baseline {b.get('status')} wall {fmt(b.get('wall_s'), 1)} s, s/step "
                f"{fmt(b.get('s_per_step'), 3)}, peak {fmt(b.get('peak_gib'), 3)} GiB"
            )
        if o.get("status") != "ok":
            msg += f" | error: {o.get('error')}"
        print(msg, flush=True)

    def _run_ours(
        self, name: str, i: int, full: list[str], warmup: int, launcher: tuple = (), profile: int | None = None
    ) -> dict:
        run_dir = self.s.work / name / f"ours-{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        if profile:  # the profiler's launcher runs train.py (a stack with its own launcher is not profiled)
            launcher = ("bench.profile_step", str(profile), str(run_dir / "profile"))
        prefix = ["-m", *launcher] if launcher else []
        argv = [sys.executable, *prefix, str(REPO / "train.py"), *full, f"hydra.run.dir={run_dir}"]
        child = run_child(argv, self.s.work / name / f"ours-{i}.log", self.s.env, self.s.timeout)
        rec = read_ours(run_dir, child, warmup, self.s.gpu)
        self._keep_profile(rec, run_dir / "profile", f"{name}-ours")
        tidy(run_dir)
        return rec

    def _run_baseline(self, name: str, i: int, cfg: Any, warmup: int, profile: int | None = None) -> dict:
        out = self.s.work / name / f"baseline-{i}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        metrics = out / "metrics.json"
        argv = baseline_argv(cfg, out, metrics)
        if profile:  # argv[1:] is `-m bench.baseline ...`
            argv = [argv[0], "-m", "bench.profile_step", str(profile), str(out / "profile"), *argv[1:]]
        child = run_child(argv, self.s.work / name / f"baseline-{i}.log", self.s.env, self.s.timeout)
        rec = read_baseline(metrics, child, warmup, self.s.gpu)
        self._keep_profile(rec, out / "profile", f"{name}-baseline")
        tidy(out)
        return rec

    def _keep_profile(self, rec: dict, prof_dir: Path, label: str) -> None:
        """A profiled run's table into its record; its chrome trace beside the results file when small."""
        summary = prof_dir / "profile.json"
        if not summary.is_file():
            return
        rec["profile"] = json.loads(summary.read_text())
        trace = prof_dir / "trace.json.gz"
        size = trace.stat().st_size if trace.is_file() else 0
        if 0 < size <= TRACE_KEEP_BYTES:
            kept = self.results.path.with_name(f"{self.results.path.stem}-profile-{label}.json.gz")
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(trace, kept)
            rec["profile"]["trace"] = kept.name
        elif size:
            rec["profile"]["trace"] = f"not kept: {size / 2**20:.1f} MiB gzipped (over {TRACE_KEEP_BYTES >> 20} MiB)"

    def timing(self, t: dict) -> None:
        """A whole command `repeats` times: wall and CPU seconds, the median against the goal."""
        if self.results.kept("timings", t["name"]):
            return
        argv = [str(a) for a in t["argv"]]
        runs, cpu, errors, extra = [], [], [], {}
        for i in range(t.get("repeats", 1)):
            out_dir = self.s.work / "timing" / t["name"] / f"run-{i}"
            child = self._timed_run(t["name"], i, argv, out_dir)
            if child["rc"] != 0:
                errors.append(log_tail(child["log"]) or f"exit status {child['rc']}")
                continue
            runs.append(child["wall_s"])
            cpu.append(child["cpu_s"])
            extra = _timing_metrics(out_dir) or extra
            tidy(out_dir)
        med = median(runs)
        entry = {
            "name": t["name"],
            "command": "python " + " ".join(argv),
            "runs_s": runs,
            "median_s": med,
            "cpu_s": cpu,
            "goal_s": t.get("goal_s"),
            "pass": (med < t["goal_s"]) if med is not None and t.get("goal_s") else None,
            "metrics": extra or None,
            "error": errors[0] if errors else None,
        }
        print(f"[bench] timing {t['name']}: {', '.join(f'{x:.2f}' for x in runs)} s (median {fmt(med, 2)})", flush=True)
        self.results.put("timings", entry)

    def _timed_run(self, name: str, i: int, argv: list[str], out_dir: Path) -> dict:
        shutil.rmtree(out_dir, ignore_errors=True)
        child_argv = [sys.executable, *argv]
        if Path(argv[0]).name in ("train.py", "plan.py"):  # Hydra entry points: their run dir goes with the run
            child_argv.append(f"hydra.run.dir={out_dir}")
        return run_child(child_argv, self.s.work / "timing" / name / f"run-{i}.log", self.s.env, self.s.timeout)


def _timing_metrics(out_dir: Path) -> dict:
    """What a timed train.py run reported (losses, exact match, steps, peak); {} for other commands."""
    metrics = out_dir / "metrics.json"
    if not metrics.is_file():
        return {}
    m = json.loads(metrics.read_text())
    return {k: m.get(k) for k in TIMING_METRICS}
