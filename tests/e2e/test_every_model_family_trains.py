"""Every model family in conf/model trains on CPU under the default command: a tiny model of the family's
own architecture (built here from its transformers config class), `model=<option>` pointed at it, nothing
else about the model set. Attention is chosen per family where the sdpa default cannot serve (Gemma 2:
transformers 5 has no sdpa path for its soft-capped attention logits), and a load that fails for
attention reasons says so, naming model.attn_implementation, not the network."""

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, compose_cfg

from qlora_recipes.errors import UserError

TINY = REPO / "assets" / "tiny-llama"
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "gemma2": "Gemma2Config"}
# What the loader picks under the default model.attn_implementation (sdpa) for each family.
ATTENTION = {"llama": "sdpa", "mistral": "sdpa", "qwen2": "sdpa", "gemma2": "eager"}


def _families() -> list[tuple[str, str]]:
    """(architecture, the first conf/model option of it), one per family; `tiny` is the shipped Llama."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "conf" / "model").glob("*.yaml")):
        if path.stem != "tiny":
            found.setdefault(yaml.safe_load(path.read_text())["architecture"], path.stem)
    return sorted(found.items())


FAMILIES = _families()


def test_every_family_is_covered():
    assert {arch for arch, _ in FAMILIES} == set(CONFIG_CLASSES), "add the new family's config class here"


def build_tiny(arch: str, out: Path) -> Path:
    """A 2-layer model of `arch` with tiny sizes, random weights, and the shipped character tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = getattr(transformers, CONFIG_CLASSES[arch])(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for f in list(TINY.glob("tokenizer*")) + [TINY / "chat_template.jinja"]:
        shutil.copy(f, out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: build_tiny(arch, root / arch) for arch, _ in FAMILIES}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sort.jsonl"
    words = ["dcba", "cab", "fed", "hgf", "ba", "ji", "lk", "onm", "qp", "tsr", "wvu", "zyx"]
    path.write_text(
        "".join(json.dumps({"prompt": f"order: {w}\n", "completion": "".join(sorted(w))}) + "\n" for w in words)
    )
    return path


@pytest.mark.parametrize("arch, option", FAMILIES, ids=[a for a, _ in FAMILIES])
def test_family_trains_on_cpu_under_the_default_command(models, data_file, tmp_path, caplog, arch, option):
    from qlora_recipes.model import loading
    from qlora_recipes.run.training import train

    cfg = compose_cfg(
        f"model={option}", f"model.name_or_path={models[arch]}", f"data.path={data_file}", "trainer=smoke"
    )
    assert loading.attention_for(cfg.model) == ATTENTION[arch]
    with caplog.at_level("INFO"):
        out = train(cfg, tmp_path / "run")
    assert out["status"] == "ok" and out["steps"] == 3
    assert len(out["train_losses"]) == 3 and all(math.isfinite(x) for x in out["train_losses"])
    assert out["eval_loss"] is not None and math.isfinite(out["eval_loss"])
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert "could not load" not in caplog.text


def test_sdpa_default_on_a_family_without_sdpa_becomes_eager(models, caplog):
    """model=tiny (attn sdpa, the schema default) pointed at a Gemma 2 dir: eager, said in one line."""
    from qlora_recipes.model import loading

    cfg = compose_cfg(f"model.name_or_path={models['gemma2']}")
    assert cfg.model.attn_implementation == "sdpa"
    with caplog.at_level("INFO", logger="qlora_recipes.model.loading"):
        assert loading.attention_for(cfg.model) == "eager"
    assert "attention: eager for Gemma2ForCausalLM" in caplog.text
    assert loading.attention_for(compose_cfg(f"model.name_or_path={models['llama']}").model) == "sdpa"


@pytest.mark.parametrize("attn", ["flash_attention_2", "no_such_attention"])
def test_attention_load_errors_name_attention_not_the_network(models, tmp_path, attn):
    from qlora_recipes.model import loading

    cfg = compose_cfg(f"model.name_or_path={models['gemma2']}", f"model.attn_implementation={attn}")
    with pytest.raises(UserError) as info:
        loading.load_model(cfg, tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"model.attn_implementation={attn}: ") and "cannot load with this attention" in msg
    assert "model.attn_implementation=eager" in msg and "offline" not in msg and "\n" not in msg
