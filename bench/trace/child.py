"""The traced process: `python -m bench.trace.child SPEC.json OUT.json`.

SPEC: {"overrides": [...], "device": "cuda" | "cpu", "fake": true, "layers": null | int,
"library": path of the fake CUDA library}. For device "cuda" the fake CUDA device is registered
before torch is imported (bench/trace/fakecuda.py), which is why this is a process of its own.
With "fake": false (CPU only) the same step runs on real tensors and the tracker counts real live
bytes: the tracer checked against a real run.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "peft", "trl", "bitsandbytes", "accelerate", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def trace(spec: dict) -> dict:
    """Build the stack's model on (fake) tensors and trace two steps; the result dict."""
    import resource

    import torch

    from bench.trace import kernels, step
    from bench.trace.model import experts_4bit, four_bit_linears, make_trainable, materialize, meta_base
    from bench.trace.tracker import PlanTracker

    started = time.perf_counter()
    device = spec.get("device", "cuda")
    fake = bool(spec.get("fake", True))
    cfg = _stack(spec["overrides"], device)
    torch.manual_seed(0)
    import bitsandbytes.functional as bnbf

    qmap = bnbf.create_dynamic_map()  # computed for real (its values are data), then made fake
    from bench.trace.fakecuda import runtime_shim

    contexts = []
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        qmap = mode.from_tensor(qmap)
        contexts.append(mode)
    bnbf.name2qmap["dynamic"] = qmap
    if device == "cuda":
        contexts.append(runtime_shim())
    offload_map = spec.get("offload_map")
    skeleton, quantizer = meta_base(cfg, spec.get("layers"), offload_map)
    linears = four_bit_linears(skeleton)
    experts = experts_4bit(cfg, skeleton, here=not offload_map)  # as the loader, before the adapters
    model = make_trainable(cfg, skeleton, quantizer)
    with contextlib.ExitStack() as outer:
        for ctx in contexts:
            outer.enter_context(ctx)
        model = materialize(model, linears, device, cfg.quant)
        tracker_ref: dict = {}
        _place_as_the_loader(cfg, model, offload_map, device, tracker_ref)
        built = time.perf_counter()
        tracker = PlanTracker()
        tracker_ref["t"] = tracker
        tracker.census = bool(spec.get("census"))
        gpu_modes = _kernel_modes(cfg, spec, fake, device)
        kernel_mode = kernels.GpuKernels
        if not fake:
            _init_weights(model)
        with contextlib.ExitStack() as inner:
            for ctx in gpu_modes:
                inner.enter_context(ctx)
            info = step.run_step(cfg, model, device, tracker, kernel_mode)
        attention = dict(kernels.ATTENTION["calls"]) if device == "cuda" else {}
        params = _param_counts(model)
    return {
        "overrides": list(spec["overrides"]),
        "device": device,
        "fake": fake,
        "layers_traced": int(model.config.get_text_config().num_hidden_layers),
        "peak": tracker.peak,
        "peak_phase": tracker.peak_phase,
        "peak_components": tracker.peak_components,
        "phases": {f"{dev}|{ph}": {"total": v[0], "components": v[1]} for (dev, ph), v in tracker.phase_peaks.items()},
        "modules": _module_peaks(tracker),
        "census": tracker.peak_census,
        "kernels": {"attention": attention, "ops": dict(kernels.GpuKernels.calls)},
        "params": params,
        "experts_4bit_layers": experts,
        **info,
        "build_s": round(built - started, 2),
        "wall_s": round(time.perf_counter() - started, 2),
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
    }


def _stack(overrides: list[str], device: str):
    """The stack's config as the traced device runs it."""
    from qlora_recipes.config.loader import load, precision_for

    cfg = load(list(overrides))
    if device == "cuda":  # precision=auto as it picks for the GPUs a plan is made for, not for this CPU
        cfg = precision_for(cfg, [1])
    if cfg.trainer.seq_len == "auto":  # no data here: traced at what the plan plans auto at
        from qlora_recipes import planner

        cfg.trainer.seq_len = planner.plan(cfg)["stack"]["seq_len"]
    return cfg


def _place_as_the_loader(cfg, model, offload_map, device: str, tracker_ref: dict) -> None:
    """What the loader moves off the device: offloaded blocks, and the input embeddings kept in host
    RAM (model/host_embeddings.py)."""
    if offload_map:
        from bench.trace.offload import offload_blocks

        offload_blocks(model, offload_map, device, tracker_ref)
    if cfg.offload.embeddings and device == "cuda":
        from qlora_recipes.model.host_embeddings import keep_on_host

        keep_on_host(model, device)


def _kernel_modes(cfg, spec: dict, fake: bool, device: str) -> list:
    """The contexts the traced step runs in: what fake tensors cannot decide themselves (TRL's
    offload keys, known sequence lengths) and, on the fake CUDA device, the kernels a GPU picks."""
    from bench.trace import kernels

    modes: list = []
    if fake:
        from qlora_recipes.config.schema import padding_free_on

        packed_rows = padding_free_on(cfg.data) and int(cfg.trainer.micro_batch_size) > 1
        modes += [kernels.trl_offload_keys(), kernels.known_sequences(not packed_rows)]
        if cfg.model.attn_implementation == "flex_attention":
            modes.append(kernels.flex_uncompiled())
    if device == "cuda":
        modes.append(kernels.trl_triton_folds())
        # flash attention needs sm80+ (Ampere); a recipe declaring no bf16 (T4 / V100) runs the
        # memory-efficient kernel instead
        flash = spec.get("flash", cfg.hardware.bf16)
        kernels.gpu_dispatch(flash=bool(flash))
    return modes


def _init_weights(model) -> None:
    """Real tensors (the real-run check) get finite values: to_empty leaves whatever memory held."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02)


def _param_counts(model) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": int(trainable), "total_elements": int(total)}


def _module_peaks(tracker) -> dict:
    """Each top-level block's own peak in forward and backward (MemTracker's module snapshots) for
    the traced step, by device: embeddings, each decoder layer, the final norm, lm_head."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _ModState

    out = {}
    for stats in tracker.memory_tracking.values():
        name = stats.mod_fqn
        short = name.split("base_model.model.", 1)[-1]
        parts = short.split(".")
        top = parts[:3] == ["model", "layers", parts[2] if len(parts) > 2 else ""] and len(parts) == 3
        if not (top or short in ("model.embed_tokens", "model.norm", "lm_head", "model")):
            continue
        entry = {}
        for state, key in ((_ModState.PEAK_FW, "forward"), (_ModState.PEAK_BW, "backward")):
            snaps = stats.snapshots.get(state) or []
            best = {}
            for snap in snaps:
                for dev, s in snap.items():
                    best[str(dev)] = max(best.get(str(dev), 0), s.get(_TOTAL_KEY, 0))
            if best:
                entry[key] = best
        entry["parameters"] = int(getattr(stats, "parameter_mem", 0))
        out[short] = entry
    return out


def prepare(spec: dict) -> None:
    """What the traced process does before it traces: for device "cuda" the fake CUDA device,
    registered before torch is imported; warnings and library logs quieted. A process that runs
    this once can fork a child per spec of the same device, each tracing as this process would."""
    if spec.get("device", "cuda") == "cuda":
        from bench.trace import fakecuda

        fakecuda.preload(spec.get("library"))
    _quiet()


def main(argv: list[str]) -> None:
    spec_path, out_path = argv[0], argv[1]
    spec = json.loads(open(spec_path).read())
    prepare(spec)
    result = trace(spec)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
