"""What every trace runs on: a child process per traced model (bench/trace/child.py), the plan of the
same stack for its recipe's hardware, and the affine combination of layer slices' results that scales
them to a whole model (run.py: k and k + 1 layers; partial.py: checkpointed and kept layers;
offload.py: GPU and offloaded layers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import REPO

PHASES = ("prefill", "decode", "kl", "vision", "forward", "loss", "reference", "backward", "optimizer")


def child_env() -> dict:
    env = dict(os.environ)
    env.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_child(spec: dict, log: Path | None = None, timeout: float | None = None) -> dict:
    """One traced process (bench/trace/child.py) for `spec`; its result dict."""
    if spec.get("device", "cuda") == "cuda" and spec.get("fake", True):
        from bench.trace import fakecuda

        try:
            spec = {**spec, "library": str(fakecuda.build())}
        except Exception as err:  # noqa: BLE001 - one line that says what is missing
            raise RuntimeError(
                f"the fake CUDA device is a small C++ library built once with torch.utils.cpp_extension, "
                f"which needs a C++ compiler and ninja (pip install ninja): {str(err).splitlines()[0]}"
            ) from err
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qlora-trace-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        started = time.perf_counter()
        with open(log or os.devnull, "w") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.trace.child", str(spec_path), str(out_path)],
                cwd=REPO,
                env=child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        if proc.returncode != 0 or not out_path.is_file():
            text = Path(log).read_text() if log and Path(log).is_file() else ""
            last = next((ln for ln in reversed(text.splitlines()) if "Error" in ln or "Exception" in ln), "")
            raise RuntimeError(f"trace child failed (rc {proc.returncode}): {last.strip()} (log: {log})")
        result = json.loads(out_path.read_text())
        result["child_wall_s"] = round(time.perf_counter() - started, 1)
        return result


def phase_table(result: dict, device: str) -> dict[str, dict]:
    """{phase: {"total": bytes, "components": {...}}} of one device of a child result."""
    out = {}
    for key, value in result["phases"].items():
        dev, phase = key.split("|", 1)
        if dev == device and phase in PHASES:
            out[phase] = {"total": int(value["total"]), "components": dict(value["components"])}
    return out


def _mix(base: float, others: list[float], steps: list[int]) -> int:
    return int(base + sum(s * (o - base) for o, s in zip(others, steps, strict=True)))


def _affine(base: dict, others: list[dict], steps: list[int]) -> dict:
    """base + sum of steps[i] * (others[i] - base), key by key (components, bytes)."""
    keys = set(base).union(*others)
    present = [k for k in keys if base.get(k, 0) or any(o.get(k, 0) for o in others)]
    return {k: _mix(base.get(k, 0), [o.get(k, 0) for o in others], steps) for k in present}


def combine(base: dict, others: list[dict], steps: list[int]) -> dict:
    """Traced results combined affinely, phase by phase and device by device: base + sum of
    steps[i] * (others[i] - base) for each phase's total and components and each static row; each
    device's peak is its largest phase. A phase counts where every result has it."""
    results = [base, *others]
    out: dict = {"phases": {}, "peak": {}, "peak_phase": {}, "peak_components": {}}
    for dev in sorted({key.split("|", 1)[0] for r in results for key in r["phases"]}):
        first, *rest = (phase_table(r, dev) for r in results)
        best = None
        for phase in PHASES:
            if phase not in first or not all(phase in t for t in rest):
                continue
            total = _mix(first[phase]["total"], [t[phase]["total"] for t in rest], steps)
            comps = _affine(first[phase]["components"], [t[phase]["components"] for t in rest], steps)
            out["phases"][f"{dev}|{phase}"] = {"total": total, "components": comps}
            if best is None or total > best[0]:
                best = (total, phase, comps)
        if best:
            out["peak"][dev], out["peak_phase"][dev], out["peak_components"][dev] = best
    out["static"] = {
        dev: _affine(base["static"].get(dev, {}), [o["static"].get(dev, {}) for o in others], steps)
        for dev in set().union(*(r["static"] for r in results))
    }
    return out


def brief(r: dict) -> dict:
    """A slice's result in a line: what it traced, its peaks and times."""
    return {k: r.get(k) for k in ("layers_traced", "peak", "peak_phase", "wall_s", "step_s", "max_rss_gib")}


def plan_for(overrides: list[str], gpus: list[int] | None = None) -> dict:
    """The plan of one process of the stack, for its recipe's declared hardware (GPU memory, host
    RAM: as tests/unit/test_recipes_keep_their_promises.py plans a recipe) or the GPU given; without the ladder."""
    from qlora_recipes import planner
    from qlora_recipes.config import devices
    from qlora_recipes.config.loader import load

    cfg = load(list(overrides))
    declared = devices.declared_gpus(cfg)[:1] if cfg.hardware.gpus > 0 else []
    return planner.plan(
        cfg, gpus=gpus or declared or None, host_ram=devices.declared_host_ram(cfg), world_size=1, ladder=False
    )


def recipe_gpus(overrides: list[str]) -> list[int] | None:
    """The GPU a recipe's hardware node declares (one process: its first), else None."""
    from qlora_recipes.config import devices
    from qlora_recipes.config.loader import load

    cfg = load(list(overrides))
    return devices.declared_gpus(cfg)[:1] or None if cfg.hardware.gpus > 0 else None
