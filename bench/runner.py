"""Child processes of the harness: each measured run is a fresh process, since peak RSS and
max_memory_allocated are per process. `run_child` runs one to completion (wall time, CPU time and
peak RSS from `wait4`, the cores the rest of the machine kept busy meanwhile, a timeout that kills
its process group); `read_ours` and `read_baseline` turn what a `train.py` run dir or the baseline's
metrics file holds into one record with the same definitions; `summarize` and `ratios` combine
records; `baseline_argv` is the baseline's command for the same job as a composed config.

Definitions, the same for ours and the baseline: wall_s = the child process from start to exit;
train_s = trainer construction + `train()`; tokens_per_s = TRL's `num_tokens` / train_s;
s_per_step = the mean time per optimizer step after the warm-up steps (from step-end times);
tokens_per_s_steady = the tokens those timed steps trained / their seconds (TRL's num_tokens at
each end; without per-step counts, (num_tokens / steps) / s_per_step); peak memory: on a GPU
`max_memory_allocated` (and `max_memory_reserved`), on a CPU the child's peak RSS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import REPO
from bench.machine import busy_cpu_seconds, load_average
from bench.stats import median, ratio, steady_step_s, steady_tokens_per_s
from qlora_recipes.config.attention import VARLEN
from qlora_recipes.units import PRECISION_DTYPE, GiB


def child_env(extra: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "HYDRA_FULL_ERROR": "1",
        }
    )
    env.update(extra or {})
    return env


def _wait(proc: subprocess.Popen, deadline: float | None) -> tuple[int, Any, bool]:
    """(wait status, rusage, timed out) of the child; on a timeout its whole group is killed."""
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                return status, usage, False
            if deadline is not None and time.perf_counter() > deadline:
                _kill_group(proc.pid)
                _, status, usage = os.wait4(proc.pid, 0)
                return status, usage, True
            time.sleep(0.05)
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the child must not outlive us
        _kill_group(proc.pid)
        raise


def run_child(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    cwd: Path = REPO,
) -> dict:
    """Run one child to completion, its output to `log_path`. Returns rc, wall_s and the child's own
    peak RSS (wait4's ru_maxrss: per process, unlike RUSAGE_CHILDREN)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(str(a) for a in argv) + "\n")
        log.flush()
        load_1min = (load_average() or [None])[0]
        busy0 = busy_cpu_seconds()
        started = time.perf_counter()
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else child_env(),
            process_group=0,  # its own group (killed whole on timeout), in our session
        )
        status, usage, timed_out = _wait(proc, None if timeout_s is None else started + timeout_s)
        wall = time.perf_counter() - started
        busy1 = busy_cpu_seconds()
        cpu_s = usage.ru_utime + usage.ru_stime
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "peak_rss_gib": usage.ru_maxrss * 1024 / GiB,  # ru_maxrss is in KiB on Linux
        "cpu_s": cpu_s,  # CPU time of the process: less sensitive to other load than wall time
        "load_1min": load_1min,  # the machine's 1-minute load average as the child started
        # cores the rest of the machine kept busy meanwhile (all busy CPU time less the child's, per second)
        "others_cores": max(0.0, (busy1 - busy0 - cpu_s) / wall) if busy0 is not None and wall > 0 else None,
        "timed_out": timed_out,
        "log": str(log_path.relative_to(REPO)) if log_path.is_relative_to(REPO) else str(log_path),
    }


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path: str | Path, lines: int = 4) -> str:
    path = Path(path) if Path(path).is_absolute() else REPO / path
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    useful = [ln for ln in text if ln.strip() and "Warning" not in ln and "warnings.warn" not in ln]
    return " | ".join(useful[-lines:])[-600:]


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _record(child: dict) -> dict:
    """What the harness measured of a run, whatever the run itself wrote."""
    return {
        "rc": child["rc"],
        "wall_s": child["wall_s"],
        "cpu_s": child.get("cpu_s"),
        "load_1min": child.get("load_1min"),
        "others_cores": child.get("others_cores"),
        "peak_rss_gib": child["peak_rss_gib"],
        "log": child["log"],
    }


