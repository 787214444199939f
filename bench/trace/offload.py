"""Layers offloaded to host RAM or disk, traced: the loader's placement on fake tensors.

What a GPU run of an offloading recipe holds (qlora_recipes/modeling.py): from_pretrained gets the
planner's device map as a dict, so the modules it puts on "cpu" or "disk" stay unquantized
(llm_int8_enable_fp32_cpu_offload); accelerate keeps their weights on `meta` (which k-bit prep
retypes to fp32) and the values as loaded, in the load dtype, in its weights map (a state dict in
host RAM, or the checkpoint's safetensors read in place for "disk"), and hooks each of their
linears and norms (AlignDevicesHook(offload=True)) to onload the weights to the GPU, cast to the
meta parameter's fp32, for each forward (and each recompute under checkpointing) and drop them after;
their LoRA adapters, gradients and optimizer state are real tensors on the GPU
(modeling._adapters_off_meta); the LM head stays on the GPU (placement.pin_output_head).

Here the model is built as in bench/trace/model.py with the offloaded blocks left unquantized, and
after `materialize` each offloaded block's frozen weights move to a weights map of fake host
tensors (here already fp32: the GPU receives the same fp32 copies), replaced by meta, with the same
accelerate hook on each module that holds them (never on the adapters). The onloaded copies are
labelled `offload_staging`. Disk and host RAM are the same to the GPU (the hook onloads from
either), so "disk" blocks are traced as host-RAM blocks; what the host side holds (params x the
load dtype's bytes, tests/e2e/test_offloaded_layers_train_and_save.py) is not compared.

A model whose layers are split between the GPU and the host is not one repeated layer, so it is
traced as three slices (k GPU layers + m offloaded, k + 1 + m, k + m + 1) and each phase is
extrapolated in both counts: x(G, O) = x(k, m) + (G - k) dG + (O - m) dO.
"""

from __future__ import annotations

OFFLOADED = ("cpu", "disk")


def offloaded_counts(plan: dict) -> tuple[int, int]:
    """(decoder layers on the GPU, decoder layers offloaded) in a plan's device map."""
    gpu = off = 0
    for key, dev in plan["device_map"].items():
        if key.startswith("model.layers."):
            if str(dev) in OFFLOADED:
                off += 1
            else:
                gpu += 1
    return gpu, off


def slice_map(plan: dict, gpu_layers: int, off_layers: int) -> dict:
    """The device map of a slice: its first `gpu_layers` decoder layers on GPU 0, the rest
    offloaded (as "cpu"), every other block where the plan puts it."""
    out = {}
    for key, dev in plan["device_map"].items():
        if key.startswith("model.layers."):
            continue
        out[key] = "cpu" if str(dev) in OFFLOADED else 0
    for i in range(gpu_layers + off_layers):
        out[f"model.layers.{i}"] = 0 if i < gpu_layers else "cpu"
    return out


def offload_blocks(model, dmap: dict, device: str, tracker_ref: dict) -> int:
    """Move the frozen weights of every block `dmap` offloads into a map of fake host tensors,
    leave meta in their place, and onload them around each forward as accelerate's
    AlignDevicesHook(offload=True) does (set_module_tensor_to_device: the stored value cast to the
    parameter's dtype, copied to the execution device, dropped to meta after the forward). Written
    as module hooks because accelerate re-wraps with type(param), which for a fake parameter is
    FakeTensor. Returns the bytes moved. `tracker_ref["t"]`: the tracker, whose tag labels the
    onloaded copies `offload_staging`."""
    import torch

    target = torch.device(device if ":" in device else f"{device}:0")
    base = model.get_base_model()
    moved = 0
    for block, dev in dmap.items():
        if str(dev) not in OFFLOADED:
            continue
        for name, module in base.get_submodule(block).named_modules():
            if "lora_" in name:
                continue  # the adapters stay on the device (modeling._adapters_off_meta)
            own = {n: p for n, p in module.named_parameters(recurse=False) if not p.requires_grad}
            if not own:
                continue
            stored = {n: p.detach().to("cpu") for n, p in own.items()}
            moved += sum(p.numel() * p.element_size() for p in own.values())
            _to_meta(module, stored)
            module.register_forward_pre_hook(_onload(stored, target, tracker_ref))
            module.register_forward_hook(lambda mod, args, out, stored=stored: _to_meta(mod, stored))
    return moved


def _to_meta(module, stored: dict) -> None:
    import torch

    for n, value in stored.items():
        empty = torch.empty(value.shape, dtype=value.dtype, device="meta")
        module._parameters[n] = torch.nn.Parameter(empty, requires_grad=False)


def _onload(stored: dict, target, tracker_ref: dict):
    import torch

    def hook(module, args):
        tracker = tracker_ref.get("t")
        prev = getattr(tracker, "tag", None)
        if tracker is not None:
            tracker.tag = "offload_staging"
        try:
            for n, value in stored.items():
                module._parameters[n] = torch.nn.Parameter(value.to(target), requires_grad=False)
        finally:
            if tracker is not None:
                tracker.tag = prev

    return hook


def extrapolate_split(a: dict, b: dict, c: dict, gpu: int, off: int) -> dict:
    """The result for `gpu` GPU layers and `off` offloaded ones from traces of (k, m), (k + 1, m)
    and (k, m + 1) layers, phase by phase (run.extrapolate in two counts)."""
    from bench.trace.children import combine

    k, m = a["offload_split"]
    return {"layers": gpu + off, **combine(a, [b, c], [gpu - k, off - m])}


def trace_offloaded(overrides: list[str], plan: dict, log_dir=None, k: int = 2, m: int = 1) -> dict:
    """Trace a stack whose plan offloads decoder layers: three slices, extrapolated."""
    import time

    from bench.trace.children import brief, run_child

    gpu, off = offloaded_counts(plan)
    started = time.perf_counter()
    runs = {}
    for tag, (g, o) in {"A": (k, m), "B": (k + 1, m), "C": (k, m + 1)}.items():
        spec = {"overrides": list(overrides), "device": "cuda", "layers": g + o, "offload_map": slice_map(plan, g, o)}
        log = (log_dir / f"G{g}-O{o}.log") if log_dir else None
        runs[tag] = run_child(spec, log)
        runs[tag]["offload_split"] = [g, o]
    result = extrapolate_split(runs["A"], runs["B"], runs["C"], gpu, off)
    result.update(
        {
            "sliced": True,
            "layers_traced": [runs[t]["offload_split"] for t in "ABC"],
            "offloaded_layers": off,
            "gpu_layers": gpu,
            "slices": {f"{r['offload_split'][0]}+{r['offload_split'][1]}": brief(r) for r in runs.values()},
            "kernels": runs["B"].get("kernels"),
            "modules": runs["C"].get("modules"),
            "modules_of": f"the {k}+{m + 1}-layer slice",
            "overrides": list(overrides),
            "device": "cuda",
            "trace_s": round(time.perf_counter() - started, 1),
        }
    )
    return result
