"""Stages: `init_from=<run dir>` starts this run's adapter from a finished run's (SFT -> DPO).

`check_init_from(cfg)` runs before anything is loaded or written: the dir must be a finished run
(its manifest, metrics.json status ok, adapter/), trained on this run's base, with the adapter
shape this run's peft group makes. A different shape is refused, not silently taken over: the
saved config.yaml then says what was trained, and the fix (the earlier run's peft keys) is one
copy-paste. model/loading.py loads the weights into the adapter it makes; the reference of a
dpo stage is the base with the adapter off unless objective.ref_adapter=true (run/lifecycle.py).
"""

from __future__ import annotations

from pathlib import Path

from ..config.schema import PeftConfig, TrainConfig
from ..errors import UserError
from ..outputs.rundir import load_run_config, resolve_dir, run_metrics, same_base
from ..outputs.runfiles import MANIFEST

# what the adapter's tensors and their scale are made of: equal in both stages, or the weights do not fit
SHAPE_KEYS = ("method", "r", "alpha", "target_modules", "experts", "expert_r", "modules_to_save")


def check_init_from(cfg: TrainConfig) -> dict | None:
    """None without init_from; else what metrics.json records of the earlier stage: {path, objective}."""
    if not cfg.init_from:
        return None
    raw = str(cfg.init_from)
    fix = "point init_from at a run dir that train.py finished (config.yaml, adapter/, manifest.json)"
    try:
        kind, run_dir = resolve_dir(raw, allow_merged=False)
    except UserError as err:
        raise UserError(f"init_from={raw}: {str(err).removeprefix(raw + ': ')}") from None
    status = run_metrics(run_dir).get("status")
    if not (run_dir / MANIFEST).is_file() or status != "ok":
        raise UserError(
            f"init_from={raw}: not a finished run (metrics.json status {status or 'missing'}, "
            f"{'no ' if not (run_dir / MANIFEST).is_file() else ''}{MANIFEST}); finish it with resume=auto, or {fix}"
        )
    earlier = load_run_config(run_dir)
    if not same_base(str(earlier.model.name_or_path), str(cfg.model.name_or_path)):
        raise UserError(
            f"init_from={raw} was trained on model.name_or_path={earlier.model.name_or_path} but this run loads "
            f"{cfg.model.name_or_path}; an adapter only fits its base: train on that base (model=...) or {fix}"
        )
    _check_shape(raw, earlier.peft, cfg.peft)
    return {"path": str(Path(run_dir).resolve()), "objective": earlier.objective.name}


def _check_shape(raw: str, earlier: PeftConfig, now: PeftConfig) -> None:
    differ = [key for key in SHAPE_KEYS if _value(getattr(earlier, key)) != _value(getattr(now, key))]
    if differ:
        had = ", ".join(f"peft.{k}={_value(getattr(earlier, k))}" for k in differ)
        has = ", ".join(f"peft.{k}={_value(getattr(now, k))}" for k in differ)
        overrides = " ".join(f"peft.{k}={_override(getattr(earlier, k))}" for k in differ)
        raise UserError(
            f"init_from={raw}: its adapter has {had}, this run's peft group makes {has}; the adapter continues "
            f"as it was trained: add {overrides}"
        )


def _value(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _override(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return "null" if value is None else str(value)
