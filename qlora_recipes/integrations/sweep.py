"""Sweep summary: one row per multirun job, written into the sweep dir when the sweep ends.

Attached as a Hydra callback in conf/train.yaml (SweepSummary); also run by
scripts/summarize_sweep.py. Writes summary.csv, summary.md (one table row per job) and
summary.png, each job labelled by what sets it apart (`labels`: the overrides whose value differs
between the jobs, `peft.r=8 optim.lr=0.0002`, not its job number): final loss (eval loss, else the
last training loss) against planned and measured peak memory (each job's own peak of the quantity
its plan predicts: metrics.json `peak_mem_gib` and `planned_peak_gib`, memory.py; the conf/sweep
presets run each job in a fresh process, so no job inherits another's memory) and against
tokens/s, with the Pareto front marked - the jobs no other job beats on lower loss, lower peak
memory and higher tokens/s at once. Jobs the planner skipped or that failed are listed with their
reason and planned peak, never dropped. A job refused because its dir already holds a run (the same
sweep dir again) keeps that run's metrics.json; its refusal is recorded in `.hydra/job_status.json`,
which the summary and the console report instead of the old run's status.
"""

import csv
import json
import logging
import math
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ..run import memory

log = logging.getLogger(__name__)

COLUMNS = (
    "job",
    "label",
    "overrides",
    "status",
    "train_loss_last",
    "eval_loss",
    "eval_exact_match",
    "peak_mem_gib",
    "planned_peak_gib",
    "plan_ratio",
    "peak_quantity",
    "tokens_per_s",
    "wall_s",
    "pareto",
    "error",
)


JOB_STATUS = ".hydra/job_status.json"  # this sweep's word on a job whose dir kept an earlier run


def record_refused(job_dir: Path, error: str) -> None:
    """A job refused without touching its dir's earlier run: said beside Hydra's files of this job."""
    path = Path(job_dir) / JOB_STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"status": "refused", "error": error}) + "\n")


def clear_job_status(job_dir: Path) -> None:
    """A job starts again: what an earlier sweep said of it no longer holds."""
    (Path(job_dir) / JOB_STATUS).unlink(missing_ok=True)


def _job_status(job_dir: Path) -> dict:
    try:
        return json.loads((job_dir / JOB_STATUS).read_text())
    except (OSError, ValueError):
        return {}


def _planned_peak(job_dir: Path) -> tuple[float | None, str | None]:
    """The planned peak and the quantity it predicts (memory.py: what a run measures on that device).
    plan.json is written before training starts, so skipped and failed jobs have one too."""
    path = job_dir / "plan.json"
    try:
        plan = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        plan = None
    if not plan:
        return None, None
    return memory.planned_peak_gib(plan), memory.quantity(memory.plan_on_gpu(plan))


def collect(sweep_dir: Path) -> list[dict]:
    """Rows for every job dir (one holding .hydra/overrides.yaml) below sweep_dir, by job number."""
    rows, overrides = [], {}
    for overrides_file in sorted(Path(sweep_dir).glob("*/.hydra/overrides.yaml")):
        job_dir = overrides_file.parent.parent
        metrics_file = job_dir / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {"status": "incomplete"}
        overrides[job_dir.name] = [str(o) for o in OmegaConf.load(overrides_file)]
        row = {
            "job": job_dir.name,
            "overrides": " ".join(overrides[job_dir.name]),
            "status": metrics.get("status", "ok"),
        }
        row.update({k: metrics.get(k) for k in COLUMNS if k not in row})
        row["error"] = metrics.get("error") or metrics.get("reason")
        if said := _job_status(job_dir):  # refused this time: the figures are the earlier run's
            row["status"], row["error"] = said.get("status", "refused"), said.get("error")
        if row["planned_peak_gib"] is None:  # a job that did not run: its plan's figure
            row["planned_peak_gib"], row["peak_quantity"] = _planned_peak(job_dir)
        rows.append(row)
    rows.sort(key=lambda r: (not r["job"].isdigit(), int(r["job"]) if r["job"].isdigit() else r["job"]))
    job_labels = labels(overrides)
    for row in rows:
        row["label"] = job_labels[row["job"]]
    mark_pareto(rows)
    return rows


def _short(value: str) -> str:
    """A sampled float as 3 significant digits (Optuna's 0.00044303752452182633 -> 0.000443)."""
    try:
        number = float(value)
    except ValueError:
        return value
    return value if number.is_integer() or len(value) <= 8 else f"{number:.3g}"


