"""Running traces: a child process per traced model, layer slices scaled to the whole model, and the
plan of the same stack beside it.

A trace of a 32- or 80-layer model runs every layer's forward, recompute and backward op through the
fake mode and the tracker (minutes on a busy 2-core machine). Its decoder layers are identical, so
memory is affine in the number of layers L, phase by phase: the static rows (4-bit weights, adapters,
gradients, optimizer state) grow by one layer's bytes, the activations kept for backward by one
layer's (its input under checkpointing, all it saves without), and the working sets of a phase do
not grow at all. `trace_stack` therefore traces two slices of the model (k and k + 1 decoder layers,
everything else whole: embeddings, vocabulary, sequence, batch, optimizer) and extrapolates each
phase's peak and components exactly: x(L) = x(k) + (L - k) * (x(k + 1) - x(k)). The smallest k is 2,
and with TRL's activation offloading 1 + TRL_OFFLOAD_FWD_STASH (its forward stash keeps the inputs of
the last five layers on the GPU, so fewer layers would not yet show the per-layer step).
tests/unit/test_memory_tracer.py checks a sliced trace against a full one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import REPO

PHASES = ("prefill", "decode", "kl", "forward", "loss", "reference", "backward", "optimizer")
# the plan's phase names for the trace's (loss: the fused head forward and backward; backward: the
# decoder layers' backward with their recompute; reference: DPO's and KTO's no_grad reference forward;
# kl: KTO's no_grad forward of its KL batch; prefill and decode: GRPO's generation, the plan's
# sampling phase the larger of the two; forward has no row of its own in a plan)
PLAN_PHASE = {
    "prefill": "train: sampling",
    "decode": "train: sampling",
    "kl": "train: KL forward",
    "loss": "train: loss",
    "reference": "train: reference forward",
    "backward": "train: layer backward",
    "optimizer": "optimizer step",
}
STATIC = ("quantized_weights", "other_params", "buffers", "lora_weights", "gradients", "optimizer_state")
FULL_TRACE_MAX_LAYERS = 4  # models this small are traced whole


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


def slice_layers(cfg: Any) -> tuple[int, int] | None:
    """(k, k + 1) decoder layers to trace, or None to trace the model whole."""
    from qlora_recipes.planner import model_figures

    layers = model_figures(cfg.model).num_layers
    k = 2 + (cfg.trainer.activation_offload_stash if cfg.trainer.activation_offloading else 0)
    if layers <= max(FULL_TRACE_MAX_LAYERS, k + 1):
        return None
    return k, k + 1


def _affine(a: dict, b: dict, steps: int) -> dict:
    """a + steps * (b - a), key by key (components, bytes)."""
    keys = set(a) | set(b)
    return {k: int(a.get(k, 0) + steps * (b.get(k, 0) - a.get(k, 0))) for k in keys if a.get(k, 0) or b.get(k, 0)}


def phase_table(result: dict, device: str) -> dict[str, dict]:
    """{phase: {"total": bytes, "components": {...}}} of one device of a child result."""
    out = {}
    for key, value in result["phases"].items():
        dev, phase = key.split("|", 1)
        if dev == device and phase in PHASES:
            out[phase] = {"total": int(value["total"]), "components": dict(value["components"])}
    return out


def extrapolate(small: dict, large: dict, layers: int) -> dict:
    """The result of a model of `layers` layers from traces of k and k + 1 layers, phase by phase."""
    k = small["layers_traced"]
    steps = layers - k
    out = {"layers_traced": [k, large["layers_traced"]], "layers": layers, "phases": {}, "peak": {}, "peak_phase": {}}
    out["peak_components"] = {}
    devices = {key.split("|", 1)[0] for key in small["phases"]} | {key.split("|", 1)[0] for key in large["phases"]}
    for dev in sorted(devices):
        a, b = phase_table(small, dev), phase_table(large, dev)
        best = None
        for phase in PHASES:
            if phase not in a or phase not in b:
                continue
            total = int(a[phase]["total"] + steps * (b[phase]["total"] - a[phase]["total"]))
            comps = _affine(a[phase]["components"], b[phase]["components"], steps)
            out["phases"][f"{dev}|{phase}"] = {"total": total, "components": comps}
            if best is None or total > best[0]:
                best = (total, phase, comps)
        if best:
            out["peak"][dev], out["peak_phase"][dev], out["peak_components"][dev] = best
    out["static"] = {
        dev: _affine(small["static"].get(dev, {}), large["static"].get(dev, {}), steps)
        for dev in set(small["static"]) | set(large["static"])
    }
    return out


def trace_stack(
    overrides: list[str], device: str = "cuda", layers: int | str | None = "auto", log_dir: Path | None = None, **extra
) -> dict:
    """Trace a stack: whole, or two layer slices extrapolated to the model's layers."""
    from bench.trace.partial import partial_layers, resolved_overrides, trace_partial
    from qlora_recipes.config.loader import load
    from qlora_recipes.planner import model_figures

    overrides = resolved_overrides(list(overrides))  # checkpointing / micro-batch auto: as the plan resolves them
    cfg = load(list(overrides))
    total_layers = model_figures(cfg.model).num_layers
    pair = (
        slice_layers(cfg)
        if layers == "auto"
        else (None if layers in (None, "full") else (int(layers), int(layers) + 1))
    )
    started = time.perf_counter()
    base = {"overrides": list(overrides), "device": device, **extra}

    def log(tag: str) -> Path | None:
        return (log_dir / f"{tag}.log") if log_dir else None

    partial = partial_layers(cfg, total_layers) if pair is not None else None
    if partial is not None:  # the first N layers checkpointed: two kinds of layer, three slices
        result = trace_partial(base, partial, total_layers, log_dir)
    elif pair is None:
        result = run_child(base, log("full"))
        result["layers"] = total_layers
        result["layers_traced"] = [result["layers_traced"]]
        result["sliced"] = False
    else:
        small = run_child({**base, "layers": pair[0]}, log(f"L{pair[0]}"))
        large = run_child({**base, "layers": pair[1]}, log(f"L{pair[1]}"))
        result = extrapolate(small, large, total_layers)
        result["sliced"] = True
        result["slices"] = {str(pair[0]): _brief(small), str(pair[1]): _brief(large)}
        result["kernels"] = large.get("kernels")
        result["modules"] = large.get("modules")  # per-module peaks: of the larger slice, not scaled
        result["modules_of"] = f"the {pair[1]}-layer slice"
        result["optimizer"] = large.get("optimizer")
        result["max_rss_gib"] = max(small.get("max_rss_gib", 0), large.get("max_rss_gib", 0))
    result["overrides"] = list(overrides)
    result["device"] = device
    result["trace_s"] = round(time.perf_counter() - started, 1)
    return result


