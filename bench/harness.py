"""A suite end to end: its stacks, its timings, then its stages in order (the GPU suite), each result
saved as it comes, then the README's table. `Bench` wires the pieces together: the run's `settings`,
its `results` file, `measure` (stacks and timings) and `assets` (models and data); the stage
functions receive it."""

from __future__ import annotations

import argparse
import time

from bench.gpu_check import stage_card_cases, stage_moe_slice
from bench.machine import load_average
from bench.measure import Measure
from bench.models import Assets
from bench.results import Results
from bench.seq_search import stage_seq_search
from bench.stages import stage_long_context, stage_prequantized, stage_slope, stage_stacks
from bench.suite import Settings, expand_stacks


def _in_part(stages: dict, part: int | None) -> list[str]:
    """The stages of one device call (a stage's `part`, 1 when it names none); every stage without --part."""
    if part is None:
        return list(stages)
    picked = [k for k, st in stages.items() if int(st.get("part", 1)) == part]
    if not picked:
        parts = sorted({int(st.get("part", 1)) for st in stages.values()})
        raise SystemExit(f"error: no stage in part {part}; this suite's parts are {', '.join(map(str, parts))}")
    return picked


# A stage's `kind` in the suite file -> the function that runs it.
STAGES = {
    "stacks": stage_stacks,
    "slope": stage_slope,
    "prequantized": stage_prequantized,
    "seq_search": stage_seq_search,
    "long_context": stage_long_context,
    "card_cases": stage_card_cases,
    "moe_slice": stage_moe_slice,
}


class Bench:
    def __init__(self, suite: dict, args: argparse.Namespace, command: str):
        self.settings = Settings(suite, args)
        self.wanted = self._wanted()
        self.results = Results(self.settings, command)
        self.measure = Measure(self.settings, self.results)
        self.assets = Assets(self.settings)

    def run(self) -> None:
        s = self.settings
        print(
            f"[bench] suite {s.suite['name']} on {s.device['name']}; load average {load_average()}; work dir {s.work}",
            flush=True,
        )
        self.results.save()
        for st in expand_stacks(s.suite.get("stacks", [])):
            if s.selected(st["name"]):
                self.measure.stack(
                    st["name"],
                    list(st.get("overrides", [])),
                    baseline=st.get("baseline", False),
                    repeats=st.get("repeats"),
                    requires=tuple(st.get("requires", ())),
                )
        for t in s.suite.get("timings", []):
            if s.selected(t["name"]):
                self.measure.timing(t)
        self._stages()
        self.results.finish()

    def _wanted(self) -> list[str]:
        """The stages to run (--stages, else --part's, else all), checked before anything is written."""
        s = self.settings
        stages = s.suite.get("stages", {})
        wanted = s.args.stages.split(",") if s.args.stages else _in_part(stages, getattr(s.args, "part", None))
        unknown = [w for w in wanted if w not in stages]
        if unknown:
            raise SystemExit(
                f"error: no stage {unknown[0]!r} in suite {s.suite['name']}; choose from: {', '.join(stages)}"
            )
        return wanted

    def _stages(self) -> None:
        s = self.settings
        stages = s.suite.get("stages", {})
        wanted = self.wanted
        steps, warmup, log_steps = s.steps, s.warmup, s.memory_log_steps
        for key in wanted:
            st = stages[key]
            started = time.time()
            # a stage may run fewer steps (the 80-layer model, the sequence probes); --steps wins
            s.steps = s.args.steps or st.get("steps", steps)
            s.warmup = st.get("warmup_steps", warmup)
            s.memory_log_steps = st.get("memory_log_steps", log_steps)
            print(f"[bench] stage {key} ({st['kind']})", flush=True)
            try:
                STAGES[st["kind"]](self, key, st)
            except RuntimeError as err:
                print(f"[bench] stage {key} failed: {err}", flush=True)
                self.results.error(key, str(err))
            print(f"[bench] stage {key} took {time.time() - started:.0f} s", flush=True)
