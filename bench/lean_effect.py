"""The effect of the lean options on what is learned: the same run, same seed, with the frozen parts
upcast to fp32 (prepare_model_for_kbit_training, today's default) and kept in bf16
(precision.upcast_frozen=false), compared step by step.

    python -m bench.lean_effect            # the tiny default + a ~100 M-parameter random Llama, CPU

Writes bench/results/lean-effect-<device>-<date>.json and .md: each model's two loss curves, their
largest absolute and relative difference, and the final and eval losses. The ~100 M model has random
weights and trains on synthetic text over its vocabulary (no hub), so its curve says how far the two
numerics drift apart, not how well the model learns.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench import HERE
from bench.machine import describe_device, now_iso, today
from bench.models import build_random_model, figure_overrides, write_text_data

# ~100 M parameters: 49 M in embeddings + lm_head, 50 M in 8 decoder layers.
MID = {
    "hidden_size": 768,
    "num_layers": 8,
    "num_heads": 12,
    "num_kv_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "head_dim": 64,
}


def _cases(work: Path, steps: int) -> list[tuple[str, list[str]]]:
    model = build_random_model(MID, work / "mid-llama")
    data = write_text_data(work / "mid-text.jsonl", MID["vocab_size"], rows=4 * steps * 4, min_words=96, max_words=96)
    mid = [
        "model=llama2-7b",  # an option of the llama family; every figure is overridden below
        f"model.name_or_path={model}",
        *figure_overrides(MID),
        "model.max_position_embeddings=512",
        f"data.path={data}",
        "data.format=text",
        "data.eval_path=null",
        "data.eval_fraction=0.05",
        "data.metric=null",
        "trainer=smoke",
        f"trainer.max_steps={steps}",
        "trainer.micro_batch_size=4",
        "trainer.seq_len=128",
        "optim.lr=2e-4",
        "force=true",
    ]
    return [("tiny (default run)", []), ("llama ~100M (random weights, synthetic text)", mid)]


def _run(overrides: list[str], upcast: bool, run_dir: Path) -> dict:
    from qlora_recipes.config.loader import load
    from qlora_recipes.run.training import train

    m = train(load([*overrides, f"precision.upcast_frozen={str(upcast).lower()}"]), run_dir)
    # Losses and metrics only: memory is the planner suites' business, measured one process per run.
    return {k: m.get(k) for k in ("train_losses", "eval_loss", "eval_exact_match")}


def _compare(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)}


def _markdown(res: dict) -> str:
    lines = [
        f"# Lean options: frozen parts fp32 vs bf16 — {res['device']['name']}, {res['date']}",
        "",
        f"Command: `{res['command']}`. Same seed and data; only `precision.upcast_frozen` differs.",
        "",
        "| model | logged losses | final loss fp32 / bf16 | eval loss fp32 / bf16 | exact match fp32 / bf16 "
        "| loss diff max / mean |",
        "|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        up, lean = c["upcast_frozen=true"], c["upcast_frozen=false"]
        ev = f"{up['eval_loss']:.4f} / {lean['eval_loss']:.4f}" if up["eval_loss"] is not None else "-"
        em = "-" if up["eval_exact_match"] is None else f"{up['eval_exact_match']:.3f} / {lean['eval_exact_match']:.3f}"
        lines.append(
            f"| {c['model']} | {len(up['train_losses'])} | {up['train_losses'][-1]:.4f} / "
            f"{lean['train_losses'][-1]:.4f} | {ev} | {em} | {c['max_abs_diff']:.4f} / {c['mean_abs_diff']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lean_effect", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps of the ~100 M model (default 30)")
    p.add_argument("--results-dir", default=str(HERE / "results"))
    args = p.parse_args(argv)
    res = {
        "device": describe_device(),
        "date": today(),
        "started": now_iso(),
        "command": " ".join(["python -m bench.lean_effect", *(argv or sys.argv[1:])]),
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, overrides in _cases(work, args.steps):
            runs = {
                f"upcast_frozen={str(u).lower()}": _run(overrides, u, work / f"{name[:4]}-{u}") for u in (True, False)
            }
            curves = [r["train_losses"] for r in runs.values()]
            res["cases"].append({"model": name, "overrides": overrides, **runs, **_compare(*curves)})
    res["finished"] = now_iso()
    out = Path(args.results_dir) / f"lean-effect-{res['device']['slug']}-{res['date']}"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
