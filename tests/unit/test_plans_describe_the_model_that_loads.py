"""The planner plans the model that loads: a hub id with its own config.json (the HF cache here, never
the network), a checkpoint's own quantization and stored dtype, and the RoPE scaling its config.json
already carries. Tiny models built offline; the runs of these stacks are in
e2e/test_checkpoints_are_planned_as_they_are_stored.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMOKE, compose_cfg
from huggingface_hub import constants

from qlora_recipes.errors import UserError
from qlora_recipes.planner import longest_seq_len, plan
from qlora_recipes.planner.seqlen import auto_cap, positions, refuse_past_positions

TINY = REPO / "assets" / "tiny-llama"
GiB = 2**30


def fake_hub_cache(cache: Path, repo: str, config: dict) -> Path:
    """An HF cache holding `repo`'s config.json only, laid out as huggingface_hub writes it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0123abcd")
    snapshot = root / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot


def qlora_plan(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=REPO,
    )


def wider_tiny_config() -> dict:
    return {**json.loads((TINY / "config.json").read_text()), "hidden_size": 256, "num_hidden_layers": 3}


def test_a_hub_id_in_the_hf_cache_is_planned_with_its_own_figures(tmp_path):
    fake_hub_cache(tmp_path / "cache", "someorg/wider-tiny", wider_tiny_config())
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = qlora_plan("model.name_or_path=someorg/wider-tiny", "--gpus", "24GB", f"hydra.run.dir={tmp_path}", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "figures from someorg/wider-tiny's config.json from the HF cache" in proc.stdout, proc.stdout
    model = json.loads((tmp_path / "plan.json").read_text())["model"]
    assert (model["hidden_size"], model["num_layers"]) == (256, 3)  # not the tiny entry's 128 and 2


@pytest.mark.parametrize(
    "repo, hint",
    [("Qwen/Qwen2.5-7B", "use model=qwen2.5-7b"), ("someorg/no-entry", "use a conf/model entry with its figures")],
)
def test_a_hub_id_offline_and_not_cached_is_one_line_naming_an_entry_or_a_local_dir(tmp_path, repo, hint):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    proc = qlora_plan(f"model.name_or_path={repo}", "--gpus", "24GB", f"hydra.run.dir={tmp_path / 'plan'}", env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: model.name_or_path={repo} is a hub id whose config.json cannot be read")
    assert "HF_HUB_OFFLINE" in lines[0] and hint in lines[0] and "local model dir" in lines[0]
    assert not (tmp_path / "plan" / "plan.json").exists()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def qwen_config(**changes) -> dict:
    """Qwen2.5-7B's figures as its config.json gives them (conf/model/qwen2.5-7b.yaml's source)."""
    figures = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
    figures.update(intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072)
    return {"model_type": "qwen2", "tie_word_embeddings": False, **figures, **changes}


def test_an_entry_whose_figures_contradict_its_cached_config_json_is_one_line(hub_cache):
    fake_hub_cache(hub_cache, "Qwen/Qwen2.5-7B", qwen_config(hidden_size=4096))
    # the config's loader reads the cached config.json first, before a plan is made
    with pytest.raises(
        UserError, match=r"model=qwen2.5-7b \(hidden_size 3584\) contradicts .*config\.json \(hidden_size 4096\)"
    ):
        plan(compose_cfg("model=qwen2.5-7b"), gpus=[24 * GiB], ladder=False)


def test_an_entry_agreeing_with_its_cached_config_json_is_planned_from_it(hub_cache):
    fake_hub_cache(hub_cache, "Qwen/Qwen2.5-7B", qwen_config())
    planned = plan(compose_cfg("model=qwen2.5-7b"), gpus=[24 * GiB], ladder=False)
    assert planned["model"]["figures_from"].startswith("Qwen/Qwen2.5-7B's config.json from the HF cache")
    assert planned["model"]["hidden_size"] == 3584


HEADER = 64 * 1024  # a safetensors file's JSON header, beside its tensors


def loading_beyond_baseline(planned: dict) -> int:
    """The plan's load phase on the CPU less the process baseline: what loading holds at its peak."""
    (cpu,) = [d for d in planned["devices"] if d["device"] == "cpu"]
    return cpu["peak_by_phase"]["load"] - planned["constants"]["cpu_process_baseline_bytes"]


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory) -> Path:
    """The tiny model saved in NF4 by transformers: config.json carries its quantization_config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    out = tmp_path_factory.mktemp("nf4")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
    model = AutoModelForCausalLM.from_pretrained(TINY, quantization_config=quant, device_map={"": "cpu"})
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(out)
    return out


def test_a_quant_that_contradicts_a_quantized_checkpoint_is_one_line_through_train_py(nf4_dir, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *SMOKE, f"model.name_or_path={nf4_dir}", "quant=int8"]
        + [f"hydra.run.dir={run}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "is stored quantized (bitsandbytes nf4, double quant" in lines[0] and "quant=int8: use quant=nf4" in lines[0]
    assert not run.exists() or not any(run.rglob("*.yaml"))


@pytest.mark.parametrize(
    "override, named",
    [("quant=none", "quant=none: use quant=nf4"), ("quant.double_quant=false", "use quant.double_quant=true")],
)
def test_every_contradicting_quant_names_both(nf4_dir, override, named):
    with pytest.raises(UserError, match="stored quantized") as err:
        plan(compose_cfg(*SMOKE, f"model.name_or_path={nf4_dir}", override), gpus=[], ladder=False)
    assert named in str(err.value)


def test_a_quantized_checkpoint_is_planned_as_stored(nf4_dir):
    planned = plan(compose_cfg(*SMOKE, f"model.name_or_path={nf4_dir}", "precision=bf16"), gpus=[], ladder=False)
    file_bytes = (nf4_dir / "model.safetensors").stat().st_size
    assert planned["stack"]["quant"] == "nf4+dq"
    # converted as read (no views of the mapping): the whole file beside the loaded model, then gone
    assert "checkpoint_pages" not in planned["components"]
    assert loading_beyond_baseline(planned) >= file_bytes - HEADER


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16")
    AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(out)
    return out


def test_an_fp32_checkpoint_loaded_in_bf16_plans_its_pages_while_loading():
    """assets/tiny-llama is stored in fp32: loaded in bf16 every tensor is a converted copy, read from a
    mapping of the fp32 file that lives until loading ends."""
    cfg = compose_cfg(*SMOKE, "quant=none", "precision=bf16", "optim=adamw")
    planned = plan(cfg, gpus=[], ladder=False)
    fp32_file = (TINY / "model.safetensors").stat().st_size
    bf16_params = planned["counts"]["params_total"] * 2
    assert loading_beyond_baseline(planned) >= fp32_file - HEADER + bf16_params
    assert "checkpoint_pages" not in planned["components"]


def test_a_bf16_checkpoint_trained_in_fp32_plans_no_pages_past_loading(bf16_dir):
    planned = plan(compose_cfg(*SMOKE, f"model.name_or_path={bf16_dir}", "precision=fp32"), gpus=[], ladder=False)
    assert "checkpoint_pages" not in planned["components"]  # no view outlives the conversion to fp32
    bf16_file = (bf16_dir / "model.safetensors").stat().st_size
    fp32_params = planned["counts"]["params_total"] - planned["counts"]["params_quantized"]
    assert loading_beyond_baseline(planned) >= bf16_file - HEADER + 4 * fp32_params


def test_a_checkpoint_in_the_load_dtype_keeps_its_pages_as_views(bf16_dir):
    """Unchanged: quant=none in the stored dtype, the parameters are views of the file's mapping."""
    planned = plan(compose_cfg(*SMOKE, f"model.name_or_path={bf16_dir}", "quant=none", "precision=bf16"), gpus=[])
    assert "load_transient" not in planned["components"]


@pytest.fixture
def rope_scaled_dir(tmp_path) -> Path:
    """The tiny model with its config.json already scaled: linear RoPE x4 over 256 positions."""
    out = tmp_path / "scaled"
    shutil.copytree(TINY, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_dirs_own_rope_scaling_extends_its_positions(rope_scaled_dir):
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={rope_scaled_dir}", "trainer.seq_len=1024")
    assert positions(cfg.model) == 1024
    refuse_past_positions(cfg)  # no error at 4 x 256
    with pytest.raises(UserError, match=r"1,024 positions \(max_position_embeddings=256 with its config.json"):
        refuse_past_positions(compose_cfg(*SMOKE, f"model.name_or_path={rope_scaled_dir}", "trainer.seq_len=1088"))


def test_seq_len_auto_and_the_longest_seq_search_reach_a_dirs_scaled_positions(rope_scaled_dir):
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={rope_scaled_dir}", "trainer.seq_len=auto")
    cap, why = auto_cap(cfg, lambda trial, **_: {"fits": True}, lambda: None)
    assert cap == 1024 and "config.json's RoPE scaling" in why
    fixed = compose_cfg(*SMOKE, f"model.name_or_path={rope_scaled_dir}")
    assert longest_seq_len(fixed, gpus=[80 * GiB], host_ram=64 * GiB) == 1024
