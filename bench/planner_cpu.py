"""The planner against the CPU: planned vs measured peak RSS of real training runs.

    python -m bench planner-cpu                 # make bench-planner-cpu; about an hour on 2 cores
    python -m bench planner-cpu --only 'llama-50m*' --resume

Builds models of about 1 M, 50 M, 150 M, 300 M and 600 M parameters locally (random weights, bf16
safetensors; Llama, and Qwen2 as the second family: q/k/v biases, tied embeddings, a 152k
vocabulary), then runs each through several stacks (quantization x optimizer x checkpointing x
upcast_frozen x batch/seq, some with an eval phase), and DPO, KTO and GRPO on two of them
(OBJECTIVE_STACKS: pairs made from the text rows, chosen and rejected in one forward, the reference
forward beside; KTO's KL batch; GRPO's sampling of its completions from prompt rows). Every case is a fresh `python train.py`
process of two optimizer steps (so the optimizer state is live); its `metrics.json` gives the
measured peak (peak.py: the process RSS sampled from the run's start, loading included) and the
planned peak of the same quantity (the plan's cpu device). (The child's ru_maxrss is no check: a
forked child starts with the harness's RSS, and the harness holds the models it has built.) Results: bench/results/planner-cpu.json (+ .md), each case with its
overrides, planned_gib, measured_gib and their ratio; the goal is every case within 10 %. On a GPU
the same runs measure torch.cuda.max_memory_allocated against the plan's peak_allocated_gib.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import REPO
from bench.models import write_text_data, write_tokenizer
from bench.planner_suite import TOLERANCE, collect, in_suite_order, parser, suite_start, worst_ratio
from bench.planner_suite import write_results as write_results_files

RESULTS = REPO / "bench" / "results" / "planner-cpu"

# name -> (family, hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings)
MODELS = {
    "llama-1m": ("llama", 64, 2, 4, 2, 176, 4000, False),
    "llama-50m": ("llama", 512, 8, 8, 4, 1376, 32000, False),
    "llama-150m": ("llama", 768, 12, 12, 4, 2048, 32000, False),
    "llama-300m": ("llama", 1024, 16, 16, 8, 2816, 32000, False),
    "llama-600m": ("llama", 1536, 16, 12, 4, 4096, 32000, False),
    "qwen2-500m": ("qwen2", 896, 24, 14, 2, 4864, 151936, True),  # Qwen2.5-0.5B's shape
    # one model of each further family the planner knows, through the first stack only (FAMILY_MODELS)
    "qwen3-50m": ("qwen3", 512, 8, 8, 4, 1376, 32000, False),
    "qwen3-moe-60m": ("qwen3_moe", 512, 4, 8, 4, 1376, 32000, False),
    "gpt-oss-60m": ("gpt_oss", 512, 4, 8, 4, 512, 32000, False),
    "gemma3-50m": ("gemma3_text", 512, 8, 8, 4, 1376, 32000, True),
    "smollm3-50m": ("smollm3", 512, 8, 8, 4, 1376, 32000, True),
    "qwen3.5-50m": ("qwen3_5_text", 512, 8, 8, 4, 1376, 32000, True),
    "gemma4-50m": ("gemma4_text", 512, 8, 8, 4, 1376, 32000, True),
    "llama4-60m": ("llama4_text", 512, 4, 8, 4, 512, 32000, False),
}
# What those configs set beyond the shape: head_dim where the class's default is not hidden / heads,
# the experts (Qwen3-MoE: 16 of 256-wide, 4 a token; gpt-oss: 8 of 512-wide, 2 a token, attention sinks
# and bias, a sliding layer beside each full one), Gemma 3's local layers, Qwen3.5's Gated DeltaNet layers
# (three linear-attention layers to a full one, as its checkpoints interleave them), Gemma 4's per-layer
# input embeddings and wider global heads, and Llama 4's experts (8 of 512-wide, 1 a token, and a shared
# one) every second layer, dense MLPs (intermediate_size_mlp) between them, chunked local attention
FAMILY_CONFIG = {
    "qwen3-50m": {"head_dim": 64},
    "qwen3-moe-60m": {"head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256},
    "gpt-oss-60m": {
        "head_dim": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "gemma3-50m": {"head_dim": 64, "sliding_window": 128},
    "smollm3-50m": {},
    "qwen3.5-50m": {
        "head_dim": 64,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
    "gemma4-50m": {
        "head_dim": 64,
        "global_head_dim": 128,
        "sliding_window": 128,
        "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2,
        "hidden_size_per_layer_input": 64,
        "vocab_size_per_layer_input": 32000,
    },
    "llama4-60m": {
        "head_dim": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 1376,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 128,
    },
}
FAMILY_MODELS = tuple(FAMILY_CONFIG)
# A vision-language model: bench/vlm_model.py's LLaVA (a 12-layer CLIP-B/16 tower at 224 px, 196 image
# tokens a row) around the language model of these figures, trained on its image rows
VLM_MODELS = {"llava-50m-clip12": "llama-50m"}
VLM_STACKS = [("nf4-paged8bit-images", [])]

# The stacks every model runs: (name, overrides). Batch x seq is per model size (below).
STACKS = [
    ("nf4-paged8bit", []),
    ("nf4-adamw-nockpt", ["optim=adamw", "trainer.gradient_checkpointing=false"]),
    ("fp4-adamw8bit-lean", ["quant=fp4", "optim=adamw8bit", "precision.upcast_frozen=false"]),
    ("int8-paged8bit", ["quant=int8"]),
    ("none-adamw", ["quant=none", "optim=adamw"]),
    ("nf4-long-eval", ["+shape=long", "data.eval_fraction=0.1", "trainer.eval_batch_size=2"]),
]
# Objectives other than SFT, each on models of two sizes with the first stack (nf4-paged8bit): DPO
# puts a pair's two answers through one forward and the reference's forward beside the policy's, on
# preference pairs made from the model's text rows (`preference_pairs`).
# KTO the same pairs as unpaired rows with its KL batch; GRPO samples 4 completions of 32 tokens per
# prompt (`prompt_rows`: the text rows' first words, scored by char_match against an answer).
OBJECTIVE_STACKS = [
    ("nf4-dpo", ["objective=dpo"], ("llama-50m", "llama-300m"), "pairs"),
    ("nf4-kto", ["objective=kto"], ("llama-50m", "llama-300m"), "pairs"),
    (
        "nf4-grpo",
        ["objective=grpo", "objective.max_completion_length=32", "objective.rewards=[char_match]"],
        ("llama-50m", "llama-300m"),
        "prompts",
    ),
]
SMALL = {"default": (4, 256), "long": (1, 1024)}  # micro batch, seq_len
LARGE = {"default": (2, 128), "long": (1, 512)}


def shapes_for(model: str) -> dict:
    return LARGE if model.endswith(("300m", "500m", "600m")) else SMALL


def cases() -> list[dict]:
    out = []
    for model in MODELS:
        shapes = shapes_for(model)
        for stack, overrides in STACKS[:1] if model in FAMILY_MODELS else STACKS:
            shape = "long" if "+shape=long" in overrides else "default"
            b, s = shapes[shape]
            ov = [o for o in overrides if not o.startswith("+shape=")]
            ov += [f"trainer.micro_batch_size={b}", f"trainer.seq_len={s}"]
            if model in FAMILY_MODELS:  # fp32: a CPU without native bf16 emulates its matmuls (minutes a step)
                ov.append("precision=fp32")
            out.append({"name": f"{model}/{stack}", "model": model, "stack": stack, "overrides": ov})
    for stack, overrides, models, data in OBJECTIVE_STACKS:
        for model in models:
            b, s = shapes_for(model)["default"]
            grpo = data == "prompts"  # the prompt's bound (its sequences: + 32), groups that fill a micro-batch
            groups = [f"objective.num_generations={b}"] if grpo else []
            ov = [*overrides, *groups, f"trainer.micro_batch_size={b}", f"trainer.seq_len={s - 32 if grpo else s}"]
            out.append({"name": f"{model}/{stack}", "model": model, "stack": stack, "overrides": ov, "data": data})
    for model in VLM_MODELS:
        for stack, overrides in VLM_STACKS:
            ov = [*overrides, "trainer.micro_batch_size=4", "trainer.seq_len=256"]
            out.append({"name": f"{model}/{stack}", "model": model, "stack": stack, "overrides": ov, "data": "images"})
    return out


def data_overrides(case: dict, model_dir: Path) -> list[str]:
    """A case's data when it is not the model's text rows: preference pairs (DPO, KTO), prompt rows (GRPO)."""
    if case.get("data") == "pairs":
        return [f"data.path={model_dir / 'pairs.jsonl'}", "data.format=preference"]
    if case.get("data") == "prompts":
        return [f"data.path={prompts_file(model_dir, _prompt_bound(case))}", "data.format=prompt"]
    if case.get("data") == "images":
        return [f"data.path={model_dir / 'rows.jsonl'}", "data.format=messages"]
    return []


def _prompt_bound(case: dict) -> int:
    return int(next(o for o in case["overrides"] if o.startswith("trainer.seq_len=")).split("=")[1])


def prompts_file(model_dir: Path, bound: int) -> Path:
    return model_dir / f"prompts-{bound}.jsonl"


def prompt_rows(model_dir: Path, bound: int) -> Path:
    """prompts-BOUND.jsonl beside the model's text rows: each row's first words a prompt that fills the
    case's bound (the word-level tokenizer: a token a word, and BOS), as the text rows fill seq_len -
    a longer prompt would be dropped, not truncated - and its next word the answer."""
    out = prompts_file(model_dir, bound)
    if not out.is_file():
        n = bound - 2
        with open(out, "w") as f:
            for line in (model_dir / "data.jsonl").read_text().splitlines():
                words = json.loads(line)["text"].split()
                f.write(json.dumps({"prompt": " ".join(words[:n]), "answer": words[n]}) + "\n")
    return out


def preference_pairs(model_dir: Path) -> Path:
    """pairs.jsonl beside the model's text rows, one pair per row: a 64-word prompt and two answers of
    500 words, so that every sequence is truncated to the case's seq_len as the text rows are."""
    out = model_dir / "pairs.jsonl"
    if not out.is_file():
        with open(out, "w") as f:
            for line in (model_dir / "data.jsonl").read_text().splitlines():
                words = json.loads(line)["text"].split()
                pair = {"prompt": words[:64], "chosen": words[64:564], "rejected": words[564:1064]}
                f.write(json.dumps({k: " ".join(v) for k, v in pair.items()}) + "\n")
    return out


CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig",
    "gemma3_text": "Gemma3TextConfig",
    "smollm3": "SmolLM3Config",
    "qwen3_5_text": "Qwen3_5TextConfig",
    "gemma4_text": "Gemma4TextConfig",
    "llama4_text": "Llama4TextConfig",
}


def model_config(name: str):
    """The transformers config of MODELS[name] (bf16, the word-level tokenizer's special ids)."""
    import transformers

    fam, h, layers, heads, kv, ffn, vocab, tied = MODELS[name]
    config_class = getattr(transformers, CONFIG_CLASSES[fam])
    return config_class(
        **FAMILY_CONFIG.get(name, {}),
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )


def build_model(name: str, cache: Path) -> Path:
    """A random-weight model of MODELS[name] in bf16 safetensors, its word-level tokenizer and a
    text file of rows longer than any seq_len used here; reused when complete."""
    out = cache / name
    if (out / "done").is_file():
        return out
    if name in VLM_MODELS:
        from bench.vlm_model import build_llava

        build_llava(out, model_config(VLM_MODELS[name]))
        (out / "done").write_text("ok\n")
        return out
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(name), dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    write_tokenizer(out, MODELS[name][6], byte_alphabet=MODELS[name][0] == "qwen2")
    write_text_data(out / "data.jsonl", MODELS[name][6], rows=64, min_words=1100, max_words=1100)
    (out / "done").write_text("ok\n")
    return out


