"""Sweep summary: one row per multirun job, written into the sweep dir when the sweep ends.

Attached as a Hydra callback in conf/train.yaml; also run by scripts/summarize_sweep.py.
"""

import csv
import json
import logging
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

COLUMNS = ("job", "overrides", "status", "train_loss_last", "eval_loss", "eval_exact_match",
           "peak_mem_gib", "planned_peak_gib", "tokens_per_s", "wall_s", "error")


def collect(sweep_dir: Path) -> list[dict]:
    """Rows for every job dir (one holding .hydra/overrides.yaml) below sweep_dir, by job number."""
    rows = []
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):
        job_dir = overrides_file.parent.parent
        metrics_file = job_dir / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {"status": "incomplete"}
        row = {"job": job_dir.name, "overrides": " ".join(OmegaConf.load(overrides_file)),
               "status": metrics.get("status", "ok")}
        row.update({k: metrics.get(k) for k in COLUMNS if k not in row})
        rows.append(row)
    return sorted(rows, key=lambda r: (not r["job"].isdigit(), int(r["job"]) if r["job"].isdigit() else r["job"]))


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


def write_summary(sweep_dir: Path) -> list[dict]:
    rows = collect(sweep_dir)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    return rows


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_summary(sweep_dir)
        log.info("sweep summary: %d jobs -> %s", len(rows), sweep_dir / "summary.md")
