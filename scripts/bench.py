"""Benchmarks that prove the stacks: memory and speed against the plan and against the plain way.

    python scripts/bench.py cpu                    # the CPU suite (make bench-cpu), ~15 min on 2 cores
    python scripts/bench.py gpu                    # the GPU suite (make bench-gpu), every stage
    python scripts/bench.py gpu --stages 8b,slope  # some stages: 8b, slope, full, seq
    python scripts/bench.py gpu --shrink           # the GPU suite's code path on a CPU, small shapes
    python scripts/bench.py smoke                  # 3 steps of the harness itself (the tests run it)
    python scripts/bench.py report bench/results/X.json   # re-render X.md and bench/README.md

A suite is a file in bench/suites/ (or a path). Each measured run is a fresh process (peak RSS and
max_memory_allocated are per process): ours is `python train.py <job> <stack overrides>`, the
baseline `scripts/baseline_qlora.py` with the same model, data, steps and hyperparameters, run
alternately (ABAB). Results go to bench/results/<device>-<date>.json (merged with an earlier file of
the same device, date and suite: a stack measured again replaces its entry, every run is listed) and a
markdown table beside it; bench/README.md keeps the latest table per device and suite.
Options: --repeats N, --steps N, --only GLOB (stack names), --results-dir, --work-dir, --cache DIR
(random-weight models and synthetic data; default $QLORA_RECIPES_CACHE/bench), --no-readme,
--timeout S (per child process), --resume (keep the stacks and timings today's results file already
has, e.g. after an interrupted run or a device command's time limit).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import importlib.util
import itertools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qlora_recipes import bench as B  # noqa: E402

SUITES = REPO / "bench" / "suites"
GiB = 1 << 30
MODEL_MAX_POSITIONS = 131072  # built models allow long sequences (default RoPE; the seq search needs it)


# ---------------------------------------------------------------------------------------------
# Suites and configs
# ---------------------------------------------------------------------------------------------
def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_suite(name: str, shrink: bool) -> dict:
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


def compose(overrides: list[str]):
    """The config train.py composes for these overrides (hydra.* ones are for the child only)."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from qlora_recipes.schema import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hcompose(config_name="train", overrides=[o for o in overrides if not o.startswith("hydra.")])


def one_line(err: Exception) -> str:
    from qlora_recipes.cli import one_line as cli_one_line

    try:
        return cli_one_line(err)
    except Exception:  # noqa: BLE001 - any message will do
        return str(err).splitlines()[0] if str(err) else type(err).__name__


def expand_stacks(entries: list[dict]) -> list[dict]:
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


