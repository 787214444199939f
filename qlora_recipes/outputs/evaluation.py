"""A finished run against its base on lm-evaluation-harness tasks, in this process.

    check_tasks(tasks, include_path) -> TaskManager     every task known, before a model loads
    evaluate_run(run_dir, tasks, include_path=None, limit=None, batch_size=8, progress=print) -> report
    write_report(report) -> path                        RUN_DIR/eval.json, atomically
    table(report) -> str                                base vs tuned (vs merged) as text

The tuned model is the run's stack as generate loads it (the 4-bit base + adapter); the base is the
same model with the adapter switched off (peft's `disable_adapter()`), so both see the same
quantized weights; a merged dir in RUN_DIR/merged is evaluated beside them. The run's own metric
(metrics.json: eval exact match before and after training, eval loss) joins the table.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UserError
from .rundir import is_merged_dir, resolve_dir, run_metrics

EVAL_FILE = "eval.json"
LM_EVAL_PIN = "lm-eval==0.4.13"  # requirements-extras.txt pins the same
# metrics.json figures shown beside the tasks: (name, figure before training, figure after)
RUN_FIGURES = (
    ("exact match", "eval_exact_match_before", "eval_exact_match"),
    ("eval loss", None, "eval_loss"),
)


def check_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(
            f"qlora eval runs lm-evaluation-harness, which is not installed: pip install {LM_EVAL_PIN} "
            "(or pip install -r requirements-extras.txt)"
        )


def check_tasks(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager with the user's task dir; every task named must be one it knows."""
    check_lm_eval()
    if not tasks:
        raise UserError("--tasks: name at least one lm-eval task, e.g. --tasks hellaswag,arc_easy")
    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise UserError(f"--include-path {include_path}: no such directory; pass the dir that holds your task YAMLs")
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(Path(include_path).expanduser()) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor in {include_path}" if include_path else " (a task of your own: --include-path DIR)"
        raise UserError(f"--tasks: {', '.join(unknown)}: no such lm-eval task among lm-eval's own{where}")
    return manager


def _scores(model, tokenizer, tasks: list[str], manager, limit: int | None, batch_size: int) -> dict:
    """{task: {metric: value}} of one model: lm-eval's figures, without their stderr entries."""
    from unittest import mock

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    # lm-eval's report of its environment (git describe, torch's collect_env: a dozen child processes)
    # is not part of ours; one such child was seen hanging before its exec, the eval with it
    with (
        mock.patch("lm_eval.evaluator.get_git_commit_hash", lambda: None),
        mock.patch("lm_eval.evaluator.add_env_info", lambda results: None),
        _quiet_output(),  # its progress bars and prints
    ):
        # no stderr (the report drops it): lm-eval bootstraps some metrics' stderr in a forked pool, which was
        # seen never to finish in a process already running torch's threads
        result = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, bootstrap_iters=0)
    out: dict[str, dict[str, float]] = {}
    for task, figures in result["results"].items():
        out[task] = {
            key.split(",")[0]: float(value)
            for key, value in figures.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            if "_stderr" not in key and key != "sample_len"
        }
    return out


@contextlib.contextmanager
def _quiet_output():
    """File descriptors 1 and 2 to /dev/null for the block (lm-eval prints its bootstrapping and bars
    there, children too); errors still raise."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def evaluate_run(
    run_dir: str | Path,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    progress: Callable[[str], None] = print,
) -> dict:
    """Base, tuned (and merged) on `tasks`: the report eval.json holds."""
    _, folder = resolve_dir(run_dir, allow_merged=False)  # bad input answers before anything loads
    manager = check_tasks(tasks, include_path)
    from .generation import load_for_generation

    models: dict[str, dict] = {}
    started = time.time()
    model, tokenizer, _ = load_for_generation(folder)
    for name, what in (("tuned", "base + adapter"), ("base", "adapter off")):
        progress(f"eval: {name} ({what}) on {', '.join(tasks)} ...")
        if name == "base":
            with model.disable_adapter():
                models[name] = _scores(model, tokenizer, tasks, manager, limit, batch_size)
        else:
            models[name] = _scores(model, tokenizer, tasks, manager, limit, batch_size)
    model = None
    merged = folder / "merged"
    if is_merged_dir(merged):
        progress(f"eval: merged ({merged}) on {', '.join(tasks)} ...")
        model, tokenizer, _ = load_for_generation(merged)
        models["merged"] = _scores(model, tokenizer, tasks, manager, limit, batch_size)
    return {
        "run_dir": str(folder),
        "lm_eval": _lm_eval_version(),
        "tasks": _by_task(models),
        "run_metric": _run_figures(run_metrics(folder)),
        "models": list(models),
        "limit": limit,
        "wall_s": round(time.time() - started, 1),
    }


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _by_task(models: dict[str, dict]) -> dict:
    """{task: {metric: {model: value}}} from {model: {task: {metric: value}}}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, tasks in models.items():
        for task, figures in tasks.items():
            for metric, value in figures.items():
                out.setdefault(task, {}).setdefault(metric, {})[name] = value
    return out


def _run_figures(metrics: dict) -> dict:
    """The run's own eval figures: base = before training, tuned = after (None where not recorded)."""
    out = {}
    for name, before, after in RUN_FIGURES:
        row = {"base": metrics.get(before) if before else None, "tuned": metrics.get(after)}
        if any(v is not None for v in row.values()):
            out[name] = row
    return out


def write_report(report: dict) -> Path:
    """eval.json in the run dir, written aside and renamed: never half a file."""
    path = Path(report["run_dir"]) / EVAL_FILE
    tmp = path.with_name(f"{EVAL_FILE}.partial")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one row per task metric, then the run's own figures."""
    columns = [m for m in ("base", "tuned", "merged") if m in report["models"]]
    rows = [
        [task, metric, *(_cell(values.get(m)) for m in columns)]
        for task, metrics in report["tasks"].items()
        for metric, values in metrics.items()
    ]
    rows += [
        ["run's eval", name, *(_cell(values.get(m)) for m in columns)] for name, values in report["run_metric"].items()
    ]
    return ["task", "metric", *columns], rows


def table(report: dict) -> str:
    header, rows = table_rows(report)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in [header, *rows]
    )