def _failed(rec: dict, child: dict, m: Mapping[str, Any], own_error: str | None) -> bool:
    """Mark `rec` as an error (the run's own message, else the log's last lines) unless it succeeded."""
    if child["rc"] == 0 and m.get("status") == "ok":
        return False
    rec["status"] = "error"
    rec["error"] = own_error or log_tail(child["log"]) or f"exit status {child['rc']}"
    if child.get("timed_out"):
        rec["error"] = "timed out; " + rec["error"]
    return True


def _trained(m: Mapping[str, Any]) -> dict:
    """The fields train.py's metrics.json and the baseline's share."""
    return {
        "status": "ok",
        "steps": m.get("steps"),
        "train_s": m.get("train_s"),
        "proc_wall_s": m.get("wall_s"),
        "loss_first": m.get("train_loss_first"),
        "loss_last": m.get("train_loss_last"),
        "loss_mean": m.get("train_loss_mean"),
    }


def _finish(
    rec: dict, warmup: int, step_ends: Mapping[int, float], gpu: bool, step_tokens: Mapping[int, float] | None = None
) -> dict:
    steps = rec.get("steps") or 0
    # each step's end and the tokens trained by then: a step that stands out (a longer row than any
    # before it, the allocator growing) shows, where the means hide it
    rec["step_end_s"] = {str(k): v for k, v in sorted(step_ends.items())}
    if step_tokens:
        rec["step_tokens"] = {str(k): v for k, v in sorted(step_tokens.items())}
    rec["s_per_step"] = steady_step_s(step_ends, warmup)
    if rec["s_per_step"] is None and steps and rec.get("train_s"):
        rec["s_per_step"] = rec["train_s"] / steps
        rec["s_per_step_note"] = "train_s / steps (too few steps after warm-up)"
    tokens = rec.get("tokens")
    rec["tokens_per_s_steady"] = steady_tokens_per_s(step_ends, step_tokens or {}, warmup) or (
        (tokens / steps / rec["s_per_step"]) if tokens and steps and rec["s_per_step"] else None
    )
    rec["peak_gib"] = rec.get("peak_allocated_gib") if gpu else rec.get("peak_rss_gib")
    return rec


def read_ours(run_dir: Path, child: dict, warmup: int, gpu: bool) -> dict:
    """One `train.py` run: metrics.json, memory.jsonl (a line per step with trainer.memory_log_steps=1)
    and plan.json of its run dir, plus the harness's wall time and peak RSS of the process."""
    rec = _record(child)
    metrics_path = run_dir / "metrics.json"
    m = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if _failed(rec, child, m, m.get("error")):
        return rec
    rec.update(
        _trained(m),
        tokens_per_s=m.get("tokens_per_s"),
        token_efficiency=m.get("token_efficiency"),  # real / computed tokens (padded slots computed)
        micro_batch_size=m.get("micro_batch_size"),
        grad_accum=m.get("grad_accum"),
    )
    if rec["tokens_per_s"] and rec["train_s"]:
        rec["tokens"] = rec["tokens_per_s"] * rec["train_s"]
    samples = _jsonl(run_dir / "memory.jsonl")
    by_step: dict[int, float] = {}
    for s in samples:
        by_step.setdefault(int(s["step"]), float(s["t_s"]))  # the last step is logged twice (train end)
    if gpu:
        rec["peak_allocated_gib"] = m.get("peak_mem_gib")
        reserved = [s["reserved_gib"] for s in samples if "reserved_gib" in s]
        rec["peak_reserved_gib"] = max(reserved) if reserved else None
    if (run_dir / "oom.json").exists():  # lifecycle.OomRecord: an out-of-memory retry changed the stack
        rec["note"] = "out of memory during the run; the OOM ladder changed the stack (oom.json)"
        rec["oom"] = True
    return _finish(rec, warmup, by_step, gpu, logged_tokens(run_dir / "tb"))


def logged_tokens(tb_dir: Path) -> dict[int, float]:
    """TRL's cumulative num_tokens by step, from the run's TensorBoard events ({} without them)."""
    events = sorted(tb_dir.rglob("events.out.tfevents.*")) if tb_dir.is_dir() else []
    if not events:
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[int, float] = {}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/num_tokens" in acc.Tags().get("scalars", []):
            out.update({e.step: e.value for e in acc.Scalars("train/num_tokens")})
    return out


