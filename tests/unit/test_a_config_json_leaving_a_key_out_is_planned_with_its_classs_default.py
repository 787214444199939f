"""A config.json that leaves out a key the planner reads is planned with what transformers' config class
puts there (head_dim, mllama's cross-attention layers), not with a guess: the table of defaults is held to
the config classes themselves."""

import json

import pytest

from qlora_recipes.config.schema import ModelConfig
from qlora_recipes.planner.family_layers import CONFIG_DEFAULTS
from qlora_recipes.planner.figures import model_figures


def _class_default(model_type: str, key: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    text = cfg.get_text_config()
    text.allow_global_per_layer_attribute_access = True  # Gemma 4's head_dim: the global layers have their own
    return getattr(text, key)


@pytest.mark.parametrize("model_type", sorted(CONFIG_DEFAULTS))
def test_each_default_is_the_config_classs_own(model_type):
    for key, value in CONFIG_DEFAULTS[model_type].items():
        assert _class_default(model_type, key) == value, (model_type, key)


def _figures(tmp_path, config: dict):
    folder = tmp_path / config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return model_figures(ModelConfig(name_or_path=str(folder), architecture=config["model_type"]))


SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100)


@pytest.mark.parametrize("model_type, head_dim", [("qwen3", 128), ("gemma3_text", 256), ("llama", 16)])
def test_a_config_without_head_dim_plans_the_heads_transformers_builds(tmp_path, model_type, head_dim):
    fig = _figures(tmp_path, {"model_type": model_type, "num_hidden_layers": 2, **SHAPE})
    assert fig.head_dim == head_dim  # llama's class computes hidden_size / heads, as the planner does without a default


def test_an_mllama_text_config_without_cross_layers_plans_the_defaults_its_depth_builds(tmp_path):
    text = {"model_type": "mllama_text_model", "num_hidden_layers": 10, **SHAPE}
    fig = _figures(tmp_path, {"model_type": "mllama", "text_config": text})
    assert fig.cross_attention_layers == (3, 8)  # MllamaTextConfig's list, cut to the layers there are
