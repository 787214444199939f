"""The longest context per card, ours beside unsloth's published figures:
bench/results/longest-context.json and .md.

    python -m bench longest-context                  # plan every case (seconds) -> the json and md
    python -m bench longest-context --trace          # also trace each case at its length (minutes each)
    python -m bench longest-context --extra trainer.tiled_mlp=true   # one more lean option, every case

Each case is one `qlora plan ... --longest-seq` command at unsloth's benchmark settings (4-bit, LoRA
r=32 on all 7 linear layers, micro-batch 1) plus our lean options (LEAN_OPTIONS: a new lean option is
one more entry there, or --extra), the card declared with --gpus and the host RAM stated. The command
is recorded as run; `longest_seq` is what it printed (tests/unit/test_longest_context_table.py re-runs
two). `planned_gib` is the plan's device peak at that length (CUDA context and allocator reserve in),
against `budget_gib`; `traced_gib` is `python -m bench trace` at that length (fake tensors: the
training step's live bytes), beside the plan's allocated training peak.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench import REPO

RESULTS = REPO / "bench" / "results" / "longest-context.json"
HOST_RAM = "128GB"
# unsloth's benchmark settings: Llama-3.1-8B / Llama-3.3-70B 4-bit, LoRA r=32 on q,k,v,o,gate,up,down,
# batch 1 (trainer=standard: micro-batch 1; peft's default target is all-linear: the 7 linears). Their
# figures are training alone: no generation metric (data.metric=null), whose KV cache a plan without
# the data bounds by a prompt as long as the context; the eval split's loss stays.
# No LoRA dropout: unsloth's FastLanguageModel.get_peft_model defaults to lora_dropout=0 (its fused
# LoRA kernels' case), and its benchmarks state no other.
UNSLOTH_SETTINGS = ("trainer=standard", "peft.r=32", "peft.dropout=0", "trainer.micro_batch_size=1", "data.metric=null")
# The rows were planned and traced with float32 adapters, the default until peft.adapter_dtype=auto
# (bf16 adapters under bf16 compute, which plan a few per cent longer): pinned until they are re-traced.
ADAPTERS = ("peft.adapter_dtype=float32",)
# our lean options; extend this list (or pass --extra) when a new one lands
LEAN_OPTIONS = (
    "precision.upcast_frozen=false",
    "trainer.activation_offloading=true",
    "trainer.activation_offload_stash=1",
    "trainer.tiled_mlp=true",
    "trainer.lean_rmsnorm=true",
    "offload.embeddings=true",
)
UNSLOTH_8B = "https://unsloth.ai/docs/basics/unsloth-benchmarks"
UNSLOTH_70B = "https://unsloth.ai/blog/llama3-3"
UNSLOTH_GPT_OSS = "https://unsloth.ai/docs/models/gpt-oss-how-to-run-and-fine-tune/long-context-gpt-oss-training"
# (model option, card GB, unsloth's longest context, its source); None where unsloth publishes no figure
# for the card (the MoE cases: the cards of our recipes, and 80 GB)
UNSLOTH = (
    ("llama3.1-8b", 8, 2972, UNSLOTH_8B),
    ("llama3.1-8b", 12, 21848, UNSLOTH_8B),
    ("llama3.1-8b", 16, 40724, UNSLOTH_8B),
    ("llama3.1-8b", 24, 78475, UNSLOTH_8B),
    ("llama3.1-8b", 40, 153977, UNSLOTH_8B),
    ("llama3.1-8b", 48, 191728, UNSLOTH_8B),
    ("llama3.1-8b", 80, 342733, UNSLOTH_8B),
    ("llama3.1-70b", 48, 12106, UNSLOTH_70B),  # measured on Llama-3.3-70B: the same shape
    ("llama3.1-70b", 80, 89389, UNSLOTH_70B),
    ("gpt-oss-20b", 16, None, None),  # recipes/gpt-oss-20b-16gb.yaml's card
    ("gpt-oss-20b", 80, 81000, UNSLOTH_GPT_OSS),
    ("qwen3-30b-a3b", 24, None, None),  # recipes/qwen3-30b-a3b-24gb.yaml's card
    ("qwen3-30b-a3b", 80, None, None),
)
SOURCE_NOTE = {
    UNSLOTH_8B: "unsloth docs, Unsloth Benchmarks: 'Llama 3.1 (8B) max. context length' (Llama 3.1 8B Instruct, "
    "4-bit QLoRA on all linear layers, rank 32, batch 1, sequences padded to length)",
    UNSLOTH_70B: "unsloth blog, Llama 3.3: 'Llama 3.3 (70B) max. context length' (80GB A100, 4-bit QLoRA on all "
    "linear layers, rank 32, batch 1, sequences padded to length)",
    UNSLOTH_GPT_OSS: "unsloth docs, Long Context gpt-oss Training: 'a single 80GB VRAM H100 can handle up to 81K "
    "context length with QLoRA' (gpt-oss-20b, Unsloth Flex Attention; rank and batch not stated)",
}
# Per case, what the length asks for beyond the lean options: RoPE scaling where unsloth's figure or
# ours is past Llama-3.1's 131,072 positions (yarn x4: 524,288), and pageable host copies where pinned ones,
# each rounded up to a power of two, would outgrow the declared host RAM first. The 70B on 48 GB: its
# 4-bit weights leave about 4 GiB to train in, so MLP tiles of 1,024 tokens (the auto tile, hidden_size
# = 8,192 tokens, would leave a 12k sequence in two tiles) and the adapters in bf16 as the QLoRA paper
# and TRL train them (1.5 GiB of fp32 weights and gradients less; small updates round away).
ROPE_X4 = "model.rope_scaling={rope_type:yarn,factor:4}"
PAGEABLE = "trainer.activation_offload_pinned=false"
CASE_OPTIONS = {
    ("llama3.1-8b", 24): (ROPE_X4,),  # its plan outgrows Llama-3.1's 131,072 positions
    ("llama3.1-8b", 40): (ROPE_X4,),
    ("llama3.1-8b", 48): (ROPE_X4,),
    ("llama3.1-8b", 80): (ROPE_X4, PAGEABLE),
    ("llama3.1-70b", 48): ("trainer.tiled_mlp_tile=1024", "peft.adapter_dtype=bfloat16"),
    ("llama3.1-70b", 80): (PAGEABLE,),
}
# gpt-oss trains with flex attention, as its recipe does (eager keeps seq^2 scores per layer; sdpa has no
# sinks); Qwen3-30B-A3B past its 40,960 positions with YaRN x4 (163,840), the scaling its model card gives
FLEX = "model.attn_implementation=flex_attention"
CASE_OPTIONS.update(
    {
        ("gpt-oss-20b", 16): (FLEX,),
        ("gpt-oss-20b", 80): (FLEX,),
        ("qwen3-30b-a3b", 80): (ROPE_X4,),
    }
)
# Lean options a model's family refuses (config checks): gpt-oss's RMSNorm is not Llama's form
NOT_FOR = {
    "gpt-oss-20b": ("trainer.lean_rmsnorm=true",),
}
PRINTED = re.compile(r"longest sequence that fits .*: (?:trainer\.seq_len=(\d+)|none)")


def overrides(model: str, card_gb: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The stack of one case: unsloth's settings, our lean options, the case's own and any extra ones."""
    lean = [o for o in LEAN_OPTIONS if o not in NOT_FOR.get(model, ())]
    return [f"model={model}", *UNSLOTH_SETTINGS, *ADAPTERS, *lean, *CASE_OPTIONS.get((model, card_gb), ()), *extra]


