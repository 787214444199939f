"""The plan's time model (qlora_recipes/planner/timing.py) against every committed GPU measurement, and
the search that fitted its constants.

    python -m bench.time_fit            # each row: measured vs predicted s/step
    python -m bench.time_fit --search   # also the grid search over the fitted constants

Rows: every run (ours and the baseline) of every stack in the GPU suite's file (steady s/step: the
steps after the warm-up), and every row of the long-context file, whose tokens/s are over all of a
run's steps, warm-up included: those are compared with `steps x s/step + WARMUP_SECONDS`. Each row's
stack is the file's own overrides, planned here for an H100 (the model's figures from conf/model:
the bench model dir is not on this machine).

Checked, not fitted: every run of a later card's file (CHECKED: the H200's gpu-check), planned for that
card as `qlora plan --gpus NAME` plans it (auto checkpointing and micro-batch resolved), with the
defaults its runs had and its overrides do not name (a stack's `as_run`). Those rows test the model's
assumption that another card's time scales by its datasheet figures; they set no constant.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
SUITE_FILE = RESULTS / "nvidia-h100-80gb-hbm3-2026-11-26.json"
LONG_FILE = RESULTS / "long-context-nvidia-h100-80gb-hbm3-2026-11-26.md"
GPU = "H100"
CHECKED = {RESULTS / "nvidia-h200-2026-11-28-gpu-check.json": "H200"}
_PATHS = ("model.name_or_path=", "data.path=")  # the bench machine's files; the figures come from conf/model
# What the runs had by default and the files do not name: sdpa, model.attn_implementation's default at the
# commit they record (environment.git)
AS_RUN = ["model.attn_implementation=sdpa"]


def suite_rows(path: Path = SUITE_FILE) -> list[dict]:
    """One row per measured run of every stack: its overrides and steady s/step."""
    data = json.loads(path.read_text())
    job = list(data["settings"]["job"])
    rows = []
    for stack in data["stacks"]:
        overrides = job + [o for o in stack["overrides"] if not o.startswith(_PATHS)] + AS_RUN
        for run in ("ours", "baseline"):
            measured = (stack.get(run) or {}).get("s_per_step")
            if measured:
                rows.append({"name": f"{stack['name']} ({run})", "overrides": overrides, "s_per_step": measured})
    return rows


def long_context_rows(path: Path = LONG_FILE, suite: Path = SUITE_FILE) -> list[dict]:
    """One row per line of the long-context table: tokens/s over `steps` steps, warm-up included."""
    text = path.read_text()
    lean = re.search(r'"lean" adds\s+`([^`]+)`', text).group(1).split()
    steps = int(re.search(r"trainer\.max_steps=(\d+)", text).group(1))
    first = json.loads(suite.read_text())["stacks"][0]  # the same model figures and job as the suite
    base = json.loads(suite.read_text())["settings"]["job"] + [
        o for o in first["overrides"] if not o.startswith(_PATHS)
    ]
    base += AS_RUN
    rows = []
    for m in re.finditer(r"^\| ([\d,]+) \| (plain|lean) \|[^|]*\|[^|]*\|[^|]*\| ([\d,]+) \|$", text, re.M):
        seq, stack, tps = int(m.group(1).replace(",", "")), m.group(2), float(m.group(3).replace(",", ""))
        overrides = [o for o in base if not o.startswith("trainer.seq_len=")] + [f"trainer.seq_len={seq}"]
        overrides += lean if stack == "lean" else []
        rows.append({"name": f"{seq} {stack}", "overrides": overrides, "tokens_per_s": tps, "steps": steps})
    return rows


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from qlora_recipes.config.loader import register_schemas, to_typed
    from qlora_recipes.resources import CONF_DIR

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_typed(hydra_compose(config_name="train", overrides=list(overrides)))


def spec_of(overrides: list[str]):
    """The planner's StackSpec of these overrides, for one H100 (what the bench child ran)."""
    from qlora_recipes.config.loader import precision_for
    from qlora_recipes.planner.loss import with_metric
    from qlora_recipes.planner.spec import spec_from_cfg

    # the committed runs trained float32 adapters, the default before peft.adapter_dtype=auto
    cfg = precision_for(compose(["peft.adapter_dtype=float32", *overrides]), [80 * 2**30])
    return with_metric(spec_from_cfg(cfg, 1), cfg.data)


def predictions(rows_suite: list[dict], rows_long: list[dict]) -> list[tuple[str, float, float]]:
    """(row, measured, predicted) for every row: s/step, or for a long-context row tokens/s."""
    from qlora_recipes.config.gpus import card
    from qlora_recipes.planner import timing

    gpu, out = card(GPU), []
    for row in rows_suite:
        out.append((row["name"], row["s_per_step"], timing.step_seconds(row["spec"], gpu)["s_per_step"]))
    for row in rows_long:
        st = row["spec"]
        per_step = timing.step_seconds(st, gpu)["s_per_step"]
        tokens = row["steps"] * st.micro_batch * st.seq_len
        out.append((row["name"], row["tokens_per_s"], tokens / timing.wall_seconds(per_step, row["steps"])))
    return out


def all_rows() -> tuple[list[dict], list[dict]]:
    suite, long = suite_rows(), long_context_rows()
    for row in suite + long:
        row["spec"] = spec_of(row["overrides"])
    return suite, long


