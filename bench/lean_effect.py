"""The effect of the lean options on what is learned: the same run, same seed, with and without one
option, compared step by step. `upcast_frozen`: the frozen parts upcast to fp32
(prepare_model_for_kbit_training, today's default) or kept in bf16 (precision.upcast_frozen=false);
`tiled_mlp`: the MLP whole or over tiles of 64 tokens (trainer.tiled_mlp; small tiles, so both
models' micro-batches are tiled); `lean_rmsnorm`: the RMSNorms as transformers runs them or keeping
their 16-bit input (trainer.lean_rmsnorm); `adapter_dtype`: fp32 or bf16 adapters, in bf16 compute
(peft.adapter_dtype).

    python -m bench.lean_effect                      # the tiny default + a ~100 M-parameter random Llama, CPU
    python -m bench.lean_effect --option tiled_mlp   # the same two models, MLP untiled vs tiled

Writes bench/results/lean-effect-[<option>-]<device>-<date>.json and .md: each model's two loss curves, their
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


MID_NAME = "llama ~100M (random weights, synthetic text)"


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
    return [("tiny (default run)", []), (MID_NAME, mid)]


# option: (its key, the value of the usual run, the value of the lean run, extra overrides, title)
OPTIONS = {
    "upcast_frozen": ("precision.upcast_frozen", "true", "false", [], "frozen parts fp32 vs bf16"),
    "tiled_mlp": ("trainer.tiled_mlp", "false", "true", ["trainer.tiled_mlp_tile=64"], "MLP untiled vs tiled"),
    "lean_rmsnorm": ("trainer.lean_rmsnorm", "false", "true", [], "RMSNorm saving an fp32 copy vs its 16-bit input"),
    # compared in bf16 compute, where the QLoRA paper and TRL train bf16 adapters
    "adapter_dtype": ("peft.adapter_dtype", "float32", "bfloat16", ["precision=bf16"], "adapters fp32 vs bf16"),
}


def _run(overrides: list[str], setting: str, run_dir: Path) -> dict:
    from qlora_recipes.config.loader import load
    from qlora_recipes.run.training import train

    m = train(load([*overrides, setting]), run_dir)
    # Losses and metrics only: memory is the planner suites' business, measured one process per run.
    return {k: m.get(k) for k in ("train_losses", "eval_loss", "eval_exact_match")}


def _compare(a: list[float], b: list[float]) -> dict:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs)}


def _markdown(res: dict) -> str:
    key, usual, lean_value, _, title = OPTIONS[res.get("option", "upcast_frozen")]
    name = key.split(".")[-1]
    pair = "fp32 / bf16" if name == "upcast_frozen" else f"{usual} / {lean_value}"
    lines = [
        f"# Lean options: {title} — {res['device']['name']}, {res['date']}",
        "",
        f"Command: `{res['command']}`. Same seed and data; only `{key}` differs.",
        "",
        f"| model | logged losses | final loss {pair} | eval loss {pair} | exact match {pair} | loss diff max / mean |",
        "|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        up, lean = c[f"{name}={usual}"], c[f"{name}={lean_value}"]
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
    p.add_argument("--option", choices=tuple(OPTIONS), default="upcast_frozen", help="the lean option compared")
    p.add_argument("--mid-only", action="store_true", help="only the ~100 M model (the tiny default run is 150 steps)")
    args = p.parse_args(argv)
    key, usual, lean_value, extra, _ = OPTIONS[args.option]
    name = key.split(".")[-1]
    res = {
        "option": args.option,
        "device": describe_device(),
        "date": today(),
        "started": now_iso(),
        "command": " ".join(["python -m bench.lean_effect", *(argv or sys.argv[1:])]),
        "cases": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for case, overrides in _cases(work, args.steps):
            if args.mid_only and case != MID_NAME:
                continue
            runs = {
                f"{name}={v}": _run([*overrides, *extra], f"{key}={v}", work / f"{case[:4]}-{v}")
                for v in (usual, lean_value)
            }
            curves = [r["train_losses"] for r in runs.values()]
            res["cases"].append({"model": case, "overrides": overrides, **runs, **_compare(*curves)})
    res["finished"] = now_iso()
    prefix = "lean-effect-" + ("" if args.option == "upcast_frozen" else args.option.replace("_", "-") + "-")
    out = Path(args.results_dir) / f"{prefix}{res['device']['slug']}-{res['date']}"
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
