"""Every model family of the family table trains on CPU under the default command: a tiny model of the
family's own architecture (tests/helpers_families.py builds it from its transformers config class), pointed
at with `model.name_or_path=DIR` alone, under `quant=nf4 optim=paged8bit trainer=smoke`. The dir's
config.json decides `model.architecture` and the figures config.yaml records. Attention is chosen per
family where the sdpa default cannot serve (Gemma 2's soft-capped logits, gpt-oss's sinks: transformers 5
has no sdpa path for them), and a load that fails for attention reasons says so, naming
model.attn_implementation, not the network."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMOKE, compose_cfg
from helpers_families import FAMILY_CONFIGS, build_family

from qlora_recipes.errors import UserError
from qlora_recipes.families import FAMILIES, traits

MODEL_TYPES = sorted(FAMILY_CONFIGS)


def test_every_family_is_covered():
    """Each family of the table (a multimodal checkpoint's by its text model's) and of conf/model is built here."""
    entries = [yaml.safe_load(p.read_text()) for p in (REPO / "conf" / "model").glob("*.yaml")]
    conf = {entry["architecture"] for entry in entries}
    vision = {entry["architecture"] for entry in entries if entry.get("vision_config")}
    for family in set(FAMILIES) | conf:
        built = family if family in FAMILY_CONFIGS else f"{family}_text"
        if family in vision and built not in FAMILY_CONFIGS:
            continue  # a vision-language family: its tiny model trains in the vision-language tests
        # the text model's traits, but for `known`: a multimodal checkpoint's planner needs its vision tower too
        same = built in FAMILY_CONFIGS and replace(traits(built), known=False) == replace(traits(family), known=False)
        assert same, f"build a tiny {family} here"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """model_dir(model_type): its tiny model, built once per module."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_family(model_type, root / model_type)
        return built[model_type]

    return get


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "sort.jsonl"
    words = ["dcba", "cab", "fed", "hgf", "ba", "ji", "lk", "onm", "qp", "tsr", "wvu", "zyx"]
    path.write_text(
        "".join(json.dumps({"prompt": f"order: {w}\n", "completion": "".join(sorted(w))}) + "\n" for w in words)
    )
    return path


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_family_trains_on_cpu_under_the_default_command(model_dir, data_file, tmp_path, caplog, model_type):
    from qlora_recipes.model import loading
    from qlora_recipes.run.training import train

    folder = model_dir(model_type)
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={folder}", f"data.path={data_file}", "quant=nf4", "optim=paged8bit")
    own = json.loads((folder / "config.json").read_text())
    assert (cfg.model.architecture, cfg.model.hidden_size, cfg.model.vocab_size) == (model_type, 64, 100)
    assert cfg.model.tie_embeddings is own.get("tie_word_embeddings", traits(model_type).tie_embeddings)
    assert loading.attention_for(cfg.model) == traits(model_type).attention
    with caplog.at_level("INFO"):
        out = train(cfg, tmp_path / "run")
    assert out["status"] == "ok" and out["steps"] == 3
    assert len(out["train_losses"]) == 3 and all(math.isfinite(x) for x in out["train_losses"])
    assert out["eval_loss"] is not None and math.isfinite(out["eval_loss"])
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert (saved["architecture"], saved["hidden_size"], saved["max_position_embeddings"]) == (model_type, 64, 256)
    assert "could not load" not in caplog.text


def test_sdpa_default_on_a_family_without_sdpa_becomes_eager(model_dir, caplog):
    """model=tiny (attn sdpa, the schema default) pointed at a Gemma 2 dir: eager, said in one line."""
    from qlora_recipes.model import loading

    cfg = compose_cfg(f"model.name_or_path={model_dir('gemma2')}")
    assert cfg.model.attn_implementation == "sdpa"
    with caplog.at_level("INFO", logger="qlora_recipes.model.loading"):
        assert loading.attention_for(cfg.model) == "eager"
    assert "attention: eager for Gemma2ForCausalLM" in caplog.text
    assert loading.attention_for(compose_cfg(f"model.name_or_path={model_dir('llama')}").model) == "sdpa"


@pytest.mark.parametrize("attn", ["flash_attention_2", "no_such_attention"])
def test_attention_load_errors_name_attention_not_the_network(model_dir, tmp_path, attn):
    from qlora_recipes.model import loading

    cfg = compose_cfg(f"model.name_or_path={model_dir('gemma2')}", f"model.attn_implementation={attn}")
    with pytest.raises(UserError) as info:
        loading.load_model(cfg, tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"model.attn_implementation={attn}: ") and "cannot load with this attention" in msg
    assert "model.attn_implementation=eager" in msg and "offline" not in msg and "\n" not in msg