def labels(overrides: dict[str, list[str]]) -> dict[str, str]:
    """Each job's label: its overrides whose value is not the same in every job, in its own order.
    Hydra's own keys and `resume` (a requeued job adds resume=auto) set no job apart. A job with
    nothing apart (a one-job sweep, or a duplicate) is labelled by all its overrides, else `job N`."""

    def pairs(job: str) -> dict[str, str]:
        items = (o.split("=", 1) for o in overrides[job] if "=" in o)
        return {k: v for k, v in items if not k.lstrip("+~").startswith(("hydra.", "resume"))}

    by_job = {job: pairs(job) for job in overrides}
    keys = {k for p in by_job.values() for k in p}
    varying = {k for k in keys if len({p.get(k) for p in by_job.values()}) > 1}
    out = {}
    for job, p in by_job.items():
        apart = [f"{k}={_short(v)}" for k, v in p.items() if k in varying]
        out[job] = " ".join(apart or [f"{k}={_short(v)}" for k, v in p.items()]) or f"job {job}"
    return out


def _num(value) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(out) else out


def loss_of(row: dict) -> float | None:
    """The loss a job is judged by: its eval loss, else its last training loss."""
    return _num(row.get("eval_loss")) if _num(row.get("eval_loss")) is not None else _num(row.get("train_loss_last"))


def memory_of(row: dict) -> float | None:
    """Measured peak memory, else the planned memory."""
    measured = _num(row.get("peak_mem_gib"))
    return measured if measured is not None else _num(row.get("planned_peak_gib"))


def mark_pareto(rows: list[dict]) -> None:
    """Set row["pareto"] = True for the finished jobs that no other finished job dominates on
    (lower loss, lower peak memory, higher tokens/s); an objective no job reports is left out."""
    done = [r for r in rows if r["status"] == "ok" and loss_of(r) is not None]
    for r in rows:
        r["pareto"] = False
    objectives = [(loss_of, 1.0), (memory_of, 1.0), (lambda r: _num(r.get("tokens_per_s")), -1.0)]
    objectives = [(f, sign) for f, sign in objectives if any(f(r) is not None for r in done)]

    def key(r: dict) -> list[float]:  # every objective as "smaller is better"; missing = worst
        return [sign * f(r) if f(r) is not None else math.inf for f, sign in objectives]

    keys = {id(r): key(r) for r in done}
    for r in done:
        a = keys[id(r)]
        dominated = any(
            all(x <= y for x, y in zip(keys[id(o)], a, strict=True)) and keys[id(o)] != a for o in done if o is not r
        )
        r["pareto"] = not dominated


def _cell(value) -> str:
    if isinstance(value, bool):
        return "*" if value else ""
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