def command(model: str, card_gb: int, extra: tuple[str, ...] = ()) -> str:
    """The `qlora plan` command that prints the case's longest_seq."""
    ov = " ".join(shlex.quote(o) for o in overrides(model, card_gb, extra))
    return f"qlora plan {ov} --gpus {card_gb}GB --host-ram {HOST_RAM} --longest-seq"


def cases(extra: tuple[str, ...] = ()) -> list[dict]:
    """Every case to measure: model, card, command, unsloth's figure and source (no result yet)."""
    return [
        {
            "model": model,
            "card_gb": gb,
            "command": command(model, gb, extra),
            "overrides": overrides(model, gb, extra),
            "unsloth_seq": seq,
            "source": src,
        }
        for model, gb, seq, src in UNSLOTH
    ]


def run_command(cmd: str, cwd: Path = REPO) -> int | None:
    """Run a recorded `qlora plan ... --longest-seq` command (as `python -m qlora_recipes plan`, the
    same entry point) in a scratch run dir; the longest_seq it prints (None: not even 64 tokens)."""
    argv = shlex.split(cmd)
    assert argv[:2] == ["qlora", "plan"], cmd
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", *argv[2:], "hydra.run.dir=/tmp/qlora-longest-context"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    found = PRINTED.search(proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{cmd}: rc {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return int(found.group(1)) if found.group(1) else None