def planning_dir(name: str, cache: Path) -> Path:
    """A dir the planner can read MODELS[name]'s figures from: the built model, else its config.json
    alone (planning never reads weights)."""
    if (cache / name / "done").is_file():
        return cache / name
    out = cache / f"{name}-config"
    if name in VLM_MODELS and not (out / "processor_config.json").is_file():
        from bench.vlm_model import write_planning_dir

        out.mkdir(parents=True, exist_ok=True)
        return write_planning_dir(out, model_config(VLM_MODELS[name]))
    if not (out / "config.json").is_file():
        model_config(name).save_pretrained(out)
    return out


def job_overrides(model_dir: Path, run_dir: Path) -> list[str]:
    """What every case shares: the built model and its data, two optimizer steps, no checkpoints,
    no generation metric (eval only where a stack asks for it)."""
    return [
        f"hydra.run.dir={run_dir}",
        f"model.name_or_path={model_dir}",
        f"data.path={model_dir / 'data.jsonl'}",
        "data.format=text",
        "data.eval_path=null",
        "data.eval_fraction=0",
        "data.metric=null",
        "trainer.max_steps=2",
        "trainer.grad_accum=1",
        "trainer.save_steps=0",
        "trainer.eval_steps=0",
        "trainer.logging_steps=1",
        "trainer.progress_bar=false",
        "force=true",
        "precision=bf16",  # what the committed results were measured in (auto picks fp32 on some CPUs)
        "peft.adapter_dtype=float32",  # as measured, before auto (bf16 adapters under bf16) was the default
    ]


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def log_path(run_dir: Path) -> Path:
    """The run's log beside its dir (its whole name: a model name such as qwen3.5-50m holds a dot)."""
    return run_dir.parent / f"{run_dir.name}.log"


