"""A run dir that holds a run is continued or replaced on request, never overwritten silently.

A run dir holds a run once a training wrote its adapter/, a checkpoint or a metrics.json there
(finished, stopped by a signal, or crashed after a checkpoint). A new training there says which it
wants: resume=auto (or resume.checkpoint) continues that run, overwrite=true replaces it; anything
else is refused in one line (`refuse_silent_reuse`). `clear_previous_run` removes what the earlier
run wrote, once every check of the replacing run has passed (run/training.py).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ..config.schema import TrainConfig
from ..console import shown_path
from ..errors import UserError
from ..integrations.trackers import IDS_FILE

log = logging.getLogger(__name__)
# What a training run (and a default merge) writes into its run dir beside config.yaml, plan.json, .hydra/
RUN_OUTPUTS = (
    "adapter",
    "adapter.partial",
    "checkpoints",
    "merged",
    "metrics.json",
    "oom.json",
    "memory.jsonl",
    "memory.png",
    "tb",
    IDS_FILE,
)


class HoldsARun(UserError):
    """A new run refused in a run dir holding a run: nothing of that run is touched."""


def held_run(run_dir: Path) -> tuple[str, list[str]] | None:
    """("finished" | "stopped", what marks it) when run_dir holds a run, else None. A metrics.json
    of a sweep job refused before training (status error / skipped) marks no run."""
    marks = []
    if (run_dir / "adapter").is_dir():
        marks.append("adapter/")
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*") if p.is_dir())
    if checkpoints:
        marks.append(f"checkpoints/{checkpoints[-1]}" if len(checkpoints) == 1 else f"{len(checkpoints)} checkpoints")
    status = _status(run_dir / "metrics.json")
    if status is not None and status not in ("error", "skipped"):
        marks.append("metrics.json")
    if not marks:
        return None
    return ("finished" if status == "ok" and "adapter/" in marks else "stopped"), marks


def _status(path: Path) -> str | None:
    """metrics.json's status (None: no file; "unreadable": a file that is no JSON object)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return "unreadable"
    return str(data.get("status")) if isinstance(data, dict) else "unreadable"


def refuse_silent_reuse(cfg: TrainConfig, run_dir: Path) -> None:
    """A run dir holding a run is only continued (resume=auto, resume.checkpoint) or replaced
    (overwrite=true); otherwise one line naming the dir and both ways out."""
    if cfg.overwrite or cfg.resume.auto or cfg.resume.checkpoint:
        return
    held = held_run(run_dir)
    if held is None:
        return
    kind, marks = held
    go_on = (
        "train it further with resume=auto and a larger trainer.max_steps or trainer.epochs"
        if kind == "finished"
        else "continue it with resume=auto"
    )
    raise HoldsARun(
        f"run dir {shown_path(run_dir)} already holds a {kind} run ({', '.join(marks)}): {go_on}, replace it with "
        "overwrite=true, or train in another hydra.run.dir"
    )


def clear_previous_run(cfg: TrainConfig, run_dir: Path) -> None:
    """overwrite=true: remove what the run held in run_dir wrote (its adapter, checkpoints, metrics,
    memory timeline, TensorBoard scalars, default merge output), so none of it mixes with the new run."""
    if not cfg.overwrite or held_run(run_dir) is None:
        return
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    for path in run_dir.glob("metrics.rank*.json"):
        path.unlink()
    log.warning("overwrite=true: replacing the run in %s (removed %s)", shown_path(run_dir), ", ".join(removed))