def planned(case: dict, seq: int) -> dict:
    """The plan of a case at `seq` tokens on its card: device peak, allocated peak, budget (GiB)."""
    from bench.suite import compose
    from qlora_recipes import planner
    from qlora_recipes.config.devices import parse_gpus
    from qlora_recipes.units import GiB, parse_bounded_size

    cfg = compose([*case["overrides"], f"trainer.seq_len={seq}"])
    gpus = parse_gpus(f"{case['card_gb']}GB")
    host = parse_bounded_size(HOST_RAM, "--host-ram", GiB, 2**46)
    plan = planner.plan(cfg, gpus=gpus, host_ram=host, ladder=False)
    gpu = next(d for d in plan["devices"] if d["device"] == "cuda:0")
    by_phase = gpu.get("peak_by_phase") or {}
    return {
        "planned_gib": round(gpu["peak"] / GiB, 2),
        "planned_allocated_gib": round(gpu["peak_allocated"] / GiB, 2),
        "budget_gib": round(gpu["budget"] / GiB, 2),
        "peak_phase": gpu["peak_phase"],
        "phases_gib": {k: round(v / GiB, 2) for k, v in by_phase.items()},
        "host_ram_gib": round(host / GiB, 1),
    }


def traced(case: dict, seq: int, log_dir: Path | None = None) -> dict:
    """`python -m bench trace` of a case at `seq` tokens beside its plan: traced peak (fake tensors,
    two layer slices scaled to all layers) and the plan's allocated training peak."""
    from bench.trace.run import compare, plan_for, trace_stack
    from qlora_recipes.config.devices import parse_gpus

    ov = [*case["overrides"], f"trainer.seq_len={seq}"]
    result = trace_stack(ov, device="cuda", layers="auto", log_dir=log_dir)
    c = compare(result, plan_for(ov, parse_gpus(f"{case['card_gb']}GB")), "cuda:0")
    ratio = round(c["traced_gib"] / c["planned_train_gib"], 3) if c.get("planned_train_gib") else None
    return {
        "traced_gib": c["traced_gib"],
        "traced_phase": c["traced_peak_phase"],
        "planned_train_gib": c["planned_train_gib"],
        "traced_over_planned_train": ratio,
        "trace_command": "python -m bench trace "
        + " ".join(shlex.quote(o) for o in ov)
        + f" --gpus {case['card_gb']}GB",
        "trace_s": result.get("trace_s"),
    }


def measure(case: dict, trace: bool, previous: dict | None) -> dict:
    """One case: its command run, the plan at the printed length, and its trace (or the recorded
    one when the length is unchanged and --trace is not given)."""
    seq = run_command(case["command"])
    out = {**case, "longest_seq": seq}
    out.pop("overrides")
    if seq is None:
        return {**out, "traced_gib": None}
    out.update(planned(case, seq))
    out["capped_by_positions"] = seq == _positions(case)
    out["vs_unsloth"] = round(seq / case["unsloth_seq"], 3) if case["unsloth_seq"] else None
    keep = previous and previous.get("longest_seq") == seq and previous.get("command") == case["command"]
    if trace:
        out.update(traced(case, seq))
    elif keep and previous.get("traced_gib") is not None:
        out.update({k: previous[k] for k in _TRACE_KEYS if k in previous})
    else:
        out["traced_gib"] = None
    return out


_TRACE_KEYS = (
    "traced_gib",
    "traced_phase",
    "planned_train_gib",
    "traced_over_planned_train",
    "trace_command",
    "trace_s",
)


def _positions(case: dict) -> int:
    from bench.suite import compose
    from qlora_recipes.planner.seqlen import positions

    return positions(compose(case["overrides"]).model)


def _seq(n: int | None) -> str:
    return f"{n:,}" if n else "–"  # unsloth publishes no figure for the card


