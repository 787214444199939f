"""Step time of trainer.gradient_checkpointing=auto against every layer checkpointed, on this CPU.

    python -m bench.checkpointing_auto [--pairs 2] [--steps 6]

The tiny default at 256 tokens x 64 rows a micro-batch, trained by train.py in a process of its own,
alternately (ABAB): `trainer.gradient_checkpointing=true`, then `auto` under the host-RAM budget between
the plans of one layer checkpointed and none (hardware.host_ram_gib; it resolves to the first layer
of two, as tests/e2e/test_checkpointing_auto_trains_within_its_plan.py checks). Each run's train
seconds per step (metrics.json train_s / steps), measured peak and plan; medians per arm.
Writes bench/results/checkpointing-auto-<machine>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import HERE, REPO

STACK = [
    "trainer=smoke",
    "data.metric=null",
    "trainer.seq_len=256",
    "trainer.micro_batch_size=64",
    "trainer.grad_accum=1",
    "data.eval_fraction=0",
]


def budget_gib() -> float:
    from qlora_recipes import planner
    from qlora_recipes.config.loader import load

    def peak(gc: str) -> int:
        return planner.plan(load([*STACK, f"trainer.gradient_checkpointing={gc}"]), ladder=False)["devices"][0]["peak"]

    return (peak("1") + peak("false")) / 2 / 2**30


def run(arm: list[str], steps: int, where: Path) -> dict:
    cmd = [sys.executable, str(REPO / "train.py"), *STACK, *arm, f"trainer.max_steps={steps}", f"hydra.run.dir={where}"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    m = json.loads((where / "metrics.json").read_text())
    saved = (where / "config.yaml").read_text()
    resolved = next(ln.split(":", 1)[1].strip() for ln in saved.splitlines() if "gradient_checkpointing:" in ln)
    return {
        "s_per_step": m["train_s"] / m["steps"],
        "peak_gib": m["peak_mem_gib"],
        "planned_gib": m["planned_peak_gib"],
        "checkpointing": resolved,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.checkpointing_auto")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    from bench.machine import describe_device, load_average

    budget = budget_gib()
    arms = {"true": ["trainer.gradient_checkpointing=true"],
            "auto": ["trainer.gradient_checkpointing=auto", f"hardware.host_ram_gib={budget:.4f}"]}  # fmt: skip
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name, arm in arms.items():
                runs[name].append(run(arm, args.steps, Path(tmp) / f"{name}{i}"))
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("s_per_step", "peak_gib", "planned_gib")}
        for k, v in runs.items()
    }
    device, date = describe_device(force_cpu=True), _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    machine = device["name"]
    command = f"python -m bench.checkpointing_auto --pairs {args.pairs} --steps {args.steps}"
    out = {"command": command, "date": date, "machine": machine, "load_average": load_average(),
           "budget_gib": round(budget, 4), "runs": runs, "medians": med}  # fmt: skip
    stem = HERE / "results" / f"checkpointing-auto-{device['slug']}-{date}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# trainer.gradient_checkpointing=auto vs true — {machine}, {date}", "",
             f"Command: `{command}`. The tiny default, 256 tokens x 64 rows a micro-batch, {args.steps} steps a run, "
             f"ABAB, {args.pairs} pair(s), load average {out['load_average']} (a CPU shared with other jobs); auto under hardware.host_ram_gib={budget:.4f} (resolves to the first layer of 2).", "",
             "| arm | checkpointing | s/step (median) | measured GiB | planned GiB | measured/planned |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for k, m in med.items():
        lines.append(f"| {k} | {runs[k][0]['checkpointing']} | {m['s_per_step']:.2f} | {m['peak_gib']:.3f} | "
                     f"{m['planned_gib']:.3f} | {m['peak_gib'] / m['planned_gib']:.3f} |")  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