def run_case(case: dict, model_dir: Path, work: Path, timeout: float) -> dict:
    run_dir = work / case["name"].replace("/", "--")
    shutil.rmtree(run_dir, ignore_errors=True)  # a case measured again (same --work-dir) starts in an empty dir
    if case.get("data") == "pairs":
        preference_pairs(model_dir)
    if case.get("data") == "prompts":
        prompt_rows(model_dir, _prompt_bound(case))
    argv = [sys.executable, "train.py", *job_overrides(model_dir, run_dir), *data_overrides(case, model_dir)]
    argv += case["overrides"]
    log = log_path(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log, "w") as f:
        rc = _wait(subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT), timeout)
    return read_case(case, run_dir, rc, round(time.time() - started, 1))


def read_case(case: dict, run_dir: Path, rc: int, wall_s: float | None) -> dict:
    """A case's entry from its finished run dir (metrics.json and plan.json)."""
    entry = {**case, "rc": rc, "wall_s": wall_s}
    metrics = run_dir / "metrics.json"
    if rc != 0 or not metrics.is_file():
        entry["status"] = "failed"
        log = log_path(run_dir)
        entry["log_tail"] = log.read_text(errors="replace").splitlines()[-5:] if log.is_file() else []
        return entry
    m = json.loads(metrics.read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    cpu = next(d for d in plan["devices"] if d["device"] == "cpu")
    entry.update(
        status="ok",
        peak_quantity=m["peak_quantity"],
        planned_at_run_gib=round(m["planned_peak_gib"], 3),
        planned_gib=round(m["planned_peak_gib"], 3),
        measured_gib=round(m["peak_mem_gib"], 3),
        ratio=round(m["peak_mem_gib"] / m["planned_peak_gib"], 4),
        planned_phase=cpu["peak_phase"],
        params_total=plan["counts"]["params_total"],
    )
    entry["within"] = abs(entry["ratio"] - 1) <= TOLERANCE
    return entry


def replan(entry: dict, model_dir: Path) -> None:
    """The case's planned peak from the planner as it is now (the same overrides composed again), so
    a planner change re-scores every measured case without re-running it; the figure the run itself
    planned stays as planned_at_run_gib."""
    from qlora_recipes.config.loader import compose, to_typed
    from qlora_recipes.planner import plan
    from qlora_recipes.run.memory import CPU_QUANTITY, planned_peak_gib

    overrides = [o for o in job_overrides(model_dir, Path("unused")) if not o.startswith("hydra.")]
    cfg = to_typed(compose([*overrides, *data_overrides(entry, model_dir), *entry["overrides"]]))
    gpu = entry.get("peak_quantity", CPU_QUANTITY) != CPU_QUANTITY  # on a GPU: max_memory_allocated
    planned_now = plan(cfg, world_size=1, ladder=False)
    planned = planned_peak_gib(planned_now, gpu=gpu)
    entry["planned_phase"] = max(planned_now["devices"], key=lambda d: d["peak"])["peak_phase"]
    entry["planned_gib"] = round(planned, 3)
    entry["ratio"] = round(entry["measured_gib"] / planned, 4)
    entry["within"] = abs(entry["ratio"] - 1) <= TOLERANCE


def write_results(path: Path, meta: dict, entries: list[dict]) -> None:
    ok = [e for e in entries if e.get("status") == "ok"]
    within = sum(e["within"] for e in ok)
    summary = {
        "cases": len(entries),
        "measured": len(ok),
        "within_10pct": within,
        "worst_ratio": worst_ratio([e["ratio"] for e in ok]),
    }
    notes = [
        "measured: the run's own peak RSS (metrics.json `peak_mem_gib`: the kernel's high-water mark from the"
        " run's start); planned: the plan's cpu-device peak (metrics.json `planned_peak_gib`); two optimizer steps",
        f"{within} of {len(ok)} measured cases within 10 % ({len(entries)} cases)",
    ]
    table = [
        "| case | params | overrides | planned GiB | measured GiB | ratio | phase |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        if e.get("status") != "ok":
            table.append(f"| {e['name']} | – | `{' '.join(e['overrides'])}` | – | failed (rc {e.get('rc')}) | – | – |")
            continue
        table.append(
            f"| {e['name']} | {e['params_total'] / 1e6:.1f} M | `{' '.join(e['overrides'])}` | {e['planned_gib']:.3f} "
            f"| {e['measured_gib']:.3f} | {e['ratio']:.3f} | {e['planned_phase']} |"
        )
    write_results_files(path, meta, entries, summary, "planner vs CPU peak RSS", notes, table)


def main(argv: list[str], prog: str = "python -m bench planner-cpu") -> None:
    p = parser(prog, __doc__, RESULTS, "model/stack")
    p.add_argument("--jobs", type=int, default=1, help="cases run side by side (each peak is its own process's)")
    args = p.parse_args(argv)
    cache, work, todo, kept, meta = suite_start(args, prog, argv, "planner-cpu", cases())
    results = Path(args.results)
    todo = [c for c in todo if not ((args.resume or args.replan) and kept.get(c["name"], {}).get("status") == "ok")]
    for e in kept.values():  # re-scored by the planner as it is now
        if e.get("status") == "ok" and (e["model"] in MODELS or e["model"] in VLM_MODELS):
            replan(e, planning_dir(e["model"], cache))
    if args.collect:  # finished run dirs of a harness that was stopped (their processes ran on)
        for name, e in collect(todo, args.collect, lambda d: (d / "metrics.json").is_file(), read_case).items():
            kept[name] = e
            replan(e, planning_dir(e["model"], cache))
    if args.replan or args.collect:
        todo = []
    dirs = {m: build_model(m, cache) for m in dict.fromkeys(c["model"] for c in todo)}

    def one(case: dict) -> dict:
        e = run_case(case, dirs[case["model"]], work, args.timeout)
        if e["status"] == "ok":
            replan(e, dirs[case["model"]])
        print(
            f"[planner-cpu] {e['name']}: planned {e.get('planned_gib')} GiB, measured {e.get('measured_gib')} GiB, "
            f"ratio {e.get('ratio')} ({e['wall_s']} s)",
            flush=True,
        )
        return e

    # Cases may run side by side (--jobs): each is its own process and its peak RSS is its own.
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for e in pool.map(one, todo):
            kept[e["name"]] = e
            _write(results, meta, kept)
    _write(results, meta, kept)


def _write(results: Path, meta: dict, kept: dict[str, dict]) -> None:
    write_results(results, meta, in_suite_order(kept, cases()))
