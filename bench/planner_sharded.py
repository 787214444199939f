"""The planner's per-rank plan against each rank's measured peak RSS: 2-rank runs on CPU.

    python -m bench planner-sharded                     # ~30-40 min on a loaded 2-core machine
    python -m bench planner-sharded --only 'llama-1m/*' --resume

Every case is `torchrun --standalone --nproc_per_node 2 train.py dist=S ...` (gloo, the trainer's
DDP / FSDP2 / DeepSpeed path as tests/e2e/test_sharded_training_on_cpu_ranks.py runs it) of two optimizer steps on one of
bench/planner_cpu.py's locally built models (its builder, job overrides and shapes are reused
here): 1 M, 50 M and 300 M parameters, the last also at micro-batch 4 x 256 (SHAPES). Each rank records its own peak (peak.py: the kernel's RSS high-water mark from the run's
start, loading included) in metrics.json (rank 0) or metrics.rank{N}.json; the planned figure is
the cpu device's peak of `planner.plan(cfg, gpus=[], world_size=2)`, one rank's plan on CPU
(planner/sharded.py `plan_cpu_rank`). Results: bench/results/planner-sharded.json (+ .md), per case
and rank planned, measured and their ratio; the goal is every rank within 10 %.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import REPO
from bench.planner_cpu import build_model, job_overrides, planning_dir, shapes_for
from bench.planner_suite import TOLERANCE, collect, in_suite_order, parser, suite_start, worst_ratio
from bench.planner_suite import write_results as write_results_files

RESULTS = REPO / "bench" / "results" / "planner-sharded"
WORLD_SIZE = 2
MODELS = ("llama-1m", "llama-50m", "llama-300m")
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")
# (name, model, micro batch x seq_len): planner-cpu's default shape per model, and llama-300m once
# more with a micro-batch whose training step outgrows the load phase (at 2 x 128 every rank peaks
# while loading, the same for every strategy), so that the ranks' shares decide the peak.
SHAPES = [(m, m, shapes_for(m)["default"]) for m in MODELS] + [("llama-300m-4x256", "llama-300m", (4, 256))]


def cases() -> list[dict]:
    out = []
    for name, model, (b, s) in SHAPES:
        for strategy in STRATEGIES:
            overrides = [f"dist={strategy}", f"trainer.micro_batch_size={b}", f"trainer.seq_len={s}"]
            out.append({"name": f"{name}/{strategy}", "model": model, "strategy": strategy, "overrides": overrides})
    return out


def rank_metrics_files(run_dir: Path) -> list[Path]:
    """Rank 0's metrics.json, then metrics.rank1.json, ... (training.py writes one per rank)."""
    return [run_dir / ("metrics.json" if r == 0 else f"metrics.rank{r}.json") for r in range(WORLD_SIZE)]


def run_case(case: dict, model_dir: Path, work: Path, timeout: float) -> dict:
    from bench.planner_cpu import _wait

    run_dir = work / case["name"].replace("/", "--")
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(WORLD_SIZE),
        "train.py",
        *job_overrides(model_dir, run_dir),
        *case["overrides"],
    ]
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    started = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        rc = _wait(proc, timeout)
    return read_case(case, run_dir, rc, round(time.time() - started, 1))


def read_case(case: dict, run_dir: Path, rc: int, wall_s: float | None) -> dict:
    """A case's entry from its finished run dir: every rank's measured peak."""
    entry = {**case, "rc": rc, "wall_s": wall_s}
    files = rank_metrics_files(run_dir)
    if rc != 0 or not all(f.is_file() for f in files):
        entry["status"] = "failed"
        log = run_dir.with_suffix(".log")
        entry["log_tail"] = log.read_text(errors="replace").splitlines()[-5:] if log.is_file() else []
        return entry
    ranks = []
    for r, f in enumerate(files):
        m = json.loads(f.read_text())
        ranks.append({"rank": r, "measured_gib": round(m["peak_mem_gib"], 3), "peak_quantity": m["peak_quantity"]})
        if "sharding" in m:
            ranks[-1]["sharding"] = m["sharding"]
    plan = json.loads((run_dir / "plan.json").read_text())
    entry.update(status="ok", ranks=ranks, params_total=plan["counts"]["params_total"])
    return entry


def rank_plan(entry: dict, model_dir: Path) -> dict:
    """One rank's CPU plan of the case as the planner makes it now (the case's overrides composed
    again; no GPUs, WORLD_SIZE ranks)."""
    from qlora_recipes.config.loader import compose, to_typed
    from qlora_recipes.planner import plan

    overrides = [o for o in job_overrides(model_dir, Path("unused")) if not o.startswith("hydra.")]
    cfg = to_typed(compose([*overrides, *entry["overrides"]]))
    return plan(cfg, gpus=[], world_size=WORLD_SIZE, ladder=False)


