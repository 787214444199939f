"""Facts about where the benchmark runs: the device (a GPU asked about in a child process, so this
process never holds a CUDA context while measured children run, else the CPU by model and cores), the
machine's load and busy CPU time, the versions of the stack and the commit measured, and timestamps."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import REPO

# The stack whose versions every results file records.
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "trl",
    "bitsandbytes",
    "accelerate",
    "datasets",
    "liger-kernel",
    "flash-attn",
)


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


_GPU_QUERY = (
    "import json, torch\n"
    "ok = torch.cuda.is_available()\n"
    "p = torch.cuda.get_device_properties(0) if ok else None\n"
    "print(json.dumps({'gpu': ok, 'name': p.name if ok else None, 'total': p.total_memory if ok else None,"
    " 'count': torch.cuda.device_count() if ok else 0, 'cuda': torch.version.cuda}))\n"
)


def _query_gpu() -> dict | None:
    try:
        out = subprocess.run([sys.executable, "-c", _GPU_QUERY], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def describe_device(force_cpu: bool = False) -> dict:
    """The device the benchmark runs on. The GPU is asked about in a child process, so this process
    never holds a CUDA context while the measured children run."""
    gpu = None
    if not force_cpu and os.environ.get("CUDA_VISIBLE_DEVICES", None) not in ("", "-1"):
        gpu = _query_gpu()
    if gpu and gpu.get("gpu"):
        name = gpu["name"]
        return {
            "kind": "cuda",
            "name": name,
            "slug": slug(name),
            "total_bytes": int(gpu["total"]),
            "count": gpu["count"],
            "cuda": gpu["cuda"],
        }
    name = f"cpu: {cpu_model_name()}, {cpu_cores()} cores"
    return {"kind": "cpu", "name": name, "slug": slug(name), "total_bytes": None, "count": 0, "cuda": None}


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of the machine have used (Linux /proc/stat, idle and iowait excluded)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()


def git_state() -> str | None:
    """The short commit, marked when tracked files have uncommitted changes."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return f"{commit}{' (with uncommitted changes)' if dirty else ''}" if commit else None


def environment() -> dict:
    """Versions of the stack and the commit measured."""
    from importlib import metadata

    env: dict[str, Any] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    env["git"] = git_state()
    return env


def today() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
