"""A run dir that holds a run is continued or replaced on request, never overwritten silently.

A run dir holds a run once a training wrote its adapter/, a checkpoint or a metrics.json there
(finished, stopped by a signal, or crashed after a checkpoint). A new training there says which it
wants: resume=auto (or resume.checkpoint) continues that run, overwrite=true replaces it; anything
else is refused in one line (`refuse_silent_reuse`). `RunDirChanges` sets the earlier run aside when
the new one starts writing and drops it at the new run's first checkpoint; any failure before puts it
back, byte for byte (run/training.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from ..config.schema import TrainConfig
from ..console import shown_path
from ..errors import UserError
from ..integrations.trackers import IDS_FILE
from ..outputs.runfiles import MANIFEST
from .lock import LOCK

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
# What every run writes again at its start (a resume too): set aside, so a failed start restores them
REWRITTEN = ("config.yaml", "plan.json", MANIFEST, ".hydra")
ASIDE = ".replaced-run"  # in the run dir while a run replaces, or rewrites the files of, the run there


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


class RunDirChanges:
    """What this run writes into its run dir, undone when the run fails before it has anything to keep.

    `begin()` (right before config.yaml and plan.json are written) moves aside, into ASIDE, the files
    this run is about to replace: config.yaml, plan.json, manifest.json, .hydra/, and with
    overwrite=true every output of the run it replaces. `keep()` (the new run's first checkpoint, or its
    end) drops what was set aside. `undo()` (a failure before that) removes what this run added and puts
    back what was set aside, byte for byte: a refused or crashed replacement costs the old run nothing,
    and a fresh run dir refused while loading is left empty (the caller removes it)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, writes_hydra_files: bool = True):
        self.run_dir, self.aside = run_dir, run_dir / ASIDE
        # .hydra/ is this run's to set aside only where this run writes it with its own files (a
        # sweep job's was written at the job's start, for its summary, and stays)
        self.rewritten = tuple(n for n in REWRITTEN if writes_hydra_files or n != ".hydra")
        self.replacing = bool(cfg.overwrite) and held_run(run_dir) is not None
        self.before: set[str] | None = None  # the run dir's entries before this run wrote any
        self.training = False

    def begin(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.before = {p.name for p in self.run_dir.iterdir()}
        names = [*self.rewritten, *(RUN_OUTPUTS if self.replacing else ())]
        names += [p.name for p in self.run_dir.glob("metrics.rank*.json")] if self.replacing else []
        moving = [name for name in names if os.path.lexists(self.run_dir / name)]
        if moving:
            self.aside.mkdir()
            for name in moving:
                os.replace(self.run_dir / name, self.aside / name)
        if self.replacing:
            log.info(
                "overwrite=true: replacing the run in %s; it is kept aside (%s) until the new run saves its first "
                "checkpoint, and put back if the new run fails before",
                shown_path(self.run_dir),
                ", ".join(moving),
            )

    def started(self) -> None:
        """The trainer has started: a run that replaces nothing keeps what it writes from here (its NaN
        or OOM record says what happened), so only a replacement stays undoable, until keep()."""
        self.training = True
        if not self.replacing:
            self.keep()

    def keep(self) -> None:
        """The new run has something of its own to keep: what it replaces goes (the rank that
        set it aside removes it: another rank of the job has nothing of its own here)."""
        if self.before is not None and self.aside.is_dir():
            shutil.rmtree(self.aside)

    def undo(self) -> None:
        """The run failed: before training, everything it wrote goes; a replacement that saved no
        checkpoint yet gives the run dir back to the run it was replacing."""
        if self.before is None or (self.training and not self.aside.is_dir()):
            return
        for path in self.run_dir.iterdir():
            if path.name not in self.before and path.name not in (LOCK, ASIDE):
                _remove(path)
        restored = put_back(self.run_dir)
        if restored and self.training:  # a refusal before training says what was wrong; this is news
            log.warning(
                "overwrite=true: the new run failed before its first checkpoint; %s holds the run it was replacing "
                "again",
                shown_path(self.run_dir),
            )


def put_back(run_dir: Path) -> list[str]:
    """What an unfinished replacement set aside, back in place (over what that run wrote since)."""
    aside = run_dir / ASIDE
    if not aside.is_dir():
        return []
    names = sorted(p.name for p in aside.iterdir())
    for name in names:
        if os.path.lexists(run_dir / name):
            _remove(run_dir / name)
        os.replace(aside / name, run_dir / name)
    aside.rmdir()
    return names


def restore_interrupted_replacement(run_dir: Path) -> None:
    """A replacement killed before its first checkpoint (kill -9, a node lost) left the run it
    replaces aside: put it back before anything else looks at the run dir."""
    if (run_dir / ASIDE).is_dir():
        names = put_back(run_dir)
        log.warning(
            "%s: put back the run an interrupted overwrite=true was replacing (%s)",
            shown_path(run_dir),
            ", ".join(names),
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
