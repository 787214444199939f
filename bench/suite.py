"""Suites and the settings of one run of a suite. A suite is a YAML file in bench/suites/ (or a path):
the job every training run shares, the stacks (a `matrix` expands to every combination), timings of
whole commands, the GPU suite's stages, and a `shrink` section that runs the GPU suite's code path on
a CPU in small shapes. `compose` gives the config train.py composes for a list of overrides;
`Settings` holds what a run needs from the suite, the command line and the device."""

from __future__ import annotations

import argparse
import copy
import fnmatch
import itertools
import os
import time
from pathlib import Path

from bench import HERE, REPO
from bench.machine import describe_device
from bench.runner import child_env

SUITES = HERE / "suites"


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_suite(name: str, shrink: bool) -> dict:
    """A suite by name (bench/suites/NAME.yaml) or path; with `shrink`, its shrink section applied."""
    import yaml

    path = Path(name) if name.endswith((".yaml", ".yml")) else SUITES / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SUITES.glob("*.yaml")))
        raise SystemExit(f"error: no suite {name!r} ({path}); choose one of: {known}, or give a .yaml path")
    suite = yaml.safe_load(path.read_text()) or {}
    suite["name"] = path.stem
    if shrink:
        if "shrink" not in suite:
            raise SystemExit(f"error: suite {suite['name']} has no shrink section")
        sh = suite["shrink"]
        for key in ("steps", "warmup_steps", "timeout_s", "repeats"):
            if key in sh:
                suite[key] = sh[key]
        suite["job"] = list(suite.get("job", [])) + list(sh.get("job", []))
        suite["stages"] = deep_merge(suite.get("stages", {}), sh.get("stages", {}))
    return suite


def expand_stacks(entries: list[dict]) -> list[dict]:
    """Suite stack entries, each `matrix` expanded to one stack per combination of its values."""
    out = []
    for e in entries:
        if "matrix" in e:
            keys = list(e["matrix"])
            for combo in itertools.product(*(e["matrix"][k] for k in keys)):
                values = dict(zip(keys, combo, strict=True))
                item = {k: v for k, v in e.items() if k != "matrix"}
                item["name"] = e.get("name", "-".join("{" + k + "}" for k in keys)).format(**values)
                item["overrides"] = [f"{k}={v}" for k, v in values.items()] + list(e.get("overrides", []))
                out.append(item)
        else:
            out.append(dict(e))
    return out


def compose(overrides: list[str]):
    """The typed config train.py runs for these overrides (hydra.* ones are for the child only)."""
    from qlora_recipes.config.loader import load

    return load([o for o in overrides if not o.startswith("hydra.")])


def one_line(err: Exception) -> str:
    from qlora_recipes.config.loader import one_line as cli_one_line

    try:
        return cli_one_line(err)
    except Exception:  # noqa: BLE001 - any message will do
        return str(err).splitlines()[0] if str(err) else type(err).__name__


class Settings:
    """One run of a suite: the suite, the options, the device, and where runs, models and results go.
    `steps` and `warmup` change per stage (a stage may run fewer steps); --steps wins."""

    def __init__(self, suite: dict, args: argparse.Namespace):
        self.suite, self.args = suite, args
        self.shrink = bool(args.shrink)
        self.device = describe_device(force_cpu=self.shrink)
        self.gpu = self.device["kind"] == "cuda"
        self.steps = args.steps or suite.get("steps", 10)
        self.warmup = suite.get("warmup_steps", 2)
        self.memory_log_steps = suite.get("memory_log_steps", 1)  # a stage may set its own
        self.repeats = args.repeats or suite.get("repeats", 1)
        self.timeout = args.timeout or suite.get("timeout_s", 1200)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.work = Path(args.work_dir or REPO / "runs" / "bench" / f"{suite['name']}-{stamp}").resolve()
        cache_root = os.environ.get("QLORA_RECIPES_CACHE", str(Path.home() / ".cache" / "qlora-recipes"))
        self.cache = Path(args.cache or Path(cache_root) / "bench").resolve()
        # The baseline's load_dataset caches its tokenization in the datasets cache, as it would for a
        # user running it again; a cache of this run's own makes its first baseline run a cold one.
        extra_env = {"HF_DATASETS_CACHE": str(self.work / "hf-datasets-cache")}
        if self.shrink:
            extra_env["CUDA_VISIBLE_DEVICES"] = ""
        self.env = child_env(extra_env)
        self.results_dir = Path(args.results_dir or HERE / "results").resolve()
        self.gpus_decl = [self.device["total_bytes"]] if self.gpu else []
        if suite.get("needs_gpu") and not self.gpu and not self.shrink:
            raise SystemExit(
                f"error: the {suite['name']} suite needs a CUDA GPU and none is visible here; "
                "--shrink runs its code path on this CPU with small shapes"
            )

    def selected(self, name: str) -> bool:
        """Whether --only (comma-separated globs) lets a stack or timing of this name run."""
        return not self.args.only or any(fnmatch.fnmatch(name, pat) for pat in self.args.only.split(","))
