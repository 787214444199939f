"""The traced suite: every shipped single-GPU recipe and each lean option, traced and planned.

`python -m bench trace --suite` traces each case (bench/trace/run.py: layer slices scaled to the
model) and writes bench/results/planner-traced.json and .md: for each case its overrides, the plan's
`peak_allocated_gib` (bench/planning.py's plan for the recipe's GPU, one process), the traced peak,
their ratio, the phase each peaks in, and both breakdowns. `--cpu-check` adds the tracer against a
real CPU run (bench/trace/cpu_check.py). The file keeps the cases it already has with --resume.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import json
import platform
from pathlib import Path
from typing import Any

from bench import HERE, REPO

RESULTS = "planner-traced"
TOLERANCE = 0.10  # traced within 10 % of planned

# Lean options, each on a base recipe: the option alone changes (quant nf4 and checkpointing on are
# the bases themselves). llama3.1-8b-24gb: micro-batch 2 (attention mask, memory-efficient SDPA);
# mistral-7b-12gb: micro-batch 1 (no mask, flash SDPA).
LEAN = {
    "precision.upcast_frozen=false": ["precision.upcast_frozen=false"],
    "trainer.activation_offloading=true": ["trainer.activation_offloading=true"],
    "trainer.activation_offload_stash=1": ["trainer.activation_offloading=true", "trainer.activation_offload_stash=1"],
    "data.padding_free=true": ["data.packing=true", "data.padding_free=true"],
    "quant=none": ["quant=none"],
    "trainer.gradient_checkpointing=false": ["trainer.gradient_checkpointing=false"],
}
LEAN_BASES = ("llama3.1-8b-24gb", "mistral-7b-12gb")
# trainer.tiled_mlp at long sequences: the 8B on 24 GB with unsloth's settings (LoRA r=32 on all 7
# linears, micro-batch 1) and the lean options on, where the MLP's intermediates would dominate
LONG = [
    "peft.r=32",
    "trainer.micro_batch_size=1",
    "precision.upcast_frozen=false",
    "trainer.activation_offloading=true",
]
TILED_SEQS = (32768, 65536)
# Objectives on the 8B base beyond their recipes (recipe llama3.1-8b-24gb-dpo traces DPO with the
# adapter-off reference forward, llama3.1-8b-24gb-grpo GRPO's sampling with beta 0): DPO with the
# reference's log-probs precomputed, no reference forward; KTO, its KL batch and reference forwards;
# GRPO with a reference forward (beta > 0)
OBJECTIVE_CASES = {
    "objective=dpo, precomputed reference": ["objective=dpo", "objective.precompute_ref_log_probs=true"],
    "objective=kto": ["objective=kto"],
    "objective=grpo, beta 0.04 (a reference forward)": [
        "objective=grpo",
        "objective.beta=0.04",
        "objective.num_generations=8",
        "objective.max_completion_length=1024",
        "trainer.seq_len=512",
    ],
}


# trainer.gradient_checkpointing=auto (the fewest first layers checkpointed that fit) and, with it,
# trainer.micro_batch_size=auto over 16 rows a step, on the 8B and 70B recipes (bench/trace/partial.py)
# (the 70B on 80 GB: on 48 GB its plan offloads layers, whose tracer slices one kind of GPU layer only)
AUTO_BASES = ("llama3.1-8b-24gb", "llama2-70b-a100")
AUTO_CASES = {
    "trainer.gradient_checkpointing=auto": ["trainer.gradient_checkpointing=auto"],
    "trainer.gradient_checkpointing=auto, trainer.micro_batch_size=auto": [
        "trainer.gradient_checkpointing=auto",
        "trainer.micro_batch_size=auto",
        "trainer.grad_accum=16",
    ],
}


class NotTraceable(Exception):
    """A case whose real code path cannot run a training step (recorded with the reason)."""


def single_gpu_recipes() -> list[str]:
    """Recipes whose hardware node declares one GPU."""
    import yaml

    out = []
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        hw = (yaml.safe_load(path.read_text()) or {}).get("hardware") or {}
        if int(hw.get("gpus", 0) or 0) == 1 and int(hw.get("nodes", 1) or 1) == 1:
            out.append(path.stem)
    return out


def cases() -> list[dict]:
    """Every case of the suite: name, kind, overrides."""
    out = [{"case": f"recipe {r}", "kind": "recipe", "overrides": [f"recipe={r}"]} for r in single_gpu_recipes()]
    for base in LEAN_BASES:
        out.append(
            {
                "case": f"{base} + quant=nf4, checkpointing on (the base)",
                "kind": "lean base",
                "overrides": [f"recipe={base}"],
            }
        )
        for name, extra in LEAN.items():
            out.append({"case": f"{base} + {name}", "kind": "lean", "overrides": [f"recipe={base}", *extra]})
    for seq in TILED_SEQS:
        out.append(
            {
                "case": f"llama3.1-8b-24gb + trainer.tiled_mlp=true at {seq:,} tokens, lean",
                "kind": "tiled mlp",
                "overrides": ["recipe=llama3.1-8b-24gb", *LONG, "trainer.tiled_mlp=true", f"trainer.seq_len={seq}"],
            }
        )
    for base in AUTO_BASES:
        for name, extra in AUTO_CASES.items():
            out.append({"case": f"{base} + {name}", "kind": "auto", "overrides": [f"recipe={base}", *extra]})
    for name, extra in OBJECTIVE_CASES.items():
        case = {
            "case": f"llama3.1-8b-24gb + {name}",
            "kind": "objective",
            "overrides": ["recipe=llama3.1-8b-24gb", *extra],
        }
        out.append(case)
    return _dedupe(out)


def _dedupe(items: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in items:
        key = tuple(c["overrides"])
        if key in seen:
            continue
        seen.add(key)
        out.append(c)
    return out


def _versions() -> dict:
    from importlib import metadata

    env = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    return env


def _machine() -> str:
    from bench.machine import cpu_cores, cpu_model_name

    return f"{cpu_model_name()}, {cpu_cores()} cores, no GPU (fake CUDA device)"


def _load(path: Path) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"cases": [], "cpu_check": None}


def run_suite(args: Any, command: str) -> None:
    out_dir = Path(args.results_dir or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{RESULTS}.json"
    res = _load(path) if args.resume else {"cases": [], "cpu_check": _load(path).get("cpu_check")}
    if args.suite:
        res["command"] = command
    res.update(
        {
            "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d"),
            "machine": _machine(),
            "environment": _versions(),
            "tolerance": TOLERANCE,
            "what": "traced: peak bytes of live tensors over the second of two optimizer steps (two micro-batches when the stack accumulates) on fake tensors "
            "(bench/trace); planned: plan.json's peak_allocated_gib for the recipe's GPU (bench/planning.py)",
        }
    )

    def selected(name: str) -> bool:
        return not args.only or any(fnmatch.fnmatch(name, g) for g in args.only.split(","))

    # --resume keeps what the file has; cases named by --only are traced again
    done = {
        tuple(c["overrides"])
        for c in res["cases"]
        if c.get("traced_gib") is not None and not (args.only and selected(c["case"]))
    }
    log_root = REPO / "runs" / "bench" / "trace"
    if args.suite:
        for case in cases():
            if not selected(case["case"]):
                continue
            if tuple(case["overrides"]) in done:
                continue
            print(f"tracing {case['case']} ...", flush=True)
            entry = {**_trace_case(case, log_root), "command": command}  # each case's own: --resume keeps older ones
            res["cases"] = [c for c in res["cases"] if tuple(c["overrides"]) != tuple(case["overrides"])] + [entry]
            _write(path, res)
            print(f"  {_line(entry)}", flush=True)
    if args.cpu_check:
        from bench.trace.cpu_check import cpu_check

        res["cpu_check"] = {"command": command, **cpu_check(log_root / "cpu-check")}
        _write(path, res)
    print(f"wrote {path} and {path.with_suffix('.md')}")


def _trace_case(case: dict, log_root: Path) -> dict:
    """One case of the suite: its plan for the recipe's hardware, its trace, the comparison."""
    from bench.trace.offload import offloaded_counts, trace_offloaded
    from bench.trace.run import compare, plan_for, recipe_gpus, trace_stack

    entry = dict(case)
    plan: dict = {}
    try:
        gpus = recipe_gpus(case["overrides"])
        plan = plan_for(case["overrides"], gpus)
        log_dir = log_root / _slug(case["case"])
        if offloaded_counts(plan)[1]:
            if "batch_auto" in plan:
                raise NotTraceable("the autos with offloaded layers: the offload tracer slices one kind of GPU layer")
            result = trace_offloaded(case["overrides"], plan, log_dir)
        else:
            result = trace_stack(case["overrides"], log_dir=log_dir)
        cmp = compare(result, plan, "cuda:0")
        entry.update(
            {
                "planned_gib": cmp["planned_gib"],
                "traced_gib": cmp["traced_gib"],
                "ratio": cmp["ratio"],
                "within": abs(cmp["ratio"] - 1) <= TOLERANCE if cmp["ratio"] else None,
                "planned_peak_phase": cmp["planned_peak_phase"],
                "traced_peak_phase": cmp["traced_peak_phase"],
                "gpu_gib": round(gpus[0] / 2**30, 1) if gpus else None,
                "components": cmp["components"],
                "phases": cmp["phases"],
                "host": {d: round(v / 2**30, 3) for d, v in result["peak"].items() if d != "cuda:0"},
                "layers": result.get("layers"),
                "layers_traced": result.get("layers_traced"),
                "trace_s": result.get("trace_s"),
                "kernels": result.get("kernels"),
                **({"offloaded_layers": result["offloaded_layers"]} if result.get("offloaded_layers") else {}),
            }
        )
    except NotTraceable as err:
        entry.update({"traced_gib": None, "planned_gib": plan.get("peak_allocated_gib"), "error": str(err)})
    except Exception as err:  # noqa: BLE001 - a case that cannot be traced is recorded, the suite goes on
        entry.update({"traced_gib": None, "error": str(err).strip().splitlines()[0][:300]})
    return entry