# ---------------------------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, suite: dict, args: argparse.Namespace):
        self.suite, self.args = suite, args
        self.shrink = bool(args.shrink)
        self.device = B.describe_device(force_cpu=self.shrink)
        self.gpu = self.device["kind"] == "cuda"
        self.steps = args.steps or suite.get("steps", 10)
        self.warmup = suite.get("warmup_steps", 2)
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
        self.env = B.child_env(extra_env)
        self.results_dir = Path(args.results_dir or REPO / "bench" / "results").resolve()
        self.gpus_decl = [self.device["total_bytes"]] if self.gpu else []
        suffix = "" if suite["name"] in ("cpu", "gpu") and not self.shrink else f"-{suite['name']}"
        suffix += "-shrink" if self.shrink else ""
        self.out_json = self.results_dir / f"{self.device['slug']}-{B.today()}{suffix}.json"
        if suite.get("needs_gpu") and not self.gpu and not self.shrink:
            raise SystemExit(
                f"error: the {suite['name']} suite needs a CUDA GPU and none is visible here; "
                "--shrink runs its code path on this CPU with small shapes"
            )
        self.res = self._load_or_new()
        self.run_meta = {
            "command": " ".join(["python", "scripts/bench.py", *sys.argv[1:]]),
            "started": B.now_iso(),
            "load_avg_before": B.load_average(),
            "shrink": self.shrink,
            "stages": args.stages,
            "settings": {"steps": self.steps, "warmup_steps": self.warmup, "repeats": self.repeats},
        }
        self.res["runs"].append(self.run_meta)

    # -- results file ------------------------------------------------------------------------
    def _load_or_new(self) -> dict:
        if self.out_json.is_file():
            old = json.loads(self.out_json.read_text())
            if old.get("suite") == self.suite["name"]:
                return old
            self.out_json = self.out_json.with_name(self.out_json.stem + f"-{self.suite['name']}.json")
        return {
            "suite": self.suite["name"],
            "device": self.device,
            "date": B.today(),
            "environment": B.environment(),
            "settings": {
                "steps": self.steps,
                "warmup_steps": self.warmup,
                "repeats": self.repeats,
                "job": self.suite.get("job", []),
            },
            "runs": [],
            "stacks": [],
            "timings": [],
            "slope": [],
            "seq_search": [],
            "goals": [],
        }

    def _kept(self, section: str, name: str) -> dict | None:
        """With --resume: the entry an earlier run of today's results file completed, else None."""
        if not self.args.resume:
            return None
        old = next((e for e in self.res.get(section, []) if e.get("name") == name), None)
        done = old and (old.get("median_s") is not None or (old.get("ours") or {}).get("status") == "ok")
        if done:
            print(f"[bench] {name}: kept from an earlier run (--resume)", flush=True)
        return old if done else None

    def _put(self, section: str, entry: dict) -> None:
        items = [e for e in self.res[section] if e.get("name") != entry["name"]]
        items.append(entry)
        self.res[section] = items
        self.save()

    def save(self) -> None:
        self.run_meta["load_avg_after"] = B.load_average()
        self.run_meta["finished"] = B.now_iso()
        self.res["goals"] = GOALS.get(self.suite.get("goals"), lambda r, s: [])(self.res, self.suite)
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.out_json.write_text(json.dumps(self.res, indent=1, default=str) + "\n")
        md = B.render_markdown(self.res)
        self.out_json.with_suffix(".md").write_text(md)

    def finish(self) -> None:
        self.save()
        md = B.render_markdown(self.res)
        if self.suite.get("readme", True) and not self.args.no_readme and not self.shrink:
            rel = os.path.relpath(self.out_json, REPO / "bench")
            B.update_readme(REPO / "bench" / "README.md", self.res, md, rel)
        print(md)
        print(f"results: {self.out_json} (+ .md)")

    # -- one training run --------------------------------------------------------------------
    def _child_overrides(self, overrides: list[str], steps: int) -> list[str]:
        return [
            *self.suite.get("job", []),
            *overrides,
            f"trainer.max_steps={steps}",
            # step-end times come from train.py's memory log (memory.jsonl); on a CPU every step's
            # TensorBoard scalars would cost ours time the baseline does not spend, so the CPU suite
            # logs every warm-up-many steps
            f"trainer.memory_log_steps={self.suite.get('memory_log_steps', 1)}",
            "trainer.progress_bar=false",
        ]

    def measure_stack(
        self,
        name: str,
        overrides: list[str],
        baseline: bool = False,
        repeats: int | None = None,
        requires: tuple = (),
        steps: int | None = None,
        warmup: int | None = None,
        record: bool = True,
    ) -> dict:
        steps, warmup = steps or self.steps, self.warmup if warmup is None else warmup
        repeats = repeats or self.repeats
        kept = self._kept("stacks", name) if record else None
        if kept:
            return kept
        entry: dict = {"name": name, "overrides": list(overrides), "steps": steps, "warmup_steps": warmup}
        missing = [m for m in requires if importlib.util.find_spec(m) is None]
        full = self._child_overrides(overrides, steps)
        entry["train_py"] = "python train.py " + " ".join(full)
        if missing:
            entry.update(status="skipped", reason=f"{', '.join(missing)} not installed")
        else:
            try:
                cfg = compose(full)
            except Exception as err:  # noqa: BLE001 - an option the stack does not have is reported, not fatal
                entry.update(status="skipped", reason=f"not a stack option here: {one_line(err)[:200]}")
        if entry.get("status") == "skipped":
            print(f"[bench] {name}: skipped ({entry['reason']})", flush=True)
            if record:
                self._put("stacks", entry)
            return entry
        from qlora_recipes import memory

        try:
            entry["plan"] = B.plan_summary(memory.plan_stack(cfg, gpus=self.gpus_decl, ladder=False))
        except Exception as err:  # noqa: BLE001
            entry["plan"] = None
            entry["plan_error"] = one_line(err)
        base_argv = None
        if baseline:
            try:
                base_argv = B.baseline_argv(cfg, Path("OUT"), Path("METRICS"))
            except ValueError as err:
                entry["baseline"] = {"status": "skipped", "error": str(err)}
        ours_runs, base_runs = [], []
        for i in range(repeats):
            ours_runs.append(self._run_ours(name, i, full, warmup))
            if base_argv is not None:
                base_runs.append(self._run_baseline(name, i, cfg, warmup))
        entry["status"] = "ok"
        entry["ours"] = {**B.summarize(ours_runs), "runs": ours_runs}
        if base_argv is not None:
            entry["baseline"] = {**B.summarize(base_runs), "runs": base_runs}
            if entry["ours"]["status"] == "ok" and entry["baseline"]["status"] == "ok":
                entry["ratios"] = B.ratios(entry["ours"], entry["baseline"])
        entry["plan_error_pct"] = {
            side: B.plan_errors(entry.get("plan"), entry[side], self.gpu)
            for side in ("ours", "baseline")
            if isinstance(entry.get(side), dict) and entry.get("plan")
        }
        if record:
            self._put("stacks", entry)
        self._say(entry)
        return entry

    def _say(self, e: dict) -> None:
        o, b = e.get("ours", {}), e.get("baseline") or {}
        msg = (
            f"[bench] {e['name']}: ours {o.get('status')} wall {B._f(o.get('wall_s'), 1)} s, s/step "
            f"{B._f(o.get('s_per_step'), 3)}, peak {B._f(o.get('peak_gib'), 3)} GiB"
        )
        if b:
            msg += (
                f" | baseline {b.get('status')} wall {B._f(b.get('wall_s'), 1)} s, s/step "
                f"{B._f(b.get('s_per_step'), 3)}, peak {B._f(b.get('peak_gib'), 3)} GiB"
            )
        if o.get("status") != "ok":
            msg += f" | error: {o.get('error')}"
        print(msg, flush=True)

    def _run_ours(self, name: str, i: int, full: list[str], warmup: int) -> dict:
        run_dir = self.work / name / f"ours-{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [sys.executable, str(REPO / "train.py"), *full, f"hydra.run.dir={run_dir}"]
        child = B.run_child(argv, self.work / name / f"ours-{i}.log", self.env, self.timeout)
        rec = B.read_ours(run_dir, child, warmup, self.gpu)
        self._tidy(run_dir)
        return rec

    def _run_baseline(self, name: str, i: int, cfg, warmup: int) -> dict:
        out = self.work / name / f"baseline-{i}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        metrics = out / "metrics.json"
        argv = B.baseline_argv(cfg, out, metrics)
        child = B.run_child(argv, self.work / name / f"baseline-{i}.log", self.env, self.timeout)
        rec = B.read_baseline(metrics, child, warmup, self.gpu)
        self._tidy(out)
        return rec

    @staticmethod
    def _tidy(run_dir: Path) -> None:
        """Drop the adapters and checkpoints (hundreds of MB at 70B); keep metrics, plans and logs."""
        for sub in ("adapter", "checkpoints", "tb"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)

    # -- timings -----------------------------------------------------------------------------
    def timing(self, t: dict) -> None:
        if self._kept("timings", t["name"]):
            return
        argv = [str(a) for a in t["argv"]]
        script = Path(argv[0]).name
        runs, cpu, errors, extra = [], [], [], {}
        for i in range(t.get("repeats", 1)):
            out_dir = self.work / "timing" / t["name"] / f"run-{i}"
            shutil.rmtree(out_dir, ignore_errors=True)
            child_argv = [sys.executable, *argv]
            if script in ("train.py", "plan.py"):
                child_argv.append(f"hydra.run.dir={out_dir}")
            child = B.run_child(child_argv, self.work / "timing" / t["name"] / f"run-{i}.log", self.env, self.timeout)
            if child["rc"] != 0:
                errors.append(B.log_tail(child["log"]) or f"exit status {child['rc']}")
                continue
            runs.append(child["wall_s"])
            cpu.append(child["cpu_s"])
            metrics = out_dir / "metrics.json"
            if metrics.is_file():
                m = json.loads(metrics.read_text())
                extra = {
                    k: m.get(k)
                    for k in (
                        "train_loss_first",
                        "train_loss_last",
                        "eval_exact_match_before",
                        "eval_exact_match",
                        "steps",
                        "train_s",
                        "peak_mem_gib",
                    )
                }
            self._tidy(out_dir)
        med = B.median(runs)
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
        print(
            f"[bench] timing {t['name']}: {', '.join(f'{x:.2f}' for x in runs)} s (median {B._f(med, 2)})", flush=True
        )
        self._put("timings", entry)

    # -- models and data (GPU suite) -----------------------------------------------------------
    def model_fig(self, spec: dict, num_layers: int | None = None) -> tuple[str, dict]:
        option = spec["option"]
        mcfg = compose([f"model={option}"]).model
        sh = self.suite.get("shrink", {}) if self.shrink else {}
        fig = B.figures_of(mcfg, **sh.get("figures", {}))
        if self.shrink:
            fig["head_dim"] = fig["hidden_size"] // fig["num_heads"]
            fig["num_layers"] = sh.get("num_layers", 2)
        if num_layers is not None:
            fig["num_layers"] = int(num_layers)
        fig["max_position_embeddings"] = max(int(fig.get("max_position_embeddings") or 0), MODEL_MAX_POSITIONS)
        return option, fig

    def build_model(self, option: str, fig: dict, quantize: str | None = None) -> Path:
        tag = f"{option}-L{fig['num_layers']}-h{fig['hidden_size']}-{quantize or 'bf16'}"
        out = self.cache / "models" / tag
        stamp = out / "bench-model.json"
        if stamp.is_file():
            return out
        need = B.model_disk_bytes(fig, quantize)
        self._make_room(need, keep=out)
        spec = json.dumps({"figures": fig, "quantize": quantize})
        device = "cuda" if self.gpu else "cpu"
        print(f"[bench] building {tag} ({need / GiB:.1f} GiB, random weights, on {device})", flush=True)
        started = time.time()
        if self.gpu:  # in a child, so that this process never holds a CUDA context
            child = B.run_child(
                [sys.executable, __file__, "_build", spec, str(out), device],
                self.work / "build" / f"{tag}.log",
                self.env,
                self.timeout,
            )
            if child["rc"] != 0 or not stamp.is_file():
                raise RuntimeError(f"building {tag} failed: {B.log_tail(child['log'])}")
        else:
            B.build_random_model(fig, out, quantize=quantize, device="cpu")
        print(f"[bench] built {tag} in {time.time() - started:.0f} s", flush=True)
        return out

    def _make_room(self, need: int, keep: Path) -> None:
        """Free disk for a model: drop other cached bench models, oldest first, while short."""
        models = self.cache / "models"
        models.mkdir(parents=True, exist_ok=True)
        margin = 4 * GiB
        others = sorted((p for p in models.iterdir() if p.is_dir() and p != keep), key=lambda p: p.stat().st_mtime)
        while shutil.disk_usage(models).free < need + margin and others:
            victim = others.pop(0)
            print(f"[bench] removing cached {victim.name} to make room", flush=True)
            shutil.rmtree(victim, ignore_errors=True)

    def data_file(self, kind: dict, vocab: int, seq_len: int, steps: int) -> Path:
        if kind["kind"] == "full":
            rows, lo, hi = steps + 4, seq_len + 8, seq_len + 8
        else:
            lo, hi = int(kind.get("min_words", 64)), seq_len
            mean = (hi - lo) / math.log(hi / lo) if hi > lo else hi
            rows = int(math.ceil(1.5 * steps * seq_len / mean)) + 8
        path = self.cache / "data" / f"{kind['kind']}-v{vocab}-w{lo}-{hi}-r{rows}.jsonl"
        if not path.is_file():
            tmp = path.with_suffix(".tmp")
            B.write_text_data(tmp, vocab, rows, lo, hi, seed=0)
            tmp.replace(path)
        return path

    def _job_seq_len(self) -> int:
        seq = 2048
        for o in self.suite.get("job", []):
            if o.startswith("trainer.seq_len="):
                seq = int(o.split("=", 1)[1])
        return seq

    def model_overrides(self, option: str, fig: dict, path: Path) -> list[str]:
        return [f"model={option}", f"model.name_or_path={path}", *B.figure_overrides(fig), "force=true"]

    # -- stages --------------------------------------------------------------------------------
    def stage_stacks(self, key: str, st: dict) -> None:
        option, fig = self.model_fig(st["model"])
        path = self.build_model(option, fig)
        seq = self._job_seq_len()
        for s in expand_stacks(st.get("stacks", [])):
            if not self._selected(s["name"]):
                continue
            data = self.data_file(self.suite["data"][s.get("data", "full")], fig["vocab_size"], seq, self.steps)
            ov = [*self.model_overrides(option, fig, path), f"data.path={data}", *s.get("overrides", [])]
            self.measure_stack(
                s["name"],
                ov,
                baseline=s.get("baseline", False),
                repeats=s.get("repeats"),
                requires=tuple(s.get("requires", ())),
            )

    def stage_slope(self, key: str, st: dict) -> None:
        seq = self._job_seq_len()
        option, full_fig = self.model_fig(st["model"])
        target = int(st.get("target_layers", full_fig["num_layers"]))
        points: dict[str, dict[int, float]] = {}
        names = []
        for layers in st["layers"]:
            _, fig = self.model_fig(st["model"], num_layers=layers)
            path = self.build_model(option, fig)
            data = self.data_file(self.suite["data"][st.get("data", "full")], fig["vocab_size"], seq, self.steps)
            name = f"{key}-{option}-L{layers}"
            names.append(name)
            e = self.measure_stack(
                name,
                [*self.model_overrides(option, fig, path), f"data.path={data}", *st.get("overrides", [])],
                baseline=st.get("baseline", False),
            )
            o = e.get("ours", {})
            if o.get("status") == "ok":
                for q in self._quantities():
                    points.setdefault(q, {})[layers] = o.get(q)
        # the planner for the full depth: the model option's figures, no model dir
        _, tfig = self.model_fig(st["model"], num_layers=target)
        plan = self._plan([f"model={option}", *B.figure_overrides(tfig), *st.get("overrides", [])])
        fits = []
        for q in self._quantities():
            pts = {k: v for k, v in points.get(q, {}).items() if v is not None}
            if len(pts) < 2:
                fits.append({"quantity": q, "error": f"{len(pts)} measured point(s); need 2"})
                continue
            ex = B.extrapolate_layers(pts, target)
            planner = self._planner_comparable(plan, q)
            fits.append(
                {
                    "quantity": q,
                    **ex,
                    "planner": planner,
                    "planner_err_pct": B.pct_error(planner, ex["at_target"]),
                    "at_target_gb": ex["at_target"] * GiB / 1e9 if q.endswith("_gib") else None,
                }
            )
        self._put(
            "slope",
            {
                "name": f"{key}-{option}",
                "option": option,
                "layers": list(st["layers"]),
                "target_layers": target,
                "stacks": names,
                "plan_at_target": plan,
                "fits": fits,
            },
        )

    def _quantities(self) -> list[str]:
        return ["peak_allocated_gib", "peak_reserved_gib", "s_per_step"] if self.gpu else ["peak_rss_gib", "s_per_step"]

    def _plan(self, overrides: list[str]) -> dict | None:
        from qlora_recipes import memory

        try:
            cfg = compose(self._child_overrides(overrides, self.steps))
            return B.plan_summary(memory.plan_stack(cfg, gpus=self.gpus_decl, ladder=False))
        except Exception as err:  # noqa: BLE001
            return {"error": one_line(err)}

    @staticmethod
    def _planner_comparable(plan: dict | None, quantity: str) -> float | None:
        """The planner's figure for a measured quantity: see bench.plan_errors."""
        if not plan or plan.get("peak_gib") is None:
            return None
        if quantity == "peak_rss_gib":
            return plan["peak_gib"]
        if quantity == "peak_reserved_gib":
            return plan["peak_gib"] - plan["cuda_context_gib"]
        if quantity == "peak_allocated_gib":
            return plan["peak_gib"] - plan["cuda_context_gib"] - plan["allocator_overhead_gib"]
        return None

    def stage_prequantized(self, key: str, st: dict) -> None:
        seq = self._job_seq_len()
        option, fig = self.model_fig(st["model"], num_layers=st.get("num_layers"))
        path = self.build_model(option, fig, quantize="nf4")
        data = self.data_file(self.suite["data"][st.get("data", "full")], fig["vocab_size"], seq, self.steps)
        self.measure_stack(
            f"{key}-{option}-L{fig['num_layers']}-prequantized",
            [*self.model_overrides(option, fig, path), f"data.path={data}", *st.get("overrides", [])],
            baseline=st.get("baseline", False),
        )

    def stage_seq_search(self, key: str, st: dict) -> None:
        option, full_fig = self.model_fig(st["model"])
        target = int(st.get("target_layers", full_fig["num_layers"]))
        lo, hi, gran = int(st["lo"]), int(st["hi"]), int(st.get("granularity", 1024))
        steps, warmup = self.steps, self.warmup
        data_spec = self.suite["data"][st.get("data", "full")]
        if self.gpu:
            capacity = self.device["total_bytes"] / GiB
        else:
            import psutil

            capacity = psutil.virtual_memory().total / GiB
        quantity = "peak_reserved_gib" if self.gpu else "peak_rss_gib"
        models = {}
        for layers in st["layers"]:
            _, fig = self.model_fig(st["model"], num_layers=layers)
            models[layers] = (fig, self.build_model(option, fig))
        vocab = full_fig["vocab_size"]
        data = self.data_file(data_spec, vocab, hi, steps)
        probes: list[dict] = []
        plan_cache: dict[int, dict | None] = {}

        def probe(seq: int) -> bool:
            pts, notes = {}, []
            for layers, (fig, path) in models.items():
                e = self.measure_stack(
                    f"{key}-probe-L{layers}-s{seq}",
                    [
                        *self.model_overrides(option, fig, path),
                        f"data.path={data}",
                        f"trainer.seq_len={seq}",
                        *st.get("overrides", []),
                    ],
                    steps=steps,
                    warmup=warmup,
                    repeats=1,
                    record=False,
                )
                o = e.get("ours", {})
                if o.get("status") != "ok" or o.get("note"):
                    notes.append(f"L{layers}: {o.get('error') or o.get('note')}"[:200])
                else:
                    pts[layers] = o.get(quantity)
                    plan_cache[seq] = e.get("plan")
            if notes or len(pts) < 2:
                probes.append({"seq_len": seq, "fits": False, "note": "; ".join(notes) or "too few points"})
                return False
            ex = B.extrapolate_layers(pts, target)
            ctx = (plan_cache.get(seq) or {}).get("cuda_context_gib", 0.0) if self.gpu else 0.0
            need = ex["at_target"] + ctx
            ok = need <= capacity
            probes.append(
                {
                    "seq_len": seq,
                    "fits": ok,
                    "peak_gib": need,
                    "points": ex["points"],
                    "note": f"{quantity} extrapolated to {target} layers"
                    f"{' + CUDA context ' + format(ctx, '.2f') + ' GiB' if ctx else ''}"
                    f" vs {capacity:.1f} GiB",
                }
            )
            print(f"[bench] seq {seq}: need {need:.2f} GiB of {capacity:.1f} -> {'fits' if ok else 'no'}", flush=True)
            return ok

        longest = search_longest(lo, hi, gran, probe, int(st.get("max_probes", 7)))
        planner_longest = self._planner_longest(option, target, lo, hi, gran, st)
        entry = {
            "name": f"{key}-{option}",
            "mode": f"extrapolated from layers {list(st['layers'])} to {target}",
            "capacity_gib": capacity,
            "longest_seq": longest,
            "planner_longest_seq": planner_longest,
            "probes": probes,
            "granularity": gran,
        }
        if st.get("verify_full") and longest:
            _, ffig = self.model_fig(st["model"], num_layers=self._full_layers())
            fpath = self.cache / "models" / f"{option}-L{ffig['num_layers']}-h{ffig['hidden_size']}-nf4"
            if (fpath / "bench-model.json").is_file():
                e = self.measure_stack(
                    f"{key}-verify-L{ffig['num_layers']}-s{longest}",
                    [
                        *self.model_overrides(option, ffig, fpath),
                        f"data.path={data}",
                        f"trainer.seq_len={longest}",
                        *st.get("overrides", []),
                    ],
                    steps=steps,
                    warmup=warmup,
                    repeats=1,
                )
                o = e.get("ours", {})
                ok = o.get("status") == "ok" and not o.get("note")
                entry["verified_full"] = ok
                probes.append(
                    {
                        "seq_len": longest,
                        "fits": ok,
                        "peak_gib": o.get(quantity),
                        "note": f"full {ffig['num_layers']}-layer pre-quantized model, measured"
                        f"{'' if ok else ': ' + str(o.get('error') or o.get('note'))[:160]}",
                    }
                )
            else:
                entry["verified_full"] = None
                probes.append({"seq_len": longest, "fits": None, "note": "full model not built (stage full)"})
        self._put("seq_search", entry)

    def _full_layers(self) -> int | None:
        return (self.suite.get("stages", {}).get("full", {}) or {}).get("num_layers")

    def _planner_longest(self, option: str, target: int, lo: int, hi: int, gran: int, st: dict) -> int | None:
        from qlora_recipes import memory

        _, tfig = self.model_fig(st["model"], num_layers=target)
        base = [f"model={option}", *B.figure_overrides(tfig), *st.get("overrides", [])]
        if not self.gpu:
            return None  # the planner's budget is a GPU's memory; on a CPU the search only exercises the path

        def fits(seq: int) -> bool:
            cfg = compose(self._child_overrides([*base, f"trainer.seq_len={seq}"], 3))
            return bool(memory.plan_stack(cfg, gpus=self.gpus_decl, ladder=False)["fits"])

        return search_longest(lo, hi, gran, fits, 64)

    def _selected(self, name: str) -> bool:
        return not self.args.only or any(fnmatch.fnmatch(name, pat) for pat in self.args.only.split(","))

    # -- the suite -------------------------------------------------------------------------------
    def run(self) -> None:
        print(
            f"[bench] suite {self.suite['name']} on {self.device['name']}; load average {B.load_average()}; "
            f"work dir {self.work}",
            flush=True,
        )
        self.save()
        for s in expand_stacks(self.suite.get("stacks", [])):
            if self._selected(s["name"]):
                self.measure_stack(
                    s["name"],
                    list(s.get("overrides", [])),
                    baseline=s.get("baseline", False),
                    repeats=s.get("repeats"),
                    requires=tuple(s.get("requires", ())),
                )
        for t in self.suite.get("timings", []):
            if self._selected(t["name"]):
                self.timing(t)
        stages = self.suite.get("stages", {})
        wanted = self.args.stages.split(",") if self.args.stages else list(stages)
        unknown = [w for w in wanted if w not in stages]
        if unknown:
            raise SystemExit(
                f"error: no stage {unknown[0]!r} in suite {self.suite['name']}; choose from: {', '.join(stages)}"
            )
        steps, warmup = self.steps, self.warmup
        for key in wanted:
            st = stages[key]
            started = time.time()
            # a stage may run fewer steps (the 80-layer model, the sequence probes); --steps wins
            self.steps = self.args.steps or st.get("steps", steps)
            self.warmup = st.get("warmup_steps", warmup)
            print(f"[bench] stage {key} ({st['kind']})", flush=True)
            try:
                getattr(self, "stage_" + st["kind"])(key, st)
            except RuntimeError as err:
                print(f"[bench] stage {key} failed: {err}", flush=True)
                self.res.setdefault("errors", []).append({"stage": key, "error": str(err)})
            print(f"[bench] stage {key} took {time.time() - started:.0f} s", flush=True)
        self.finish()