def replan(entry: dict, model_dir: Path) -> None:
    """Scores every rank of a measured case against the planner as it is now."""
    from qlora_recipes.run.memory import planned_peak_gib

    planned_now = rank_plan(entry, model_dir)
    planned = planned_peak_gib(planned_now, gpu=False)
    cpu = next(d for d in planned_now["devices"] if d["device"] == "cpu")
    entry["planned_gib"] = round(planned, 3)
    entry["planned_phase"] = cpu["peak_phase"]
    for r in entry["ranks"]:
        r["ratio"] = round(r["measured_gib"] / planned, 4)
        r["within"] = abs(r["ratio"] - 1) <= TOLERANCE
    entry["within"] = all(r["within"] for r in entry["ranks"])


def write_results(path: Path, meta: dict, entries: list[dict]) -> None:
    ok = [e for e in entries if e.get("status") == "ok"]
    ranks = [r for e in ok for r in e["ranks"]]
    summary = {
        "cases": len(entries),
        "measured": len(ok),
        "ranks_measured": len(ranks),
        "ranks_within_10pct": sum(r["within"] for r in ranks),
        "worst_ratio": worst_ratio([r["ratio"] for r in ranks]),
    }
    notes = [
        "measured: each rank's own peak RSS (metrics.json / metrics.rank1.json `peak_mem_gib`, the kernel's"
        " high-water mark from the run's start); planned: the cpu-device peak of `planner.plan(cfg, gpus=[],"
        f" world_size={WORLD_SIZE})`; `torchrun --standalone --nproc_per_node {WORLD_SIZE} train.py`, gloo,"
        " two optimizer steps",
        f"{summary['ranks_within_10pct']} of {len(ranks)} measured ranks within 10 % ({len(entries)} cases)",
    ]
    table = [
        "| case | params | overrides | planned GiB | phase | rank 0 GiB | ratio | rank 1 GiB | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        ov = " ".join(e["overrides"])
        if e.get("status") != "ok":
            table.append(f"| {e['name']} | – | `{ov}` | – | – | failed (rc {e.get('rc')}) | – | – | – |")
            continue
        cells = " | ".join(f"{r['measured_gib']:.3f} | {r['ratio']:.3f}" for r in e["ranks"])
        table.append(
            f"| {e['name']} | {e['params_total'] / 1e6:.1f} M | `{ov}` | {e['planned_gib']:.3f} "
            f"| {e['planned_phase']} | {cells} |"
        )
    title = f"planner per rank vs each rank's CPU peak RSS, {WORLD_SIZE} ranks"
    write_results_files(path, meta, entries, summary, title, notes, table)


def main(argv: list[str], prog: str = "python -m bench planner-sharded") -> None:
    args = parser(prog, __doc__, RESULTS, "model/strategy").parse_args(argv)
    cache, work, todo, kept, meta = suite_start(args, prog, argv, "planner-sharded", cases(), world_size=WORLD_SIZE)
    results = Path(args.results)
    todo = [c for c in todo if not ((args.resume or args.replan) and kept.get(c["name"], {}).get("status") == "ok")]
    if args.collect:  # finished run dirs of a harness that was stopped
        finished = lambda d: all(f.is_file() for f in rank_metrics_files(d))  # noqa: E731
        kept.update(collect(todo, args.collect, finished, read_case))
    if args.replan or args.collect:
        todo = []
    for e in kept.values():  # re-scored by the planner as it is now
        if e.get("status") == "ok":
            replan(e, planning_dir(e["model"], cache))
    dirs = {m: build_model(m, cache) for m in dict.fromkeys(c["model"] for c in todo)}
    for case in todo:
        e = run_case(case, dirs[case["model"]], work, args.timeout)
        if e["status"] == "ok":
            replan(e, dirs[case["model"]])
        measured = [r["measured_gib"] for r in e.get("ranks", [])]
        print(f"[planner-sharded] {e['name']}: planned {e.get('planned_gib')} GiB, measured {measured} GiB "
              f"({e['wall_s']} s)", flush=True)  # fmt: skip
        kept[e["name"]] = e
        _write(results, meta, kept)
    _write(results, meta, kept)


def _write(results: Path, meta: dict, kept: dict[str, dict]) -> None:
    write_results(results, meta, in_suite_order(kept, cases()))
