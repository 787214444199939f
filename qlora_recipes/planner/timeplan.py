"""plan.json's `time` and the lines `qlora plan` prints of it: the time model (timing.py) of the stack a
plan was made for, on the card `--gpus NAME` names, and with the run's step count (trainer.max_steps,
else trainer.epochs over a local data.path's rows) the expected wall time.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..config.gpus import Gpu, known_names
from ..config.loader import precision_for
from . import fastest, timing
from .seqlen import is_auto, with_seq_len
from .sharded import SHARDED
from .spec import spec_from_cfg

if TYPE_CHECKING:
    from ..config.schema import DataConfig, TrainConfig

NAME_A_GPU = f"time: name a GPU for a time estimate (--gpus H100, 2xA100-40GB; known: {known_names()})"


def time_section(cfg: TrainConfig, plan: dict, cards: list[Gpu | None], gpus: list[int]) -> dict:
    """The `time` of plan.json: {"omitted": why} where no time is estimated, else step_seconds' figures,
    the steps of the run and its wall time where they are known."""
    named = {c.name: c for c in cards if c is not None}
    if not named:
        return {"omitted": "name a GPU for a time estimate (--gpus H100)"}
    if len(named) > 1 or None in cards:
        return {"omitted": "the GPUs differ; name one card for all of them, e.g. --gpus 2xH100"}
    gpu = next(iter(named.values()))
    if cfg.objective.name == "grpo":
        return {"omitted": "objective=grpo: its generation is not in the time model", "gpu": gpu.name}
    cfg = _as_planned(cfg, plan)
    dist = plan.get("dist") or {}
    st = spec_from_cfg(precision_for(cfg, gpus), int(dist.get("world_size") or 1))
    host, disk = _offloaded_bytes(plan)
    out = timing.step_seconds(st, gpu, host, sharded=dist.get("strategy") in SHARDED, disk_bytes=disk)
    out["constants"] = timing.constants()
    steps, how = run_steps(cfg, st)
    if steps:
        out.update(steps=steps, steps_from=how, wall_s=timing.wall_seconds(out["s_per_step"], steps))
    else:
        out["wall_omitted"] = how
    return out


def _as_planned(cfg: TrainConfig, plan: dict) -> TrainConfig:
    """cfg with its `auto` values as the plan resolved them: trainer.seq_len's cap, and the checkpointed
    layers, micro-batch and grad_accum of trainer.gradient_checkpointing / micro_batch_size=auto."""
    if is_auto(cfg):
        cfg = with_seq_len(cfg, int(plan["seq_len_auto"]["cap"]))
    auto = plan.get("batch_auto")
    if auto:
        keys = ("trainer.gradient_checkpointing", "trainer.micro_batch_size", "trainer.grad_accum")
        cfg = fastest.with_batch(cfg, *(auto[k] for k in keys))
    return cfg


def _offloaded_bytes(plan: dict) -> tuple[int, int]:
    """(bytes in host RAM, bytes on disk) of the weights a device map offloads (onloaded for every pass)."""
    if len(plan.get("device_map") or {}) <= 1:
        return 0, 0
    host = (plan.get("components", {}).get("other_params") or {}).get("cpu", 0)
    return int(host), int((plan.get("counts") or {}).get("disk_read_bytes", 0))


def run_steps(cfg: TrainConfig, st) -> tuple[int | None, str]:
    """(optimizer steps of the run, where the figure comes from), or (None, why it is unknown)."""
    max_steps = int(cfg.trainer.max_steps or -1)
    if max_steps > 0:
        return max_steps, f"trainer.max_steps={max_steps}"
    rows = data_rows(cfg.data)
    if rows is None:
        return None, "a wall time needs trainer.max_steps or a local data.path to count rows in"
    ranks = max(1, st.world_size)
    batches = math.ceil(math.ceil(rows / ranks) / st.micro_batch)  # HF Trainer: per rank, then accumulated
    steps = math.ceil(float(cfg.trainer.epochs) * math.ceil(batches / st.grad_accum))
    packed = "; packing makes fewer, fuller rows: an upper bound" if cfg.data.packing else ""
    return steps, f"{rows:,} train rows x trainer.epochs={cfg.trainer.epochs:g}{packed}"


def data_rows(data: DataConfig) -> int | None:
    """Train rows of a local data file (without data.eval_path, less the held-out eval rows); None for
    a dir, a hub dataset or a file that cannot be counted."""
    path = Path(str(data.path or "")).expanduser()
    if not path.is_file():
        return None
    try:
        rows = _count_rows(path)
    except (OSError, ValueError, csv.Error):
        return None  # the run's own reading says what is wrong with the file
    if rows is None:
        return None
    fraction = float(data.eval_fraction or 0)
    if not data.eval_path and fraction > 0:
        held = max(1, round(rows * fraction))
        rows -= min(held, data.eval_max_rows) if data.eval_max_rows else held
    return max(rows, 0)


def _count_rows(path: Path) -> int | None:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    if suffix == ".json":
        rows = json.loads(path.read_text())
        return len(rows) if isinstance(rows, list) else None
    if suffix == ".csv":
        with path.open(newline="") as f:
            return max(0, sum(1 for _ in csv.reader(f)) - 1)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    return None


def time_lines(section: dict) -> list[str]:
    """What `qlora plan` prints of plan.json's time: one line, two with a wall time."""
    if "omitted" in section:
        return [NAME_A_GPU] if "name a GPU" in section["omitted"] else [f"time: not estimated ({section['omitted']})"]
    terms = section["terms_s"]
    top = ", ".join(f"{k.replace('_', ' ')} {terms[k]:.2f} s" for k in sorted(terms, key=lambda k: -terms[k])[:3])
    lines = [
        f"time on {section['gpu']}: {section['s_per_step']:.2f} s/step, {section['tokens_per_s']:,.0f} tokens/s "
        f"({top}; fitted on H100 runs, each within {100 * timing.TIME_TOLERANCE:.0f} %)"
    ]
    if "wall_s" in section:
        lines.append(
            f"wall time: {_duration(section['wall_s'])} for {section['steps']:,} steps ({section['steps_from']}; "
            "warm-up included, model loading and evaluation not)"
        )
    else:
        lines.append(f"wall time: not estimated ({section['wall_omitted']})")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