def search_longest(lo: int, hi: int, gran: int, fits, max_probes: int) -> int | None:
    """Largest multiple of `gran` in [lo, hi] with fits(x) (monotone: true up to some x), in at most
    max_probes calls of `fits`; None when lo does not fit. With probes left over it is exact."""
    grid = list(range(lo, hi + 1, gran)) or [lo]
    if not fits(grid[0]):
        return None
    good, bad, probes = 0, len(grid), 1
    while bad - good > 1 and probes < max_probes:
        mid = (good + bad) // 2
        probes += 1
        if fits(grid[mid]):
            good = mid
        else:
            bad = mid
    return grid[good]


# ---------------------------------------------------------------------------------------------
# Goals (the claims of the README, checked against the results)
# ---------------------------------------------------------------------------------------------
def _stack(res: dict, name: str) -> dict:
    return next((s for s in res.get("stacks", []) if s.get("name") == name), {})


def _planner_goal(res: dict) -> dict:
    errs = []
    for s in res.get("stacks", []):
        for side, e in (s.get("plan_error_pct") or {}).items():
            if e.get("headline") is not None:
                errs.append((abs(e["headline"]), f"{s['name']} ({side})"))
    if not errs:
        return {
            "claim": "planner within 10 % of the measured peak, every stack",
            "target": "≤ 10 %",
            "measured": "–",
            "pass": None,
        }
    worst = max(errs)
    within = sum(1 for e, _ in errs if e <= 10)
    return {
        "claim": "planner within 10 % of the measured peak, every stack",
        "target": "≤ 10 %",
        "measured": f"{within} of {len(errs)} within; worst {worst[0]:.1f} % ({worst[1]})",
        "pass": within == len(errs),
    }