def _slug(text: str) -> str:
    import re

    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def _line(e: dict) -> str:
    if e.get("traced_gib") is None:
        return f"{e['case']}: not traced ({e.get('error')})"
    return f"{e['case']}: planned {e['planned_gib']:.2f} GiB, traced {e['traced_gib']:.2f} GiB, ratio {e['ratio']:.3f}"


def _write(path: Path, res: dict) -> None:
    order = {tuple(c["overrides"]): i for i, c in enumerate(cases())}
    res["cases"].sort(key=lambda c: order.get(tuple(c["overrides"]), 10**6))
    path.write_text(json.dumps(res, indent=1) + "\n")
    path.with_suffix(".md").write_text(render_md(res))


def render_md(res: dict) -> str:
    lines = [
        "# Traced memory vs the plan",
        "",
        f"{res.get('date')} on {res.get('machine')}; `{res.get('command')}`.",
        "",
        "Traced: the peak of live tensor bytes over the second of two optimizer steps (two micro-batches of "
        "gradient accumulation when the stack accumulates), the stack's real code on fake tensors of a fake CUDA "
        "device (`bench/trace`, torch's MemTracker; models over 4 layers traced as two layer slices scaled to all "
        "layers). Planned: `peak_allocated_gib` of the plan for the recipe's hardware, one process. Neither "
        "includes the CUDA context, cuBLAS workspaces or the caching allocator's slack (the plan adds those to "
        "`peak_gib`), nor scratch a kernel allocates inside itself (flash-attention backward's fp32 accumulator).",
        "",
        "| case | planned GiB | traced GiB | ratio | plan peaks in | trace peaks in |",
        "|---|---:|---:|---:|---|---|",
    ]
    for c in res.get("cases", []):
        if c.get("traced_gib") is None:
            planned = f"{c['planned_gib']:.2f}" if c.get("planned_gib") is not None else "-"
            lines.append(f"| {c['case']} | {planned} | - | - | not traced: {c.get('error', '')} | |")
            continue
        lines.append(
            f"| {c['case']} | {c['planned_gib']:.2f} | {c['traced_gib']:.2f} | {c['ratio']:.3f} | "
            f"{c.get('planned_peak_phase')} | {c.get('traced_peak_phase')} |"
        )
    lines += _offload_gaps(res.get("cases", []))
    cpu = res.get("cpu_check")
    if cpu:
        lines += ["", "## The tracer vs a real CPU run", "", f"`{cpu.get('command')}`: " + cpu.get("summary", ""), ""]
        lines += ["| component at the peak (GiB) | real run | tracer (fake) |", "|---|---:|---:|"]
        for name, row in (cpu.get("components") or {}).items():
            lines.append(f"| {name} | {row['real_gib']:.4f} | {row['fake_gib']:.4f} |")
        repro = cpu.get("offload_repro") or {}
        if repro:
            lines += [
                "",
                f"Offloaded layers ({repro.get('what')}): the offloaded layer's LoRA adapters are on "
                f"`{repro.get('adapter_device')}`; backward {'runs' if repro.get('backward_ok') else 'fails: ' + str(repro.get('error'))}.",
            ]
    return "\n".join(lines) + "\n"