def read_baseline(metrics_path: Path, child: dict, warmup: int, gpu: bool) -> dict:
    """One baseline run: the metrics JSON it wrote, plus the harness's wall time and peak RSS."""
    rec = _record(child)
    m = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if _failed(rec, child, m, None):
        return rec
    rec.update(_trained(m), tokens=m.get("tokens"), tokens_per_s=m.get("tokens_per_s"))
    if gpu:
        rec["peak_allocated_gib"] = m.get("peak_mem_gib")
        rec["peak_reserved_gib"] = m.get("peak_reserved_gib")
    ends = m.get("step_end_s") or []
    tokens = {int(k): v for k, v in (m.get("step_tokens") or {}).items()}
    return _finish(rec, warmup, {i + 1: t for i, t in enumerate(ends)}, gpu, tokens)


SUMMARY_KEYS = (
    "wall_s",
    "cpu_s",
    "train_s",
    "s_per_step",
    "tokens_per_s",
    "tokens_per_s_steady",
    "token_efficiency",
    "peak_gib",
    "peak_rss_gib",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "loss_first",
    "loss_last",
    "loss_mean",
    "steps",
)


def summarize(runs: list[dict]) -> dict:
    """Medians over the successful runs; status error when none succeeded."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        errors = [r.get("error") for r in runs if r.get("error")]
        return {"status": "error", "n": 0, "error": errors[0] if errors else "no run"}
    out: dict[str, Any] = {"status": "ok", "n": len(ok)}
    for key in SUMMARY_KEYS:
        out[key] = median(r.get(key) for r in ok)
    others = [r["others_cores"] for r in runs if r.get("others_cores") is not None]
    out["max_others_cores"] = max(others) if others else None
    notes = sorted({r["note"] for r in ok if r.get("note")})
    if notes:
        out["note"] = "; ".join(notes)
    return out


RATIO_KEYS = ("wall_s", "cpu_s", "train_s", "s_per_step", "tokens_per_s", "tokens_per_s_steady", "peak_gib")


def ratios(ours: Mapping[str, Any], base: Mapping[str, Any]) -> dict:
    return {k: ratio(ours.get(k), base.get(k)) for k in RATIO_KEYS}


def baseline_argv(cfg: Any, out_dir: Path, metrics_path: Path) -> list[str]:
    """The same job as `train.py` with this composed config, as arguments of bench/baseline.py."""
    t, o, p, q, d = cfg.trainer, cfg.optim, cfg.peft, cfg.quant, cfg.data
    if p.method != "lora":
        raise ValueError(f"the baseline runs plain LoRA, not peft={p.method}")
    if t.max_steps <= 0:
        raise ValueError("the baseline needs trainer.max_steps > 0")
    targets = p.target_modules if isinstance(p.target_modules, str) else ",".join(p.target_modules)
    options = {
        "--model": cfg.model.name_or_path,
        "--data": d.path,
        "--out": out_dir,
        "--metrics-json": metrics_path,
        "--steps": t.max_steps,
        "--batch": t.micro_batch_size,
        "--grad-accum": t.grad_accum,
        "--seq-len": t.seq_len,
        "--quant": q.method,
        "--dtype": PRECISION_DTYPE[cfg.precision.name],
        "--optim": o.name,
        "--lr": o.lr,
        "--scheduler": o.scheduler,
        "--warmup-ratio": o.warmup_ratio,
        "--weight-decay": o.weight_decay,
        "--max-grad-norm": o.max_grad_norm,
        "--r": p.r,
        "--alpha": p.alpha,
        "--dropout": p.dropout,
        "--target-modules": targets,
        # plain TRL has no sdpa_varlen (ours, registered by our loader): its packed rows take sdpa's mask
        "--attn": "sdpa" if cfg.model.attn_implementation == VARLEN else cfg.model.attn_implementation,
        "--seed": cfg.seed,
        "--logging-steps": cfg.trainer.logging_steps,
    }
    flags = {
        "--no-double-quant": not q.double_quant,
        "--no-gradient-checkpointing": not t.gradient_checkpointing,
        "--reentrant": t.checkpointing_mode == "reentrant",
        "--packing": d.packing,
        "--no-completion-only-loss": not d.completion_only_loss,
    }
    argv = [sys.executable, "-m", "bench.baseline"]
    argv += [s for key, value in options.items() for s in (key, str(value))]
    return argv + [flag for flag, on in flags.items() if on]