def goals_cpu(res: dict, suite: dict) -> list[dict]:
    goals = []
    d = _stack(res, "default")
    r = d.get("ratios") or {}
    for key, label in (
        ("wall_s", "wall time"),
        ("cpu_s", "CPU time of the process"),
        ("s_per_step", "seconds/step after warm-up"),
        ("train_s", "training time"),
    ):
        v = r.get(key)
        goals.append(
            {
                "claim": f"train.py no more than 5 % slower than the baseline ({label}, default stack)",
                "target": "ratio ≤ 1.05",
                "measured": "–" if v is None else f"{v:.3f}",
                "pass": None if v is None else v <= 1.05,
            }
        )
    v = r.get("peak_gib")
    goals.append(
        {
            "claim": "the recipe layer costs no memory (peak RSS, default stack)",
            "target": "ratio ≤ 1.05",
            "measured": "–" if v is None else f"{v:.3f}",
            "pass": None if v is None else v <= 1.05,
        }
    )
    for t in res.get("timings", []):
        goals.append(
            {
                "claim": f"{t['name']}: `{t.get('command')}`, whole process",
                "target": f"< {t.get('goal_s')} s",
                "measured": "–" if t.get("median_s") is None else f"{t['median_s']:.2f} s",
                "pass": t.get("pass"),
            }
        )
    matrix = [s for s in res.get("stacks", []) if s.get("name") != "default" and s.get("ours")]
    if matrix:
        ok = [s["name"] for s in matrix if s["ours"].get("status") == "ok"]
        bad = [s["name"] for s in matrix if s["ours"].get("status") != "ok"]
        goals.append(
            {
                "claim": "every quant × optim pair trains (ours)",
                "target": f"{len(matrix)} of {len(matrix)}",
                "measured": f"{len(ok)} of {len(matrix)}" + (f"; failed: {', '.join(bad)}" if bad else ""),
                "pass": not bad,
            }
        )
    goals.append(_planner_goal(res))
    return goals


