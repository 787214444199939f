"""Bad input, catalogued: every mistake a user can make with `qlora train` (overrides, recipe typos,
data files, model dirs, environment values) ends with exit code 2, exactly one line on stderr that
names the key, file, row or field, no traceback, and an untouched run dir.

The cases run in-process through the command's own entry point (`commands.train.run(argv)`, the
same code `qlora train` and `python train.py` run), so most cost a Hydra composition and fail in
validation without importing torch; a handful run the real command in a fresh process to prove it
prints the one line there too, and Ctrl-C during start-up is tested the same way.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SMOKE
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra

from qlora_recipes.cli import train as train_command

TINY = REPO / "assets" / "tiny-llama"
GOOD_ROWS = "".join(
    json.dumps({"prompt": f"order: {w}\n", "completion": "".join(sorted(w))}) + "\n" for w in "cab dcba fed".split()
)


def run_in_process(args: list[str], run_dir: Path, monkeypatch, env: dict | None = None) -> tuple[int, str]:
    """`qlora train SMOKE ARGS hydra.run.dir=RUN` in this process: (exit code, stderr)."""
    for name, value in (env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command sets its own
    root = logging.getLogger()  # Hydra points the root logger at this run's stdout: undone after
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    # Hydra composes every config twice: once only to read hydra.mode (a sweep preset may set
    # MULTIRUN), once to run. No case here sets a mode, so the probe is skipped: half the time.
    monkeypatch.setattr(Hydra, "get_mode", lambda self, config_name, overrides: None)
    GlobalHydra.instance().clear()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        train_command.run([*SMOKE, *args, f"hydra.run.dir={run_dir}"], prog="qlora train")
    GlobalHydra.instance().clear()
    return stop.value.code, err.getvalue()


def assert_refused(code: int, stderr: str, needles: list[str], run_dir: Path, before: dict | None = None) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert snapshot(run_dir) == (before or {}), f"the run dir was written to: {sorted(snapshot(run_dir))}"
    return lines[0]


def snapshot(run_dir: Path) -> dict:
    """Every file under the run dir with its bytes ({} when there is no run dir)."""
    if not run_dir.exists():
        return {}
    return {str(p.relative_to(run_dir)): p.read_bytes() if p.is_file() else None for p in sorted(run_dir.rglob("*"))}


# ---------------------------------------------------------------------------------------------
# Overrides: (arguments, what the line must name). Each fails in validation, most before torch.
# ---------------------------------------------------------------------------------------------
OVERRIDES = [
    # the tester's list
    (["optim.scheduler=bogus"], ["optim.scheduler=bogus", "cosine"]),
    (["peft.target_modules=42"], ["peft.target_modules=42", "all-linear"]),
    (["trainer.eval_steps=-5"], ["trainer.eval_steps=-5", ">= 0"]),
    (["trainer.save_steps=-1"], ["trainer.save_steps=-1", ">= 0"]),
    (["optim.warmup_ratio=5"], ["optim.warmup_ratio=5", "[0, 1)", "optim.warmup_steps=5"]),
    (["optim.max_grad_norm=-1"], ["optim.max_grad_norm=-1", "> 0"]),
    (["trainer.save_steps=10", "trainer.save_total_limit=0"], ["trainer.save_total_limit=0", "trainer.save_steps=10"]),
    # optimizer and schedule
    (["optim.scheduler=cosine_with_min_lr"], ["optim.scheduler=cosine_with_min_lr", "lr_scheduler_kwargs"]),
    (["optim.scheduler=warmup_stable_decay"], ["optim.scheduler=warmup_stable_decay", "num_decay_steps"]),
    (["optim.scheduler=reduce_lr_on_plateau"], ["optim.scheduler=reduce_lr_on_plateau", "trainer.eval_steps"]),
    (["optim.scheduler=greedy", "trainer.eval_steps=2", "data.eval_path=null", "data.eval_fraction=0"], ["greedy"]),
    (["optim.name=adamw_9bit"], ["optim.name=adamw_9bit", "paged_adamw_8bit"]),
    (["optim.name=paged_adamw"], ["optim.name=paged_adamw"]),
    (["optim.lr=0"], ["optim.lr=0"]),
    (["overwrite=true", "resume=auto"], ["overwrite=true", "resume=auto", "drop one"]),
    (["optim.lr=nan"], ["optim.lr=nan"]),
    (["optim.warmup_ratio=1"], ["optim.warmup_ratio=1", "optim.warmup_steps=1"]),
    (["optim.warmup_steps=-3"], ["optim.warmup_steps=-3"]),
    (["optim.max_grad_norm=0"], ["optim.max_grad_norm=0"]),
    (["optim.weight_decay=-0.01"], ["optim.weight_decay=-0.01"]),
    (["optim.beta1=1.0"], ["optim.beta1=1.0", "[0, 1)"]),
    # trainer
    (["trainer.micro_batch_size=0"], ["trainer.micro_batch_size=0"]),
    (["trainer.grad_accum=0"], ["trainer.grad_accum=0"]),
    (["trainer.seq_len=0"], ["trainer.seq_len=0"]),
    (["trainer.seq_len=longest"], ["trainer.seq_len=longest", "or auto"]),
    (
        ["trainer.seq_len=300"],
        ["trainer.seq_len=300", "256 positions", "max_position_embeddings", "model.rope_scaling"],
    ),
    (["trainer.seq_len=600", "model.rope_scaling={rope_type:linear,factor:2}"], ["512 positions", "factor"]),
    (
        ["objective=grpo", "trainer.seq_len=200", "objective.max_completion_length=200"],
        ["trainer.seq_len=200 + objective.max_completion_length=200 = 400", "256 positions", "trainer.seq_len=56"],
    ),
    # model
    (["model.rope_scaling={rope_type:ntk,factor:2}"], ["model.rope_scaling.rope_type=ntk", "linear, dynamic"]),
    (["model.rope_scaling={rope_type:linear,factor:1}"], ["model.rope_scaling.factor=1", "> 1"]),
    (["model.rope_scaling={rope_type:yarn}"], ["model.rope_scaling needs a factor"]),
    (["model.rope_scaling={rope_type:llama3,factor:8}"], ["rope_type=llama3", "low_freq_factor and high_freq_factor"]),
    (
        ["model.rope_scaling={rope_type:yarn,factor:4,original_max_position_embeddings:abc}"],
        ["model.rope_scaling.original_max_position_embeddings=abc", "a whole number > 0"],
    ),
    (
        ["model.rope_scaling={rope_type:yarn,factor:4,beta_fast:fast}"],
        ["model.rope_scaling.beta_fast=fast", "a number"],
    ),
    (["model.rope_scaling={rope_type:yarn,factor:4,truncate:3}"], ["model.rope_scaling.truncate=3", "true or false"]),
    (["trainer.seq_len_percentile=0"], ["trainer.seq_len_percentile=0", "(0, 100]"]),
    (["trainer.max_steps=-2"], ["trainer.max_steps=-2"]),
    (["trainer.max_steps=-1", "trainer.epochs=0"], ["trainer.max_steps", "trainer.epochs", "set one of them"]),
    (["trainer.logging_steps=0"], ["trainer.logging_steps=0"]),
    (["trainer.memory_log_steps=0"], ["trainer.memory_log_steps=0"]),
    (["trainer.lm_eval_limit=0"], ["trainer.lm_eval_limit=0"]),
    (["trainer.checkpointing_mode=sometimes"], ["trainer.checkpointing_mode=sometimes", "reentrant"]),
    (["trainer.micro_batch_sise=2"], ["micro_batch_sise", "check the spelling", "qlora train --cfg job"]),
    # peft
    (["peft.r=0"], ["peft.r=0"]),
    (["peft.r=big"], ["peft.r", "big"]),
    (["peft.alpha=0"], ["peft.alpha=0"]),
    (["peft.dropout=1.0"], ["peft.dropout=1.0"]),
    (["peft.target_modules=[]"], ["peft.target_modules=[]"]),
    (["peft.target_modules=''"], ["peft.target_modules is empty"]),
    (["peft.target_modules='(q_proj'"], ["peft.target_modules='(q_proj'", "regular expression"]),
    (["peft.target_modules=[1,2]"], ["peft.target_modules=[1, 2]"]),
    (["peft.target_modules=null"], ["peft.target_modules=null"]),
    (["peft.target_modules=[q_proj,v_prj]"], ["peft.target_modules", "'v_prj'", "v_proj"]),
    (["peft.modules_to_save=[lm_hed]"], ["peft.modules_to_save", "'lm_hed'"]),
    (["peft.method=qlora"], ["peft.method=qlora", "lora"]),
    (["peft=dora", "quant=int8"], ["peft=dora", "quant=int8"]),
    # quantization and precision
    (["quant=nf5"], ["quant=nf5 is not an option", "nf4", "int8"]),
    (["quant.method=nf5"], ["quant.method=nf5", "nf4"]),
    (["quant.storage_dtype=int4"], ["quant.storage_dtype=int4"]),
    (["quant.compute_dtype=float8"], ["quant.compute_dtype=float8", "bfloat16"]),
    (["quant.int8_threshold=-1"], ["quant.int8_threshold=-1"]),
    (["quant=none", "quant.storage_dtype=bfloat16"], ["quant.storage_dtype"]),
    (["precision=bf16", "precision.dtype=float16"], ["precision.dtype=float16", "precision=bf16"]),
    (["precision=fp16"], ["precision=fp16 needs a CUDA GPU"]),
    # the objective: its keys only under it
    (["objective=ppo"], ["objective=ppo is not an option", "kto"]),
    (["objective=orpo"], ["objective=orpo is not an option", "trl.experimental", "full", "objective=kto"]),
    (["objective=dpo", "objective.desirable_weight=2"], ["objective.desirable_weight", "objective=kto"]),
    (["objective=kto", "trainer.micro_batch_size=1"], ["trainer.micro_batch_size=1", "objective=kto", "2 or more"]),
    (["objective.beta=0.2"], ["objective.beta=0.2", "objective=dpo", "objective=sft"]),
    (["objective=dpo", "objective.beta=0"], ["objective.beta=0", "> 0"]),
    (["objective=dpo", "objective.loss_type=kl"], ["objective.loss_type=kl", "sigmoid"]),
    (["objective=dpo", "data.packing=true"], ["data.packing=true", "objective=dpo"]),
    (["objective=dpo", "objective.ref_adapter=true"], ["objective.ref_adapter=true", "init_from="]),
    (["init_from=no/such/run"], ["init_from=no/such/run", "no such directory"]),
    (["objective=dpo", "objective.sft_weight=-1"], ["objective.sft_weight=-1", ">= 0"]),
    (["objective.sft_weight=1"], ["objective.sft_weight=1", "objective=dpo"]),
    (["objective=grpo", "objective.num_generations=1"], ["objective.num_generations=1", ">= 2"]),
    (["objective=grpo", "objective.num_generations=3"], ["num_generations=3", "trainer.micro_batch_size=8"]),
    (["objective=grpo", "objective.temperature=0"], ["objective.temperature=0", "> 0"]),
    (["objective=grpo", "objective.rewards=[]"], ["objective.rewards", "exact_match"]),
    (["objective=grpo", "objective.rewards=[bleu]"], ["'bleu'", "module:function"]),
    (["objective.num_generations=4"], ["objective.num_generations=4", "objective=grpo", "objective=sft"]),
    (["objective=grpo", "objective.rewards=[no_such_module_here:f]"], ["no_such_module_here", "does not import"]),
    # data keys
    (["data.format=yaml"], ["data.format"]),
    (["data.packing_strategy=ffd"], ["data.packing_strategy=ffd", "bfd"]),
    (["data.eval_fraction=1.0"], ["data.eval_fraction=1.0"]),
    (["data.eval_max_rows=0"], ["data.eval_max_rows=0", ">= 1"]),
    (["data.metric=bleu"], ["data.metric=bleu"]),
    (["data.metric_examples=0"], ["data.metric_examples=0"]),
    (["data.max_new_tokens=0"], ["data.max_new_tokens=0"]),
    (["data.padding_free=true"], ["data.padding_free=true", "data.packing"]),
    (["data.path=/nonexistent/train.jsonl"], ["data.path", "/nonexistent/train.jsonl"]),
    (["data.eval_path=/nonexistent/eval.jsonl"], ["data.eval_path", "/nonexistent/eval.jsonl"]),
    (["data.path=someone/no-such-dataset"], ["data.path", "someone/no-such-dataset"]),
    (["data.path="], ["data.path"]),
    # model keys
    (["model.attn_implementation=flash"], ["model.attn_implementation=flash", "sdpa"]),
    (["model.attn_implementation=flash_attention_2", "data.packing=true"], ["model.attn_implementation"]),
    (["model.max_position_embeddings=0"], ["model.max_position_embeddings=0"]),
    (["model.head_dim=0"], ["model.head_dim=0"]),
    (["model.lora_lr=-1"], ["optim.lr"]),
    (["model.name_or_path=/nonexistent/model"], ["model.name_or_path=/nonexistent/model", "no such directory"]),
    (["model.name_or_path=nobody/no-such-model"], ["model.name_or_path=nobody/no-such-model"]),
    # offload, hardware, dist, top level
    (["offload=disk", "offload.folder=null"], ["offload=disk needs an offload folder"]),
    (["offload.device_map=balanced"], ["offload.device_map=balanced"]),
    (["hardware.gpus=-1"], ["hardware.gpus=-1"]),
    (["hardware.nodes=0"], ["hardware.nodes=0"]),
    (["hardware.gpus=2"], ["hardware.gpus=2", "hardware.gpu_memory_gib"]),
    (["dist=fsdp2"], ["dist=fsdp2 is not an option"]),
    (["dist=ddp", "dist.launcher=mpirun"], ["dist.launcher=mpirun"]),
    (["dist=fsdp"], ["dist=fsdp", "torchrun"]),
    (["trainer.activation_offloading=true"], ["trainer.activation_offloading=true needs a CUDA GPU"]),
    (["trainer.liger=true"], ["trainer.liger=true needs a CUDA GPU"]),
    (["trainer.tiled_mlp=true", "dist=ddp"], ["trainer.tiled_mlp=true", "dist=ddp", "dist=none"]),
    (["trainer.tiled_mlp_tile=-1"], ["trainer.tiled_mlp_tile=-1"]),
    (["trainer.lean_rmsnorm=true", "model=gemma2-9b"], ["trainer.lean_rmsnorm=true", "not Llama's form"]),
    (["peft.adapter_dtype=fp16"], ["peft.adapter_dtype=fp16 is not an option", "bfloat16"]),
    (["peft.adapter_dtype=bfloat16", "optim=adamw"], ["peft.adapter_dtype=bfloat16", "optim=paged8bit"]),
    (["peft.adapter_dtype=bfloat16", "peft=dora"], ["peft.adapter_dtype=bfloat16", "LoRA and rsLoRA only"]),
    (["peft.adapter_dtype=bfloat16", "dist=ddp"], ["peft.adapter_dtype=bfloat16", "dist=none"]),
    (["resume.checkpoint=/nonexistent/checkpoint-5"], ["resume.checkpoint=/nonexistent/checkpoint-5"]),
    (["seed=-1"], ["seed=-1"]),
    (["+foo=1"], ["unknown key foo"]),
    (["optim.lr=${model.nope}"], ["model.nope"]),
    (["recipe=nope"], ["recipe=nope is not an option", "tiny-cpu"]),
    # evaluation asked for, with nothing to evaluate on (transformers would skip it without a word)
    (
        ["trainer.eval_steps=2", "data.eval_path=null", "data.eval_fraction=0"],
        ["trainer.eval_steps=2", "no eval split", "data.eval_fraction", "trainer.eval_steps=0"],
    ),
    (["trainer=standard", "data.eval_path=null", "data.eval_fraction=0"], ["trainer.eval_steps=200", "no eval split"]),
]
# Variants of the cases above: the same checks with other values (`make test-all` runs them).
MORE_OVERRIDES = [
    (["optim.scheduler=cosine_warmup_with_min_lr"], ["optim.scheduler=cosine_warmup_with_min_lr", "min_lr"]),
    (["optim.scheduler=Cosine"], ["optim.scheduler=Cosine"]),
    (["optim.name=lion_8bit"], ["optim.name=lion_8bit"]),
    (["optim.lr=-1e-4"], ["optim.lr=-0.0001"]),
    (["optim.lr=inf"], ["optim.lr=inf"]),
    (["optim.warmup_ratio=-0.1"], ["optim.warmup_ratio=-0.1"]),
    (["optim.warmup_steps=2.5"], ["optim.warmup_steps"]),
    (["optim.max_grad_norm=nan"], ["optim.max_grad_norm=nan"]),
    (["optim.beta2=-0.5"], ["optim.beta2=-0.5"]),
    (["optim=sgd8bit"], ["optim=sgd8bit is not an option", "paged8bit"]),
    (["trainer.save_total_limit=-2"], ["trainer.save_total_limit=-2"]),
    (["trainer.eval_batch_size=-1"], ["trainer.eval_batch_size=-1"]),
    (["trainer.seq_len=-64"], ["trainer.seq_len=-64"]),
    (["trainer.max_steps=-1", "trainer.epochs=-1"], ["trainer.epochs"]),
    (["trainer.max_steps=1.5"], ["trainer.max_steps"]),
    (["trainer.gradient_checkpointing=maybe"], ["trainer.gradient_checkpointing"]),
    (["trainer=huge"], ["trainer=huge is not an option", "smoke"]),
    (["peft.r=-8"], ["peft.r=-8"]),
    (["peft.dropout=-0.1"], ["peft.dropout=-0.1"]),
    (["peft.target_modules=[attn]"], ["peft.target_modules", "'attn'"]),
    (["peft=loha"], ["peft=loha is not an option", "dora"]),
    (["quant.double_quant=sure"], ["quant.double_quant"]),
    (["precision=fp8"], ["precision=fp8 is not an option", "bf16"]),
    (["data.eval_fraction=-0.1"], ["data.eval_fraction=-0.1"]),
    (["data=alpacca"], ["data=alpacca is not an option", "alpaca"]),
    (["model.hidden_size=-1"], ["model.hidden_size=-1"]),
    (["model=llama5"], ["model=llama5 is not an option", "tiny"]),
    (["offload.device_map=auto"], ["offload.device_map=auto", "offload.max_memory"]),
    (["hardware.timeout_min=0"], ["hardware.timeout_min=0"]),
    (["hardware.host_ram_gib=0"], ["hardware.host_ram_gib=0"]),
    (["seed=4294967296"], ["seed=4294967296"]),
    (["force=perhaps"], ["force"]),
    (["+trainer.extra_knob=3"], ["unknown key trainer.extra_knob"]),
]


@pytest.mark.parametrize(
    "args,needles",
    [
        *(pytest.param(a, n, id=" ".join(a)) for a, n in OVERRIDES),
        *(pytest.param(a, n, id=" ".join(a), marks=pytest.mark.slow) for a, n in MORE_OVERRIDES),
    ],
)
def test_override(args, needles, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert_refused(*run_in_process(args, run_dir, monkeypatch), needles, run_dir)


def test_a_run_dir_that_exists_is_left_exactly_as_it_was(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine\n")
    before = snapshot(run_dir)
    code, stderr = run_in_process(["optim.warmup_ratio=5"], run_dir, monkeypatch)
    assert_refused(code, stderr, ["optim.warmup_ratio=5"], run_dir, before)
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty dir the user made stays too
    assert_refused(*run_in_process(["peft.r=0"], empty, monkeypatch), ["peft.r=0"], empty, {})
    assert empty.is_dir()


# What a run leaves in its run dir (files and their text): a new run there without resume=auto or
# overwrite=true is refused, and the run dir stays as it was.
HELD_RUNS = {
    "finished": (
        {"adapter/adapter_config.json": "{}", "metrics.json": '{"status": "ok"}', "config.yaml": "{}"},
        ["a finished run (adapter/, metrics.json)", "a larger trainer.max_steps"],
    ),
    "stopped by a signal": (
        {"checkpoints/checkpoint-2/trainer_state.json": "{}", "metrics.json": '{"status": "preempted"}'},
        ["a stopped run (checkpoints/checkpoint-2, metrics.json)", "continue it with resume=auto"],
    ),
    "crashed after two checkpoints": (
        {"checkpoints/checkpoint-2/trainer_state.json": "{}", "checkpoints/checkpoint-4/trainer_state.json": "{}"},
        ["a stopped run (2 checkpoints)"],
    ),
}


@pytest.mark.parametrize("case", sorted(HELD_RUNS))
def test_a_run_dir_holding_a_run_is_neither_reused_nor_touched(case, tmp_path, monkeypatch):
    files, needles = HELD_RUNS[case]
    run_dir = tmp_path / "run"
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    before = snapshot(run_dir)
    code, stderr = run_in_process([], run_dir, monkeypatch)
    assert_refused(code, stderr, [f"run dir {run_dir} ", "resume=auto", "overwrite=true", *needles], run_dir, before)


# ---------------------------------------------------------------------------------------------
# Recipe typos: a recipe file on the search path with one mistake each.
# ---------------------------------------------------------------------------------------------
RECIPES = {
    "misspelled-key": ("trainer:\n  micro_batch_sise: 2\n", ["micro_batch_sise"]),
    "wrong-type": ("peft:\n  r: sixteen\n", ["peft.r", "sixteen"]),
    "bad-option": ("defaults:\n  - override /quant: nf5\n", ["nf5"]),
    "warmup-steps-as-ratio": ("optim:\n  warmup_ratio: 100\n", ["optim.warmup_ratio=100", "optim.warmup_steps=100"]),
    "negative-eval-steps": ("trainer:\n  eval_steps: -200\n", ["trainer.eval_steps=-200"]),
    "bad-scheduler": ("optim:\n  scheduler: cosine_annealing\n", ["optim.scheduler=cosine_annealing"]),
    "unknown-group-key": ("peft:\n  rank: 8\n", ["rank"]),
    "invalid-yaml": ("trainer: [micro_batch_size: 2\n", ["not valid YAML", "invalid-yaml.yaml", "line"]),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_typo(name, tmp_path, monkeypatch):
    body, needles = RECIPES[name]
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / f"{name}.yaml").write_text(f"# @package _global_\n{body}")
    args = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"recipe={name}"]
    run_dir = tmp_path / "run"
    assert_refused(*run_in_process(args, run_dir, monkeypatch), needles, run_dir)


# ---------------------------------------------------------------------------------------------
# Data files: (file name, contents, extra overrides, what the line must name).
# ---------------------------------------------------------------------------------------------
DATA = {
    "malformed JSON line": (
        "t.jsonl",
        GOOD_ROWS + '{"prompt": "order: x\\n", \n',
        [],
        ["t.jsonl line 4", "not valid JSON"],
    ),
    "missing field": ("t.jsonl", GOOD_ROWS + '{"prompt": "order: ba\\n"}\n', [], ["t.jsonl line 4", "'completion'"]),
    "empty file": ("t.jsonl", "", [], ["t.jsonl", "empty"]),
    "blank lines only": ("t.jsonl", "\n\n  \n", [], ["t.jsonl", "empty"]),
    "prompt is a number": (
        "t.jsonl",
        GOOD_ROWS + '{"prompt": 5, "completion": "a"}\n',
        [],
        ["line 4", "'prompt'", "int"],
    ),
    "completion is a list": (
        "t.jsonl",
        GOOD_ROWS + '{"prompt": "p", "completion": ["a"]}\n',
        [],
        ["line 4", "'completion'", "list"],
    ),
    "empty prompt": (
        "t.jsonl",
        GOOD_ROWS + '{"prompt": " ", "completion": "a"}\n',
        [],
        ["line 4", "'prompt'", "empty"],
    ),
    "row is not an object": ("t.jsonl", "[1, 2]\n" + GOOD_ROWS, [], ["t.jsonl line 1", "list"]),
    "unknown fields": ("t.jsonl", '{"question": "q", "answer": "a"}\n', [], ["t.jsonl line 1", "cannot detect"]),
    "messages is a string": ("m.jsonl", '{"messages": "hi"}\n', [], ["m.jsonl line 1", "'messages'"]),
    "unknown role": (
        "m.jsonl",
        '{"messages": [{"role": "bot", "content": "hi"}]}\n',
        [],
        ["m.jsonl line 1", "'messages[0].role'", "'bot'"],
    ),
    "message without content": (
        "m.jsonl",
        '{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}\n',
        [],
        ["m.jsonl line 1", "'messages[0].content'"],
    ),
    "no assistant turn": (
        "m.jsonl",
        '{"messages": [{"role": "user", "content": "hi"}]}\n',
        [],
        ["m.jsonl line 1", "no assistant turn"],
    ),
    "json top level is an object": (
        "d.json",
        '{"prompt": "p", "completion": "c"}',
        [],
        ["d.json", "list of row objects"],
    ),
    "json not valid": ("d.json", '[{"prompt": "p",', [], ["d.json"]),
    "csv without the completion column": (
        "d.csv",
        "prompt,answer\np,c\nq,d\n",
        [],
        ["d.csv", "prompt rows without an answer", "'completion'", "objective=grpo"],
    ),
    "prompt rows under objective=grpo without the answer its rewards read": (
        "g.jsonl",
        '{"prompt": "order: ba", "hint": "x"}\n',
        ["objective=grpo", "data.eval_fraction=0"],
        ["objective.rewards", "char_match", "'answer'", "hint"],
    ),
    "prompt row without its prompt": (
        "g.jsonl",
        '{"prompt": "order: ba", "answer": "ab"}\n{"answer": "bc"}\n',
        ["objective=grpo", "data.eval_fraction=0"],
        ["g.jsonl line 2", "'prompt'"],
    ),
    "prompt row without the first row's answer column": (
        "g.jsonl",
        '{"prompt": "order: ba", "answer": "ab"}\n{"prompt": "order: cb"}\n',
        ["objective=grpo", "data.eval_fraction=0"],
        ["g.jsonl line 2", "'answer'", "missing"],
    ),
    "csv header only": ("d.csv", "prompt,completion\n", [], ["d.csv", "no rows"]),
    "parquet that is not parquet": ("d.parquet", "not parquet", [], ["d.parquet", "Parquet"]),
    "unsupported file type": ("d.txt", "order: cab -> abc\n", [], ["d.txt", "unsupported file type"]),
    "not UTF-8": ("t.jsonl", b'{"prompt": "\xff\xfe", "completion": "a"}\n', [], ["t.jsonl", "UTF-8"]),
    "alpaca format named, prompt rows given": (
        "t.jsonl",
        GOOD_ROWS,
        ["data.format=alpaca"],
        ["t.jsonl line 1", "'instruction'"],
    ),
    "preference pairs under objective=sft": (
        "p.jsonl",
        '{"prompt": "order: ba", "chosen": "ab", "rejected": "ba"}\n',
        [],
        ["p.jsonl", "preference pairs", "objective=sft", "objective=dpo"],
    ),
    "sft rows under objective=dpo": (
        "t.jsonl",
        GOOD_ROWS,
        ["objective=dpo", "data.eval_fraction=0"],
        ["t.jsonl", "objective=dpo", "prompt_completion"],
    ),
    "pair without its rejected answer": (
        "p.jsonl",
        '{"prompt": "order: ba", "chosen": "ab", "rejected": "ba"}\n{"prompt": "order: cb", "chosen": "bc"}\n',
        ["objective=dpo", "data.eval_fraction=0"],
        ["p.jsonl line 2", "'rejected'"],
    ),
    "unpaired row with a label that is not true or false": (
        "r.jsonl",
        '{"prompt": "order: ba", "completion": "ab", "label": true}\n{"prompt": "order: cb", "completion": "bc", '
        '"label": "no"}\n',
        ["objective=kto", "data.eval_fraction=0"],
        ["r.jsonl line 2", "'label'", "true"],
    ),
    "unpaired rows under objective=sft": (
        "r.jsonl",
        '{"prompt": "order: ba", "completion": "ab", "label": true}\n',
        [],
        ["r.jsonl", "unpaired rows", "objective=sft", "objective=kto"],
    ),
    "preference pairs whose answers are all the same": (
        "p.jsonl",
        "".join(json.dumps({"prompt": f"order: {w}\n", "chosen": w, "rejected": w}) + "\n" for w in ["ab", "cb"]),
        ["objective=dpo", "data.eval_fraction=0"],
        ["p.jsonl", "all 2 pairs", "same chosen and rejected answer", "log 2"],
    ),
    "preference pairs under objective=grpo": (
        "p.jsonl",
        '{"prompt": "order: ba", "chosen": "ab", "rejected": "ba"}\n',
        ["objective=grpo", "data.eval_fraction=0"],
        ["p.jsonl", "objective=grpo", "preference rows", "objective=dpo", "objective=kto"],
    ),
    "unpaired rows under objective=grpo": (
        "r.jsonl",
        '{"prompt": "order: ba", "completion": "ab", "label": true}\n',
        ["objective=grpo", "data.eval_fraction=0"],
        ["r.jsonl", "objective=grpo", "unpaired rows", "train those with objective=kto"],
    ),
    "grpo prompts longer than a seq_len that fills the model's positions": (
        "g.jsonl",
        "".join(json.dumps({"prompt": "order: " + "ab" * 130, "answer": "a"}) + "\n" for _ in range(2)),
        ["objective=grpo", "data.eval_fraction=0", "trainer.seq_len=248"],
        ["longer than 248 tokens", "model.rope_scaling=", "objective.max_completion_length=8 already fill its 256"],
    ),
    "eval split leaves nothing to train on": (
        "t.jsonl",
        GOOD_ROWS,
        ["data.eval_fraction=0.9"],
        ["data.eval_fraction", "no rows"],
    ),
}


@pytest.mark.parametrize("case", sorted(DATA))
def test_data_file(case, tmp_path, monkeypatch):
    name, body, extra, needles = DATA[case]
    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    args = [f"data.path={path}", "data.eval_path=null", *(extra or ["data.eval_fraction=0"])]
    run_dir = tmp_path / "run"
    assert_refused(*run_in_process(args, run_dir, monkeypatch), needles, run_dir)


def test_eval_file_in_another_format(tmp_path, monkeypatch):
    train, evals = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    train.write_text(GOOD_ROWS)
    evals.write_text('{"text": "order: ba -> ab"}\n')
    run_dir = tmp_path / "run"
    code, stderr = run_in_process([f"data.path={train}", f"data.eval_path={evals}"], run_dir, monkeypatch)
    assert_refused(code, stderr, ["data.eval_path", "e.jsonl", "format"], run_dir)


def test_data_dir_without_data_files(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "README.md").write_text("nothing here\n")
    run_dir = tmp_path / "run"
    code, stderr = run_in_process([f"data.path={tmp_path / 'data'}", "data.eval_path=null"], run_dir, monkeypatch)
    assert_refused(code, stderr, ["data"], run_dir)


# ---------------------------------------------------------------------------------------------
# init_from: a finished run's dir (written here, not trained) with one thing wrong each.
# ---------------------------------------------------------------------------------------------
def finished_run(folder: Path, *overrides: str, status: str = "ok") -> Path:
    """A run dir as a finished run leaves it (config.yaml, adapter/, metrics.json, manifest.json)."""
    from conftest import compose_cfg

    from qlora_recipes.config.loader import to_yaml
    from qlora_recipes.outputs.runfiles import run_file_names, write_manifest

    (folder / "adapter").mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(compose_cfg(*SMOKE, *overrides)))
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    (folder / "metrics.json").write_text(json.dumps({"status": status}))
    write_manifest(folder, run_file_names(folder))
    return folder


INIT_FROM = {
    "a run that was preempted": (lambda d: finished_run(d, status="preempted"), ["not a finished run", "resume=auto"]),
    "a run without its manifest": (
        lambda d: (finished_run(d) / "manifest.json").unlink(),
        ["not a finished run", "no manifest.json"],
    ),
    "a run without an adapter": (
        lambda d: shutil.rmtree(finished_run(d) / "adapter"),
        ["a run dir without a saved adapter"],
    ),
    "a run on another base": (
        lambda d: finished_run(d, "model.name_or_path=/models/other-llama"),
        ["model.name_or_path=/models/other-llama", "an adapter only fits its base"],
    ),
    "a run with another adapter shape": (
        lambda d: finished_run(d, "peft.r=8", "peft.target_modules=[q_proj,v_proj]"),
        ["peft.r=8", "peft.r=16", "add peft.r=8 peft.target_modules=[q_proj,v_proj]"],
    ),
}


@pytest.mark.parametrize("case", sorted(INIT_FROM))
def test_init_from(case, tmp_path, monkeypatch):
    make, needles = INIT_FROM[case]
    earlier = tmp_path / "sft"
    earlier.mkdir()
    make(earlier)
    run_dir = tmp_path / "run"
    code, stderr = run_in_process(["objective=dpo", f"init_from={earlier}"], run_dir, monkeypatch)
    assert_refused(code, stderr, [f"init_from={earlier}", *needles], run_dir)


# ---------------------------------------------------------------------------------------------
# Model dirs: the tiny model with one thing broken each.
# ---------------------------------------------------------------------------------------------
def _config(**changes):
    def edit(d: Path):
        cj = json.loads((d / "config.json").read_text())
        cj.update(changes)
        (d / "config.json").write_text(json.dumps({k: v for k, v in cj.items() if v != "<drop>"}))

    return edit


def _truncate(d: Path):
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _index_naming_a_missing_shard(d: Path):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": names[0], "b": names[1]}}))


MODEL_DIRS = {
    "missing config.json": (lambda d: (d / "config.json").unlink(), ["no config.json"]),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{hidden_size: 64"), ["config.json", "JSON"]),
    "config.json without model_type": (_config(model_type="<drop>"), ["config.json", "model_type"]),
    "config.json figure of the wrong type": (_config(hidden_size="big"), ["config.json", "hidden_size='big'"]),
    "config.json zero layers": (_config(num_hidden_layers=0), ["config.json", "num_hidden_layers=0"]),
    "config.json unknown model_type": (_config(model_type="llamalike"), ["config.json", "'llamalike'"]),
    "a model type only the dir's own code knows": (
        _config(model_type="ownlike", auto_map={"AutoConfig": "own.OwnConfig"}),
        ["config.json", "'ownlike'", "set model.trust_remote_code=true if you trust it"],
    ),
    "corrupt weights (truncated)": (_truncate, ["model.safetensors", "corrupt or truncated"]),
    "corrupt weights (garbage)": (lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)), ["corrupt"]),
    "empty weights file": (lambda d: (d / "model.safetensors").write_bytes(b""), ["model.safetensors", "corrupt"]),
    "weights missing": (lambda d: (d / "model.safetensors").unlink(), ["no model.safetensors"]),
    "only .bin weights": (
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        ["only pytorch_model.bin", "safetensors"],
    ),
    "index names a missing shard": (_index_naming_a_missing_shard, ["model-00002-of-00002.safetensors", "missing"]),
    "index not JSON": (
        lambda d: (d / "model.safetensors.index.json").write_text("{"),
        ["model.safetensors.index.json", "JSON"],
    ),
    "tokenizer missing": (
        lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        ["tokenizer", "model.name_or_path="],
    ),
}


@pytest.mark.parametrize("case", sorted(MODEL_DIRS))
def test_model_dir(case, tmp_path, monkeypatch):
    edit, needles = MODEL_DIRS[case]
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    edit(model)
    run_dir = tmp_path / "run"
    code, stderr = run_in_process([f"model.name_or_path={model}"], run_dir, monkeypatch)
    assert_refused(code, stderr, needles, run_dir)


def test_model_path_is_a_file(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    code, stderr = run_in_process([f"model.name_or_path={TINY / 'config.json'}"], run_dir, monkeypatch)
    assert_refused(code, stderr, ["model.name_or_path=", "not a directory"], run_dir)


# ---------------------------------------------------------------------------------------------
# Environment values the run reads.
# ---------------------------------------------------------------------------------------------
ENVIRONMENT = [
    ({"QLORA_RECIPES_FAULTS": "garbage"}, ["QLORA_RECIPES_FAULTS=garbage", "unset QLORA_RECIPES_FAULTS"]),
    ({"QLORA_RECIPES_FAULTS": "nan_at_step=x"}, ["QLORA_RECIPES_FAULTS=nan_at_step=x", "'nan_at_step=x'"]),
    ({"QLORA_RECIPES_FAULTS": "nan_at_stp=3"}, ["'nan_at_stp=3'", "nan_at_step"]),
    ({"QLORA_RECIPES_FAULTS": "nan_at_step=-1"}, ["'nan_at_step=-1'"]),
    ({"QLORA_RECIPES_FAULTS": "nan_at_step=3, sigterm_at_step=4"}, ["' sigterm_at_step=4'"]),
    ({"QLORA_RECIPES_FAULTS": "oom_above_micro_batch"}, ["'oom_above_micro_batch'"]),
    ({"WORLD_SIZE": "abc"}, ["WORLD_SIZE=abc", "unset WORLD_SIZE"]),
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0"]),
    ({"WORLD_SIZE": ""}, ["WORLD_SIZE=''"]),
    ({"RANK": "-1"}, ["RANK=-1"]),
    ({"LOCAL_RANK": "one"}, ["LOCAL_RANK=one"]),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK=2", "WORLD_SIZE=2"]),
    ({"HOME": None, "QLORA_RECIPES_CACHE": None}, ["HOME"]),
]


@pytest.mark.parametrize(
    "env,needles", ENVIRONMENT, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in ENVIRONMENT]
)
def test_environment_value(env, needles, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    assert_refused(*run_in_process([], run_dir, monkeypatch, env), needles, run_dir)


def test_the_catalog_is_large():
    cases = len(OVERRIDES) + len(RECIPES) + len(DATA) + len(MODEL_DIRS) + len(ENVIRONMENT) + len(INIT_FROM) + 4
    assert cases >= 100, cases


def test_the_valid_sets_are_the_libraries_own():
    """The schedulers are transformers' SchedulerType; the optimizers those both transformers and the
    planner know; the attention implementations transformers registers."""
    from transformers import SchedulerType
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.training_args import OptimizerNames

    from qlora_recipes.planner.constants import OPTIMIZERS as PLANNED
    from qlora_recipes.run.validate import ATTENTION, OPTIMIZERS, SCHEDULERS

    assert set(SCHEDULERS) == {s.value for s in SchedulerType}
    assert set(OPTIMIZERS) == {n for n in PLANNED if n in {o.value for o in OptimizerNames}}
    # plus ours: auto (config/attention.py) and sdpa_varlen (registered with transformers when it loads)
    assert set(ATTENTION) == {"eager", "auto", "sdpa_varlen", *ALL_ATTENTION_FUNCTIONS.keys()}


def test_warmup_ratio_and_steps_reach_the_trainer_as_themselves(tmp_path):
    from conftest import compose_cfg

    from qlora_recipes.run.trainer_args import sft_config

    ratio = sft_config(compose_cfg("optim.warmup_ratio=0.25"), tmp_path, "prompt_completion", False, False)
    assert ratio.warmup_steps == 0.25 and ratio.get_warmup_steps(100) == 25
    steps = sft_config(compose_cfg("optim.warmup_steps=5"), tmp_path, "prompt_completion", False, False)
    assert steps.warmup_steps == 5 and steps.get_warmup_steps(100) == 5


# ---------------------------------------------------------------------------------------------
# The real command, in a fresh process: one line on stderr, nothing else (no warnings filtered).
# ---------------------------------------------------------------------------------------------
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
ENV.pop("PYTHONWARNINGS", None)


def real(*args: str, entry: tuple[str, ...] = (str(REPO / "train.py"),), env: dict | None = None, cwd=REPO):
    return subprocess.run(
        [sys.executable, *entry, *args], cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "entry,args,needles",
    [
        ((str(REPO / "train.py"),), ["optim.scheduler=bogus"], ["error: optim.scheduler=bogus"]),
        (
            (str(REPO / "train.py"),),
            ["trainer.micro_batch_sise=2"],
            ["micro_batch_sise", "`python train.py --cfg job`"],
        ),
        (("-m", "qlora_recipes", "train"), ["peft.target_modules=42"], ["error: peft.target_modules=42"]),
        (
            ("-m", "qlora_recipes", "train"),
            ["trainer.save_steps=5", "trainer.save_total_limit=0"],
            ["save_total_limit"],
        ),
    ],
)
def test_the_real_command_prints_one_line(entry, args, needles, tmp_path):
    run_dir = tmp_path / "run"
    proc = real(*SMOKE, *args, f"hydra.run.dir={run_dir}", entry=entry, cwd=tmp_path)
    assert_refused(proc.returncode, proc.stderr, needles, run_dir)
    assert "Error executing job" not in proc.stdout + proc.stderr


def test_the_real_command_with_hydra_full_error_0_still_prints_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = real(*SMOKE, "trainer.eval_steps=-5", f"hydra.run.dir={run_dir}", env={**ENV, "HYDRA_FULL_ERROR": "0"})
    assert_refused(proc.returncode, proc.stderr, ["trainer.eval_steps=-5"], run_dir)


@pytest.mark.slow  # imports torch and loads the tokenizer first: the in-process data cases cover the rest
def test_the_real_command_refuses_bad_data_in_one_line(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(GOOD_ROWS + '{"prompt": "order: ba\\n"}\n')
    run_dir = tmp_path / "run"
    proc = real(*SMOKE, f"data.path={bad}", "data.eval_fraction=0", f"hydra.run.dir={run_dir}")
    assert_refused(proc.returncode, proc.stderr, ["train.jsonl line 4", "'completion'"], run_dir)


def test_config_checks_run_before_torch_is_imported():
    code = (
        "import sys; from qlora_recipes.config.loader import load; from qlora_recipes.run.validate import check_config; "
        "check_config(load(['trainer=smoke'])); assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_missing_data_file_is_refused_before_torch_is_imported(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-X", "importtime", "train.py", "data.path=no-such.jsonl", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    said = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("import time:")]
    assert proc.returncode == 2 and len(said) == 1 and "data.path: no-such.jsonl does not exist" in said[0], said
    assert "torch" not in imported and not run_dir.exists()


@pytest.mark.parametrize("delay", [0.4, pytest.param(1.2, marks=pytest.mark.slow)])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(delay, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "train.py", *SMOKE, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert [ln for ln in stderr.splitlines() if ln.strip()] == [ln for ln in stderr.splitlines() if "SIGINT" in ln]
    assert not run_dir.exists()