def checked_rows(path: Path, gpu: str) -> list[dict]:
    """One row per measured run of every stack of a later card's file: its overrides and steady s/step."""
    data = json.loads(path.read_text())
    job = list(data["settings"]["job"])
    rows = []
    for stack in data["stacks"]:
        overrides = job + stack.get("as_run", []) + [o for o in stack["overrides"] if not o.startswith(_PATHS)]
        if not any(o.startswith("model.attn_implementation=") for o in overrides):
            overrides += AS_RUN
        for run in ("ours", "baseline"):
            measured = (stack.get(run) or {}).get("s_per_step")
            if measured:
                name = f"{stack['name']} ({run})"
                rows.append({"name": name, "overrides": overrides, "s_per_step": measured, "gpu": gpu})
    return rows


def checked_predictions(rows: list[dict]) -> list[tuple[str, str, float, float]]:
    """(card, row, measured, predicted s/step): the plan's own time section on that card."""
    from qlora_recipes import planner
    from qlora_recipes.config import devices, gpus
    from qlora_recipes.config.loader import precision_for
    from qlora_recipes.planner import timeplan

    out = []
    for row in rows:
        sizes = devices.parse_gpus(row["gpu"])
        cfg = precision_for(compose(row["overrides"]), sizes)
        plan = planner.plan(cfg, gpus=sizes, host_ram=256 * 2**30)
        section = timeplan.time_section(cfg, plan, [gpus.card(row["gpu"])], sizes)
        out.append((row["gpu"], row["name"], row["s_per_step"], section["s_per_step"]))
    return out


def all_checked_rows() -> list[dict]:
    return [row for path, gpu in CHECKED.items() for row in checked_rows(path, gpu)]


SEARCH = {
    "MATMUL_EFFICIENCY": [0.6, 0.65, 0.7, 0.75],
    "OP_SECONDS": [80e-6, 90e-6, 100e-6, 110e-6, 120e-6],
    "ATTENTION_EFFICIENCY": [0.35, 0.4, 0.45, 0.5],
    "PACKED_ATTENTION_EFFICIENCY": [0.015, 0.02, 0.025],
    "ELEMENTWISE_TRAFFIC": [2.0, 3.0, 4.0, 5.0],
}


def search(suite: list[dict], long: list[dict]) -> dict:
    """The grid point with the smallest worst |log(predicted / measured)| over every row (to 0.1 %), ties
    broken by the smallest mean."""
    from qlora_recipes.planner import timing

    best, kept = None, {k: getattr(timing, k) for k in SEARCH}
    try:
        for values in itertools.product(*SEARCH.values()):
            for k, v in zip(SEARCH, values, strict=True):
                setattr(timing, k, v)
            errors = [abs(math.log(p / m)) for _, m, p in predictions(suite, long)]
            key = (round(max(errors), 3), sum(errors) / len(errors))
            if best is None or key < best[0]:
                best = (key, dict(zip(SEARCH, values, strict=True)))
    finally:
        for k, v in kept.items():
            setattr(timing, k, v)
    return {"worst_error_pct": round(100 * (math.exp(best[0][0]) - 1), 1), **best[1]}


def warmup_seconds(path: Path = SUITE_FILE) -> float:
    """The median over the suite's runs of train seconds - steps x steady s/step: trainer construction
    and the first steps' extra time."""
    data = json.loads(path.read_text())
    extra = sorted(
        run["train_s"] - run["steps"] * run["s_per_step"]
        for stack in data["stacks"]
        for side in ("ours", "baseline")
        for run in (stack.get(side) or {}).get("runs", [])
        if run.get("s_per_step")
    )
    mid = len(extra) // 2
    return extra[mid] if len(extra) % 2 else (extra[mid - 1] + extra[mid]) / 2


def markdown_rows(preds: list[tuple[str, float, float]]) -> list[str]:
    """The table docs/memory-and-planner.md shows (its test holds the page to these lines)."""
    out = []
    for name, m, pred in preds:
        what, fmt = ("s/step", "{:.3f}") if "(" in name else ("tokens/s, warm-up included", "{:,.0f}")
        out.append(f"| {name} | {what} | {fmt.format(m)} | {fmt.format(pred)} | {100 * (pred / m - 1):+.1f} % |")
    return out


def checked_markdown_rows(preds: list[tuple[str, str, float, float]]) -> list[str]:
    """The checked cards' table docs/memory-and-planner.md shows."""
    return [
        f"| {gpu} | {name} | {m:.3f} | {pred:.3f} | {100 * (pred / m - 1):+.1f} % |" for gpu, name, m, pred in preds
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.time_fit", description=__doc__.splitlines()[0])
    p.add_argument("--search", action="store_true", help="also grid-search the fitted constants")
    p.add_argument("--markdown", action="store_true", help="print the rows as docs/memory-and-planner.md's table")
    args = p.parse_args(argv)
    suite, long = all_rows()
    checked = checked_predictions(all_checked_rows())
    if args.markdown:
        print("\n".join(markdown_rows(predictions(suite, long))))
        print("\n".join(checked_markdown_rows(checked)))
        return
    print(f"{'row':<34}{'measured':>12}{'predicted':>12}{'error %':>9}")
    for name, m, pred in predictions(suite, long):
        unit = "s/step" if "(" in name else "tok/s"
        print(f"{name:<34}{m:>12.3f}{pred:>12.3f}{100 * (pred / m - 1):>+9.1f}  {unit}")
    print(f"warm-up seconds (median of the suite's runs): {warmup_seconds():.2f}")
    print(f"\nchecked, not fitted\n{'card':<6}{'row':<62}{'measured':>10}{'predicted':>11}{'error %':>9}")
    for gpu, name, m, pred in checked:
        print(f"{gpu:<6}{name:<62}{m:>10.3f}{pred:>11.3f}{100 * (pred / m - 1):>+9.1f}  s/step")
    if args.search:
        print("search:", json.dumps(search(suite, long)))


if __name__ == "__main__":
    main()