def goals_gpu(res: dict, suite: dict) -> list[dict]:
    goals = []
    s8 = _stack(res, "8b-nf4-paged8bit-ckpt").get("ours") or {}
    v = s8.get("peak_allocated_gib") or s8.get("peak_gib")
    goals.append(
        {
            "claim": "8B (Llama-3.1-8B shape), seq 2048, bs 1, NF4 + paged8bit + checkpointing: peak",
            "target": "≤ 7.0 GiB",
            "measured": "–"
            if v is None
            else f"{v:.2f} GiB allocated, {B._f(s8.get('peak_reserved_gib'), 2)} GiB reserved"
            if s8.get("peak_allocated_gib") is not None
            else f"{v:.2f} GiB peak RSS",
            "pass": None if v is None else v <= 7.0,
        }
    )
    base = (_stack(res, "8b-mixed").get("baseline") or {}).get("tokens_per_s_steady")
    best, best_name = None, None
    for s in res.get("stacks", []):
        if s.get("name", "").startswith("8b-mixed") and (s.get("ours") or {}).get("status") == "ok":
            t = s["ours"].get("tokens_per_s_steady")
            if t and (best is None or t > best):
                best, best_name = t, s["name"]
    r = B.ratio(best, base)
    goals.append(
        {
            "claim": "8B tokens/s, our fastest option vs the baseline (mixed-length data, steady state)",
            "target": "≥ 1.8×",
            "measured": "–" if r is None else f"{r:.2f}× ({best_name})",
            "pass": None if r is None else r >= 1.8,
        }
    )
    for sec in res.get("slope", []):
        q = next(
            (
                f
                for f in sec.get("fits", [])
                if f.get("quantity") in ("peak_reserved_gib", "peak_rss_gib") and "at_target" in f
            ),
            None,
        )
        if q:
            gb = q["at_target"] * GiB / 1e9
            goals.append(
                {
                    "claim": f"70B shape, {sec['target_layers']} layers (slope of layers {sec['layers']}), "
                    f"seq 2048, bs 1: {q['quantity']}",
                    "target": "≤ 44 GB",
                    "measured": f"{gb:.1f} GB ({q['at_target']:.2f} GiB; planner {B._f(q.get('planner'), 2)} "
                    f"GiB, {B._pct(q.get('planner_err_pct'))})",
                    "pass": gb <= 44,
                }
            )
    for s in res.get("stacks", []):
        if s.get("name", "").endswith("-prequantized") and (s.get("ours") or {}).get("status") == "ok":
            v = s["ours"].get("peak_reserved_gib") or s["ours"].get("peak_gib")
            if v is not None:
                goals.append(
                    {
                        "claim": f"{s['name']}: measured peak (GPU: max_memory_reserved), seq 2048, bs 1",
                        "target": "≤ 44 GB",
                        "measured": f"{v * GiB / 1e9:.1f} GB",
                        "pass": v * GiB / 1e9 <= 44,
                    }
                )
    for sec in res.get("seq_search", []):
        goals.append(
            {
                "claim": f"longest sequence the 70B shape trains at here ({sec['name']})",
                "target": "report",
                "measured": f"{sec.get('longest_seq')} (planner {sec.get('planner_longest_seq')})",
                "pass": None,
            }
        )
    goals.append(_planner_goal(res))
    return goals


