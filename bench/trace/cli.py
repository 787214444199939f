"""`python -m bench trace`: traced memory of a stack, and the traced suite.

    python -m bench trace recipe=llama3.1-8b-24gb            # one stack (any train.py overrides;
                                                             #   none: the embedded default)
    python -m bench trace model=llama3.1-8b trainer.seq_len=4096 --gpus 24GB
    python -m bench trace recipe=llama3.1-8b-24gb --layers full   # trace all 32 layers, no slices
    python -m bench trace --suite                            # every single-GPU recipe and lean option
    python -m bench trace --suite --only 'llama3.1-8b*'      #   some of its cases
    python -m bench trace --cpu-check                        # the tracer vs a real CPU run

One stack: its model is built on fake tensors on a fake CUDA device (a CPU is enough), two training
steps run under torch's MemTracker, and the peak is printed by component, by phase and by module,
beside the plan of the same stack (`peak_allocated_gib`, planned for --gpus or the recipe's hardware).
--json FILE writes the result. The suite writes bench/results/planner-traced.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qlora_recipes.units import GiB


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="train.py overrides (recipe=NAME, group=option, key=value)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="the device traced (default cuda)")
    p.add_argument("--layers", default="auto", help="auto (slices of large models), full, or a slice size k")
    p.add_argument("--gpus", help="the GPU the plan is for (e.g. 24GB, 80GiB); default the recipe's hardware")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--suite", action="store_true", help="the traced suite -> bench/results/planner-traced.*")
    p.add_argument("--only", help="suite: comma-separated globs of case names")
    p.add_argument("--cpu-check", action="store_true", help="the tracer vs a real CPU run -> the same results file")
    p.add_argument("--results-dir", help="where the suite's results go (default bench/results)")
    p.add_argument("--resume", action="store_true", help="suite: keep the cases the results file already has")
    return p


def main(argv: list[str], prog: str = "python -m bench trace") -> None:
    args = parser(prog).parse_args(argv)
    if args.suite or args.cpu_check:
        from bench.trace.suite import run_suite

        run_suite(args, command=" ".join([prog, *argv]))
        return
    from bench.trace.run import compare, plan_for, recipe_gpus, trace_stack
    from qlora_recipes.units import parse_size

    layers = args.layers if args.layers in ("auto", "full") else int(args.layers)
    result = trace_stack(args.overrides, device=args.device, layers=layers)
    gpus = [parse_size(args.gpus, "--gpus")] if args.gpus else recipe_gpus(args.overrides)
    if args.device == "cuda":
        gpus = gpus or [80 * GiB]
        result["comparison"] = compare(result, plan_for(args.overrides, gpus), "cuda:0")
    else:
        result["comparison"] = compare(result, plan_for(args.overrides, []), "cpu")
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def _g(n: float) -> str:
    return f"{n / GiB:7.3f}"


def render(result: dict) -> str:
    """The console report of one trace: peak, components, phases and modules, with the plan beside."""
    c = result.get("comparison") or {}
    dev = c.get("device") or next(iter(result["peak"]), "cuda:0")
    layers = result.get("layers")
    how = (
        f"layers {result['layers_traced'][0]} and {result['layers_traced'][1]} traced, scaled to {layers}"
        if result.get("sliced")
        else f"all {layers} layers traced"
    )
    lines = [
        f"traced: {' '.join(result['overrides']) or '(defaults)'} on fake {dev} ({how}; {result.get('trace_s', 0):.0f} s)",
        f"peak {result['peak'].get(dev, 0) / GiB:.3f} GiB in phase {result['peak_phase'].get(dev)}"
        + (
            f"; plan's peak_allocated {c['planned_gib']:.3f} GiB (ratio {c['ratio']:.3f}, plan peaks in {c['planned_peak_phase']})"
            if c.get("planned_gib")
            else ""
        ),
        "",
        f"{'GiB at the peak':<26}{'traced':>9}{'planned':>9}",
    ]
    for name, row in (c.get("components") or {}).items():
        lines.append(f"{name:<26}{row['traced_gib']:9.3f}{row['planned_gib']:9.3f}")
    lines += ["", f"{'phase peak (GiB)':<26}{'traced':>9}{'planned':>9}"]
    for name, row in (c.get("phases") or {}).items():
        lines.append(f"{name:<26}{row['traced_gib']:9.3f}{row['planned_gib']:9.3f}")
    fwd = result["phases"].get(f"{dev}|forward")
    if fwd:
        lines.append(f"{'forward (no plan row)':<26}{fwd['total'] / GiB:9.3f}")
    others = sorted(d for d in result["peak"] if d != dev)
    for d in others:
        lines.append(f"{d} (host side): peak {result['peak'][d] / GiB:.3f} GiB {result['peak_components'].get(d, {})}")
    modules = result.get("modules") or {}
    if modules:
        of = f" of {result['modules_of']}" if result.get("modules_of") else ""
        lines += ["", f"module peaks{of} (GiB; MemTracker's local peaks in the last micro-batch)"]
        for name, m in modules.items():
            fw = m.get("forward", {}).get(dev, 0)
            bw = m.get("backward", {}).get(dev, 0)
            lines.append(
                f"  {name:<24} fwd {fw / GiB:8.3f}  bwd {bw / GiB:8.3f}  params {m.get('parameters', 0) / GiB:8.3f}"
            )
    kern = result.get("kernels") or {}
    if kern:
        lines.append(f"kernels: attention {kern.get('attention')}, ops {kern.get('ops')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