def _offload_gaps(cases: list[dict]) -> list[str]:
    """For the cases with offloaded layers: the components where trace and plan part by > 0.05 GiB."""
    out = []
    for c in cases:
        if not c.get("offloaded_layers") or c.get("traced_gib") is None:
            continue
        if not out:
            out += ["", "## Offloaded layers", "", OFFLOAD_NOTE, ""]
        out += [
            f"{c['case']} ({c['offloaded_layers']} decoder layers offloaded): "
            + ", ".join(
                f"{name} traced {row['traced_gib']:.3f} vs planned {row['planned_gib']:.3f} GiB"
                for name, row in c.get("components", {}).items()
                if abs(row["traced_gib"] - row["planned_gib"]) > 0.05
            )
            + ".",
            "",
        ]
        if c.get("note"):
            out += [c["note"], ""]
    return out


OFFLOAD_NOTE = (
    "Traced as three layer slices (k GPU + m offloaded layers, one more of each) extrapolated in both counts "
    "(bench/trace/offload.py), layers on disk as layers in host RAM (the GPU sees the same onload). The loader "
    "keeps offloaded layers unquantized (fp32 after k-bit prep), onloads each linear's weight to the GPU for its "
    "forward and recompute, and keeps the adapters of offloaded layers on the GPU with their gradients and "
    "optimizer state (qlora_recipes/modeling.py). The plan does the same (planner/single.py): those adapters, "
    "gradients and optimizer state on the GPU, and as offload_staging the largest offloaded linear in fp32 plus the "
    "compute-dtype copies autocast makes of an offloaded layer's weights, which autograd keeps for its backward; "
    "the trace books part of these under layer_working, hence the component differences below."
)