GOALS = {"cpu": goals_cpu, "gpu": goals_gpu}


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
def build_main(spec: str, out: str, device: str) -> None:
    """Child process: write one random-weight model (keeps CUDA out of the harness process)."""
    s = json.loads(spec)
    started = time.time()
    B.build_random_model(s["figures"], Path(out), quantize=s.get("quantize"), device=device)
    print(f"built {out} in {time.time() - started:.1f} s")


def report_main(paths: list[str], no_readme: bool) -> None:
    for p in paths:
        path = Path(p).resolve()
        res = json.loads(path.read_text())
        suite = {"name": res.get("suite"), "goals": "gpu" if res.get("device", {}).get("kind") == "cuda" else "cpu"}
        if res.get("suite") in ("cpu", "smoke", "gpu"):
            suite["goals"] = "gpu" if res["suite"] == "gpu" else "cpu"
        res["goals"] = GOALS[suite["goals"]](res, suite)
        md = B.render_markdown(res)
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")
        path.with_suffix(".md").write_text(md)
        shrink = any(r.get("shrink") for r in res.get("runs", []))
        if not no_readme and not shrink:
            B.update_readme(REPO / "bench" / "README.md", res, md, os.path.relpath(path, REPO / "bench"))
        print(md)


def _stop(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # run_child then kills the child it is waiting on


def main(argv: list[str] | None = None) -> None:
    import signal

    signal.signal(signal.SIGTERM, _stop)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_build"]:
        build_main(*argv[1:4])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="python scripts/bench.py SUITE [options]")
    p.add_argument("suite", help="cpu, gpu, smoke, a suite .yaml, or `report FILE.json ...`")
    p.add_argument("files", nargs="*", help="for report: results JSON files")
    p.add_argument("--stages", help="GPU suite: comma-separated stages (default: all, in order)")
    p.add_argument("--shrink", action="store_true", help="small shapes on the CPU (the GPU suite's code path)")
    p.add_argument("--repeats", type=int, help="ours/baseline pairs per stack")
    p.add_argument("--steps", type=int, help="optimizer steps per training run")
    p.add_argument("--only", help="comma-separated globs of stack/timing names to run")
    p.add_argument("--results-dir", help="where results go (default bench/results)")
    p.add_argument("--work-dir", help="run dirs and logs (default runs/bench/<suite>-<time>)")
    p.add_argument("--cache", help="random-weight models and synthetic data")
    p.add_argument("--timeout", type=float, help="seconds per child process")
    p.add_argument("--no-readme", action="store_true", help="do not update bench/README.md")
    p.add_argument("--resume", action="store_true", help="keep what today's results file already has; measure the rest")
    args = p.parse_args(argv)
    if args.suite == "report":
        report_main(args.files, args.no_readme)
        return
    Bench(load_suite(args.suite, args.shrink), args).run()


if __name__ == "__main__":
    main()