def write_plot(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """summary.png: loss vs peak memory (measured and planned) and loss vs tokens/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in requirements.txt
        log.warning("matplotlib is not installed: no summary.png")
        return None
    done = [r for r in rows if r["status"] == "ok" and loss_of(r) is not None]
    other = [r for r in rows if r not in done]
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in done:
        y, color = loss_of(r), "tab:red" if r["pareto"] else "tab:blue"
        measured, planned = _num(r.get("peak_mem_gib")), _num(r.get("planned_peak_gib"))
        if measured is not None and planned is not None:
            ax_mem.plot([planned, measured], [y, y], color="0.75", lw=1, zorder=1)
        if planned is not None:
            ax_mem.scatter([planned], [y], marker="s", facecolors="none", edgecolors=color, zorder=2)
        if measured is not None:
            ax_mem.scatter([measured], [y], marker="o", color=color, zorder=3)
        ax_mem.annotate(
            r["label"],
            (measured if measured is not None else planned or 0, y),
            fontsize=8,
            xytext=(3, 3),
            textcoords="offset points",
        )
        speed = _num(r.get("tokens_per_s"))
        if speed is not None:
            ax_speed.scatter(
                [speed], [y], marker="*" if r["pareto"] else "o", s=90 if r["pareto"] else 30, color=color, zorder=3
            )
            ax_speed.annotate(r["label"], (speed, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    if other:  # skipped / failed: their planned peak along the top edge
        top = max((loss_of(r) for r in done), default=1.0)
        for r in other:
            planned = _num(r.get("planned_peak_gib"))
            if planned is not None:
                ax_mem.scatter([planned], [top], marker="x", color="0.4", zorder=2)
                ax_mem.annotate(
                    f"{r['label']} {r['status']}",
                    (planned, top),
                    fontsize=7,
                    color="0.4",
                    xytext=(3, -10),
                    textcoords="offset points",
                )
    quantities = ", ".join(sorted({r["peak_quantity"] for r in rows if r.get("peak_quantity")})) or "peak memory"
    ax_mem.set_xlabel(f"{quantities}, GiB (o measured, [] planned, x planned but not run)")
    ax_mem.set_ylabel("final loss (eval, else last train)")
    ax_speed.set_xlabel("tokens/s")
    ax_speed.set_ylabel("final loss")
    for ax in (ax_mem, ax_speed):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}  (red: Pareto front - lower loss, lower memory, higher tokens/s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(sweep_dir: Path) -> list[dict]:
    """summary.csv, summary.md (a header, a rule and one row per job) and summary.png."""
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]).replace("|", "/") for c in COLUMNS) + " |" for r in rows]
    (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
    write_plot(rows, sweep_dir / "summary.png", title=str(sweep_dir))
    return rows


_STARTED: list[Path] = []  # the sweep dir of the multirun under way in this process


def started_sweep_dir() -> Path | None:
    """The sweep dir of the multirun this process started (Hydra makes it before its launcher runs)."""
    return _STARTED[-1] if _STARTED else None


def stopped_line(sweep_dir: Path, stopped: str, jobs_stopped: int = 0) -> str:
    """What a stop signal to a sweep kept and how to go on (`stopped`: "stopped by SIGINT (Ctrl-C)"):
    the finished jobs; an Optuna study resumes with the same command (the cut-off trial first,
    study.resume), other sweeps continue their stopped jobs with resume=auto. `jobs_stopped`: the
    local launcher's jobs this process stopped (cluster.stop_local_jobs), named by what they left."""
    rows = collect(sweep_dir) if sweep_dir.is_dir() else []
    kept = (
        f"{stopped} during the sweep in {sweep_dir}: {sum(row['status'] == 'ok' for row in rows)} finished job(s) kept"
    )
    if (sweep_dir / "optuna.db").is_file():
        return f"{kept}, the study in {sweep_dir / 'optuna.db'}; run the same command again to resume it (the cut-off trial is run anew)"
    if jobs_stopped:
        kept += "".join(_unfinished_jobs(sweep_dir, rows))
    return f"{kept}; continue with the same command plus resume=auto (finished jobs are skipped, stopped ones resume)"


def _unfinished_jobs(sweep_dir: Path, rows: list[dict]) -> list[str]:
    """The jobs without a result, by whether a sound checkpoint is there: ", job(s) 0 1 stopped at a
    checkpoint", ", job(s) 2 stopped with no checkpoint to resume from (run anew)"."""
    from ..run.checkpoints import CHECKPOINT, checkpoint_problem

    saved, unsaved = [], []
    for row in rows:
        if row["status"] not in ("incomplete", "preempted"):  # finished, or failed / skipped / refused
            continue
        folder = sweep_dir / row["job"] / "checkpoints"
        found = [p for p in folder.iterdir() if CHECKPOINT.match(p.name)] if folder.is_dir() else []
        (saved if any(checkpoint_problem(p) is None for p in found) else unsaved).append(row["job"])
    parts = [f", job(s) {' '.join(saved)} stopped at a checkpoint"] if saved else []
    if unsaved:
        parts.append(f", job(s) {' '.join(unsaved)} stopped with no checkpoint to resume from (run anew)")
    return parts


def interrupted_line(sweep_dir: Path, signame: str) -> str:
    """The parent's line for a stop signal while it waits on the sweep's jobs; local jobs are stopped
    at a checkpoint first, so that the line says what they left."""
    from .. import interrupts
    from .cluster import stop_local_jobs

    return stopped_line(sweep_dir, f"stopped by {interrupts.described(signame)}", stop_local_jobs(signame))


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from .. import interrupts

        sweep_dir = Path(str(config.hydra.sweep.dir))
        _STARTED.append(sweep_dir)
        # a stop signal while no job of this process holds anything (waiting on a job's process):
        # what the sweep kept, not "while starting"
        interrupts.install(lambda signame: interrupted_line(sweep_dir, signame))
        if "LocalLauncher" in str(config.hydra.launcher.get("_target_", "")):
            from .cluster import shield_local_controllers, track_local_sweep

            track_local_sweep(str(config.hydra.launcher.submitit_folder))
            shield_local_controllers()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from .cluster import unshield

        unshield()
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_summary(sweep_dir)
        for row in rows:
            if row["status"] == "refused":  # said in the job's own log only, which a user rarely opens
                log.warning("job %s (%s) refused: %s", row["job"], row["label"], row["error"])
        front = [r["label"] for r in rows if r["pareto"]]
        log.info("sweep summary: %d jobs, Pareto front %s -> %s", len(rows), front, sweep_dir / "summary.md")
