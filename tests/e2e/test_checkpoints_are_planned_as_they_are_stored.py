"""Runs of checkpoints stored otherwise than they train, each `python train.py` in its own process,
measured within 10 % of their plan: an fp32 checkpoint trained in bf16 (its fp32 pages while loading),
a bf16 checkpoint trained in fp32 (no pages outlive the conversion), one stored in NF4 (trained and
recorded as stored); and a dir whose config.json is already RoPE-scaled trains past its native positions.
The model: 4 layers of hidden 1024 (46 M parameters in linears, the bytes that decide these peaks)
and a short vocabulary, so a step is quick on a CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, train_py, train_smoke

from bench.models import write_text_data, write_tokenizer

VOCAB = 8000


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict[str, Path]:
    """One random model saved three ways: float32, bfloat16 and NF4 (transformers' quantization_config)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    root = tmp_path_factory.mktemp("stored")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16
    )
    config.num_key_value_heads, config.max_position_embeddings = 8, 512
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dirs = {name: root / name for name in ("float32", "bfloat16", "nf4")}
    for name in ("float32", "bfloat16"):
        model.to(getattr(torch, name)).save_pretrained(dirs[name])
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    nf4 = AutoModelForCausalLM.from_pretrained(dirs["bfloat16"], quantization_config=quant, device_map={"": "cpu"})
    nf4.save_pretrained(dirs["nf4"])
    for folder in dirs.values():
        write_tokenizer(folder, VOCAB, byte_alphabet=False)
        write_text_data(folder / "data.jsonl", VOCAB, rows=16, min_words=300, max_words=300)
    return dirs


def run(folder: Path, run_dir: Path, *overrides: str) -> tuple[dict, Path]:
    metrics, run_dir, _ = train_py(
        run_dir,
        f"model.name_or_path={folder}",
        f"data.path={folder / 'data.jsonl'}",
        "data.format=text",
        "data.eval_fraction=0",
        "data.metric=null",
        "trainer.max_steps=2",
        "trainer.grad_accum=1",
        "trainer.save_steps=0",
        "trainer.eval_steps=0",
        "trainer.micro_batch_size=1",
        "trainer.seq_len=64",
        *overrides,
    )
    return metrics, run_dir


def test_an_fp32_checkpoint_trained_in_bf16_is_planned_with_its_pages_while_loading(stored, tmp_path):
    metrics, run_dir = run(stored["float32"], tmp_path / "run", "quant=none", "optim=adamw", "precision=bf16")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["components"]["load_transient"]["cpu"] > 0.15 * 2**30  # the fp32 file beside its bf16 copies
    assert 0.9 <= metrics["plan_ratio"] <= 1.1, metrics


def test_a_bf16_checkpoint_trained_in_fp32_plans_no_pages_once_converted(stored, tmp_path):
    metrics, run_dir = run(stored["bfloat16"], tmp_path / "run", "precision=fp32")
    assert "checkpoint_pages" not in json.loads((run_dir / "plan.json").read_text())["components"]
    assert 0.9 <= metrics["plan_ratio"] <= 1.1, metrics


def test_an_nf4_checkpoint_trains_and_is_recorded_as_stored(stored, tmp_path):
    metrics, run_dir = run(stored["nf4"], tmp_path / "run", "precision=bf16")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["stack"]["quant"] == "nf4+dq" and "method: nf4" in (run_dir / "config.yaml").read_text()
    assert 0.9 <= metrics["plan_ratio"] <= 1.1, metrics


def test_a_dir_already_rope_scaled_trains_past_its_native_positions(tmp_path):
    scaled = tmp_path / "scaled"
    shutil.copytree(REPO / "assets" / "tiny-llama", scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (scaled / "config.json").write_text(json.dumps(config))
    metrics, run_dir = train_smoke(tmp_path / "run", f"model.name_or_path={scaled}", "trainer.seq_len=512")
    assert metrics["steps"] == 3 and json.loads((run_dir / "plan.json").read_text())["stack"]["seq_len"] <= 512
