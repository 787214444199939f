"""A model dir's own config.json decides `model.architecture` and the figures config.yaml records: with
`model.name_or_path=DIR` alone the default entry's Llama figures give way to DIR's (a local dir, or a hub
id whose config.json is in the HF cache), so the family checks (trainer.lean_rmsnorm)
ask the right family; a conf/model entry or an override that contradicts the config.json is one line
naming both."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg
from helpers_families import tiny_config

from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError


def config_only_dir(root: Path, model_type: str, **figures) -> Path:
    """A dir holding only `model_type`'s tiny config.json (nothing here loads weights)."""
    config = tiny_config(model_type)
    for key, value in figures.items():
        setattr(config, key, value)
    config.save_pretrained(str(root / model_type))
    return root / model_type


def test_the_dirs_family_and_figures_replace_the_default_entrys(tmp_path):
    folder = config_only_dir(tmp_path, "qwen3", max_position_embeddings=2048, tie_word_embeddings=True)
    model = compose_cfg(f"model.name_or_path={folder}").model
    figures = (model.hidden_size, model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim)
    assert model.architecture == "qwen3" and figures == (64, 2, 4, 2, 16)
    assert (model.intermediate_size, model.vocab_size, model.max_position_embeddings) == (128, 100, 2048)
    assert model.tie_embeddings is True


def test_a_hub_id_in_the_hf_cache_gives_its_figures(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--org--tiny-gemma" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    tiny_config("gemma3_text").save_pretrained(str(snapshot))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = compose_cfg("model.name_or_path=org/tiny-gemma").model
    assert (model.architecture, model.hidden_size, model.tie_embeddings) == ("gemma3_text", 64, True)


def test_lean_rmsnorm_is_decided_by_the_dirs_family(tmp_path):
    check_stack(compose_cfg(f"model.name_or_path={config_only_dir(tmp_path, 'qwen3')}", "trainer.lean_rmsnorm=true"))
    gemma = compose_cfg(f"model.name_or_path={config_only_dir(tmp_path, 'gemma3_text')}", "trainer.lean_rmsnorm=true")
    with pytest.raises(UserError, match="^trainer.lean_rmsnorm=true: gemma3_text's RMSNorm is not Llama's form"):
        check_stack(gemma)


def test_tiled_mlp_passes_on_an_moe_family_as_on_a_dense_one(tmp_path):
    """model/tiled_moe.py tiles the sparse MoE blocks: no family is refused trainer.tiled_mlp."""
    for family in ("gpt_oss", "qwen3_moe", "smollm3"):
        check_stack(compose_cfg(f"model.name_or_path={config_only_dir(tmp_path, family)}", "trainer.tiled_mlp=true"))


def test_an_entry_that_contradicts_the_dir_is_one_line_naming_both(tmp_path):
    folder = config_only_dir(tmp_path, "qwen2")
    with pytest.raises(UserError) as info:
        compose_cfg("model=qwen2.5-7b", f"model.name_or_path={folder}")
    line = str(info.value)
    assert line.startswith("model=qwen2.5-7b (hidden_size 3584,") and f"contradicts {folder}/config.json" in line
    assert "(hidden_size 64," in line and "drop model=qwen2.5-7b" in line and "\n" not in line


def test_an_override_that_contradicts_the_dir_is_one_line_and_one_that_agrees_passes(tmp_path):
    folder = config_only_dir(tmp_path, "qwen3")
    with pytest.raises(UserError) as info:
        compose_cfg(f"model.name_or_path={folder}", "model.num_layers=32")
    assert str(info.value) == (
        f"model.num_layers=32 contradicts {folder}/config.json (num_layers 2); drop the override: the dir's "
        "config.json gives the figures"
    )
    assert compose_cfg(f"model.name_or_path={folder}", "model.num_layers=2").model.num_layers == 2


def test_train_refuses_the_contradiction_before_writing_anything(tmp_path):
    folder = config_only_dir(tmp_path, "qwen2")
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "train.py", "model=mistral-7b", f"model.name_or_path={folder}", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model=mistral-7b (architecture mistral, ")
    assert not run_dir.exists()