def render(doc: dict) -> str:
    """The markdown table of a results document."""
    lines = [
        "# Longest context per card: ours vs unsloth",
        "",
        f"Regenerate: `{doc['regenerate']}` (planning: seconds; `--trace` adds a trace per case). "
        f"Host RAM {HOST_RAM} declared. Lean options: `{' '.join(doc['lean_options'])}`.",
        "",
        "| model | card | ours (longest_seq) | unsloth | ours / unsloth | planned GiB / budget | traced GiB (plan's train peak) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in doc["cases"]:
        ours = f"{c['longest_seq']:,}" if c["longest_seq"] else "none"
        if c.get("capped_by_positions"):
            ours += " (model's positions)"
        plan = f"{c['planned_gib']:.2f} / {c['budget_gib']:.2f}" if c.get("planned_gib") is not None else "-"
        tr = (
            f"{c['traced_gib']:.2f} ({c['planned_train_gib']:.2f}, {c['traced_over_planned_train']:.3f})"
            if c.get("traced_gib") is not None
            else "not traced"
        )
        ratio = f"{c['vs_unsloth']:.2f}" if c.get("vs_unsloth") else "-"
        lines.append(
            f"| {c['model']} | {c['card_gb']} GB | {ours} | {_seq(c['unsloth_seq'])} | {ratio} | {plan} | {tr} |"
        )
    lines += ["", "Commands (each prints its `longest_seq`):", ""]
    lines += [f"- {c['model']} {c['card_gb']} GB: `{c['command']}`" for c in doc["cases"]]
    lines += ["", "Sources of unsloth's figures:", ""]
    lines += [f"- <{url}>: {note}" for url, note in SOURCE_NOTE.items()]
    for note in doc.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


# a small Llama shape where attention is a large share of a layer: eager vs sdpa traced against the plan
SMALL_SHAPE = (
    "model=llama3.1-8b",
    "model.num_layers=2",
    "model.hidden_size=512",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "model.intermediate_size=1024",
    "model.vocab_size=1024",
    "trainer=standard",
)
ATTENTION_LENGTHS = (1024, 2048, 4096)
ATTENTION_RESULTS = REPO / "bench" / "results" / "attention-backends.json"


def attention_check(out: Path = ATTENTION_RESULTS) -> dict:
    """Eager vs sdpa on SMALL_SHAPE at ATTENTION_LENGTHS: traced training peak beside the plan's."""
    from bench.trace.run import compare, plan_for, trace_stack
    from qlora_recipes.units import GiB

    rows = []
    for attn in ("sdpa", "eager"):
        for seq in ATTENTION_LENGTHS:
            ov = [*SMALL_SHAPE, f"model.attn_implementation={attn}", f"trainer.seq_len={seq}"]
            result = trace_stack(ov, device="cuda", layers="full")
            c = compare(result, plan_for(ov, [80 * GiB]), "cuda:0")
            rows.append(
                {
                    "attention": attn,
                    "seq_len": seq,
                    "traced_gib": c["traced_gib"],
                    "planned_train_gib": c["planned_train_gib"],
                    "ratio": round(c["traced_gib"] / c["planned_train_gib"], 3),
                    "traced_phase": c["traced_peak_phase"],
                    "command": "python -m bench trace " + " ".join(ov) + " --gpus 80GB",
                }
            )
            print(rows[-1], flush=True)
    doc = {"shape": list(SMALL_SHAPE), "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    lines = [
        "# Attention memory per backend, traced vs planned",
        "",
        "`python -m bench longest-context --attention-check`: a small Llama shape "
        f"(`{' '.join(SMALL_SHAPE)}`), one training step on fake CUDA tensors beside the plan's training peak.",
        "",
        "| attention | seq_len | traced GiB | planned GiB | traced / planned | peak phase |",
        "|---|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['attention']} | {r['seq_len']:,} | {r['traced_gib']:.3f} | {r['planned_train_gib']:.3f} | "
        f"{r['ratio']:.3f} | {r['traced_phase']} |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return doc


DOCS = (REPO / "docs" / "memory-and-planner.md", REPO / "README.md")
BEGIN, END = "<!-- BEGIN longest-context -->", "<!-- END longest-context -->"


def compact(doc: dict) -> str:
    """The table for the README and the docs: one column per card, ours beside unsloth's."""
    rows = {}
    for c in doc["cases"]:
        rows.setdefault(c["model"], []).append(c)
    lines = []
    for model, cs in rows.items():
        lines += [
            f"| {model} | " + " | ".join(f"{c['card_gb']} GB" for c in cs) + " |",
            "|---|" + "---:|" * len(cs),
            "| unsloth | " + " | ".join(_seq(c["unsloth_seq"]) for c in cs) + " |",
            "| ours | "
            + " | ".join(
                (f"{c['longest_seq']:,}" if c["longest_seq"] else "none")
                + ("*" if c.get("capped_by_positions") else "")
                for c in cs
            )
            + " |",
            "",
        ]
    lines.append(
        "Ours: the `qlora plan ... --longest-seq` command of each case in "
        "[bench/results/longest-context.md](bench/results/longest-context.md) (unsloth's settings: 4-bit, LoRA r=32 "
        f"on all 7 linears, no LoRA dropout, batch 1; plus `{' '.join(doc['lean_options'])}`; past 131,072 tokens "
        f"`{ROPE_X4}`, on 80 GB `{PAGEABLE}`, and on 70B at 48 GB "
        f"`{' '.join(CASE_OPTIONS[('llama3.1-70b', 48)])}`; gpt-oss without the lean option its family "
        f"refuses (lean_rmsnorm: its RMSNorm is not Llama's form), gpt-oss with `{FLEX}`, "
        f"Qwen3-30B-A3B past its 40,960 positions `{ROPE_X4}`); * the model's positions. "
        f"Unsloth: [docs]({UNSLOTH_8B}) (8B), [Llama 3.3 blog]({UNSLOTH_70B}) (70B, Llama-3.3 shape), "
        f"[gpt-oss docs]({UNSLOTH_GPT_OSS}) (gpt-oss-20b, 80 GB); – none published for the card."
    )
    return "\n".join(lines)


def update_docs(doc: dict, pages: tuple[Path, ...] = DOCS) -> None:
    """Replace the table between the markers of each page that has them."""
    for page in pages:
        text = page.read_text()
        if BEGIN not in text:
            continue
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        table = compact(doc)
        if page.parent.name == "docs":
            table = table.replace("](bench/", "](../bench/")
        page.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main(argv: list[str], prog: str = "python -m bench longest-context") -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--extra", action="append", default=[], help="one more override for every case (repeatable)")
    p.add_argument("--trace", action="store_true", help="trace each case at its length (minutes per case)")
    p.add_argument("--only", help="comma-separated model@GB cases to (re)measure, e.g. llama3.1-8b@24")
    p.add_argument("--out", default=str(RESULTS), help="the results json (the md goes beside it)")
    p.add_argument("--attention-check", action="store_true", help="eager vs sdpa traced on a small shape instead")
    args = p.parse_args(argv)
    if args.attention_check:
        attention_check()
        return
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    recorded = {(c["model"], c["card_gb"]): c for c in old.get("cases", [])}
    only = set(args.only.split(",")) if args.only else None
    results = []
    for case in cases(tuple(args.extra)):
        key = (case["model"], case["card_gb"])
        if only is not None and f"{key[0]}@{key[1]}" not in only and key in recorded:
            results.append(recorded[key])
            continue
        print(f"{key[0]} {key[1]} GB: {case['command']}", flush=True)
        results.append(measure(case, args.trace, recorded.get(key)))
        print(f"  longest_seq {results[-1]['longest_seq']}, traced {results[-1].get('traced_gib')}", flush=True)
    doc = {
        # the whole table's command: --only, --trace and --out re-measure or move it, its rows stay the same
        "regenerate": " ".join([prog, *(shlex.quote(f"--extra={e}") for e in args.extra)]),
        "lean_options": [*LEAN_OPTIONS, *args.extra],
        "unsloth_settings": list(UNSLOTH_SETTINGS),
        "host_ram": HOST_RAM,
        "sources": SOURCE_NOTE,
        "notes": old.get("notes", []),
        "cases": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(doc))
    if out.resolve() == RESULTS.resolve():
        update_docs(doc)
    print(f"wrote {out} and {out.with_suffix('.md')}")