def _brief(r: dict) -> dict:
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


def compare(result: dict, plan: dict, device: str = "cuda:0") -> dict:
    """Traced vs planned on one device: peaks, ratio, and each component and phase beside its plan row."""
    from qlora_recipes.units import GiB

    planned = plan.get("peak_allocated_gib")
    entry = next((d for d in plan["devices"] if d["device"] == device), None)
    if entry is not None and "peak_allocated" in entry:
        planned = entry["peak_allocated"] / GiB
    traced = result["peak"].get(device, 0) / GiB
    comps = plan.get("components", {})
    phase = result["peak_phase"].get(device)
    traced_comps = result["peak_components"].get(device, {})
    rows = {}
    for name in sorted(set(traced_comps) | {k for k, v in comps.items() if v.get(device)}):
        if name in ("cuda_context", "allocator_overhead", "process_baseline", "eval_transient"):
            continue
        rows[name] = {
            "traced_gib": round(traced_comps.get(name, 0) / GiB, 3),
            "planned_gib": round(comps.get(name, {}).get(device, 0) / GiB, 3),
        }
    phases = {}
    for ph, plan_name in PLAN_PHASE.items():
        got = result["phases"].get(f"{device}|{ph}")
        if got is None or entry is None:
            continue
        static = sum(comps.get(k, {}).get(device, 0) for k in STATIC) + comps.get("offload_staging", {}).get(device, 0)
        transient = _plan_transient(comps, device, plan_name)
        if plan_name in phases and phases[plan_name]["traced_gib"] >= round(got["total"] / GiB, 3):
            continue  # grpo: the larger of the prefill and the decoding steps
        phases[plan_name] = {
            "traced_gib": round(got["total"] / GiB, 3),
            "planned_gib": round((static + transient) / GiB, 3),
        }
    train = max((v["planned_gib"] for v in phases.values()), default=None)
    return {
        "device": device,
        "planned_gib": round(planned, 3) if planned is not None else None,
        "planned_train_gib": train,  # the plan's largest training phase (its peak leaves out eval here)
        "traced_gib": round(traced, 3),
        "ratio": round(traced / planned, 3) if planned else None,
        "traced_peak_phase": PLAN_PHASE.get(phase, phase),
        "planned_peak_phase": entry.get("peak_phase") if entry else None,
        "components": rows,
        "phases": phases,
    }


def _plan_transient(comps: dict, device: str, phase: str) -> int:
    def row(k: str) -> int:
        return comps.get(k, {}).get(device, 0)

    if phase == "train: loss":
        return row("activations") + row("lm_head_loss")
    if phase == "train: layer backward":
        return row("activations") + row("layer_working") + row("dequant_scratch")
    if phase == "train: reference forward":
        return row("activations") + row("reference_forward")
    if phase == "train: KL forward":
        return row("kl_forward")
    if phase == "train: sampling":
        return row("sampling")
    return row("optimizer_scratch")
