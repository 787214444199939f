"""A conf/model entry of a vision-language checkpoint carries its vision_config: the planner's figures hold
it (as JSON), transformers builds the whole VLM from the entry on the meta device, the vision tower's
parameters are the checkpoint's, the language model's inventory leaves the tower to the vision row and
counts mllama's cross-attention layers where config.json lists them, and the entry trains as a VLM."""

import json

import pytest
from conftest import compose_cfg

from qlora_recipes.errors import UserError
from qlora_recipes.model.vision import is_vision_language, vision_prefixes
from qlora_recipes.planner import figures

# entry -> the parameters its model card publishes (the safetensors' count)
ENTRIES = {"qwen2.5-vl-7b": 8.29e9, "gemma3-12b": 12.19e9, "llama3.2-11b-vision": 10.67e9}


def _fig(entry: str, *overrides: str) -> figures.Figures:
    return figures.model_figures(compose_cfg(f"model={entry}", *overrides).model)


def _vision_params(meta) -> int:
    return sum(p.numel() for prefix in vision_prefixes(meta) for p in meta.get_submodule(prefix).parameters())


def _total(meta) -> int:
    """Every parameter once, tied ones too (the meta device does not tie them)."""
    tied = {k for k in getattr(meta, "all_tied_weights_keys", {}) or {}}
    return sum(p.numel() for n, p in meta.named_parameters(remove_duplicate=True) if n not in tied)


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_entrys_vision_config_builds_the_whole_vlm_on_the_meta_device(entry):
    fig = _fig(entry)
    vc = json.loads(fig.vision_config_json)
    assert vc == dict(compose_cfg(f"model={entry}").model.vision_config)  # verbatim, nested lists too
    meta = figures.meta_model(fig, "bfloat16")
    assert type(meta).__name__.endswith("ForConditionalGeneration")
    assert meta.config.vision_config.hidden_size == vc["hidden_size"]
    assert _total(meta) == pytest.approx(ENTRIES[entry], rel=0.005)
    # the language model's inventory leaves the tower to the vision row (planner/vision.py)
    inventory = figures._meta_inventory(fig)
    prefixes = vision_prefixes(meta)
    assert prefixes and not [b.name for b in inventory if b.name.startswith(tuple(prefixes))]
    in_inventory = sum(n for b in inventory for n in _block_numels(b))
    assert in_inventory + _vision_params(meta) == _total(meta)


def _block_numels(block) -> list[int]:
    out = [n for _, n in block.params] + [n for _, n in block.experts]
    return out + [lin.in_features * lin.out_features for lin in block.linears]


def test_gemma3s_siglip_tower_and_projector_are_counted_by_shape():
    """SigLIP so400m at 896 px (27 layers of 1152, MLP 4304, 14-px patches) and Gemma 3's projector
    (an RMSNorm of the tower's width, a 1152 x 3840 projection): counted here from the shapes alone."""
    meta = figures.meta_model(_fig("gemma3-12b"), "bfloat16")
    h, mlp, layers, patches = 1152, 4304, 27, (896 // 14) ** 2
    layer = 4 * (h * h + h) + (h * mlp + mlp) + (mlp * h + h) + 2 * 2 * h
    embeddings = 3 * 14 * 14 * h + h + patches * h
    tower = layers * layer + embeddings + 2 * h
    projector = h * 3840 + h
    assert _vision_params(meta) == tower + projector


def test_mllamas_text_inventory_has_cross_attention_at_the_listed_layers():
    fig = _fig("llama3.2-11b-vision")
    assert fig.cross_attention_layers == (3, 8, 13, 18, 23, 28, 33, 38)
    layers = [b for b in figures._meta_inventory(fig) if b.is_layer]
    assert len(layers) == fig.num_layers == 40
    cross = [i for i, b in enumerate(layers) if any(".cross_attn." in lin.name for lin in b.linears)]
    assert cross == list(fig.cross_attention_layers)
    q = next(lin for lin in layers[3].linears if lin.name.endswith("cross_attn.k_proj"))
    assert (q.in_features, q.out_features) == (4096, 8 * 128)  # reads the projected image features
    assert not any(".self_attn." in lin.name for lin in layers[3].linears)
    gates = {name.rsplit(".", 1)[-1] for name, _ in layers[3].params}
    assert {"cross_attn_attn_gate", "cross_attn_mlp_gate"} <= gates
    # moved elsewhere, the cross-attention layers move in the model too: the inventory is by shape
    moved = _fig("llama3.2-11b-vision", "model.num_layers=6", "model.figures.cross_attention_layers=[1,4]")
    moved_layers = [b for b in figures._meta_inventory(moved) if b.is_layer]
    assert [i for i, b in enumerate(moved_layers) if any(".cross_attn." in x.name for x in b.linears)] == [1, 4]


def test_an_entry_with_a_vision_config_trains_as_a_vision_language_model():
    assert is_vision_language(compose_cfg("model=qwen2.5-vl-7b").model)
    assert is_vision_language(compose_cfg("model=llama3.2-11b-vision").model)
    assert not is_vision_language(compose_cfg("model=qwen2.5-7b").model)
    assert not is_vision_language(compose_cfg("model=qwen2.5-vl-7b", "model.vision=false").model)
    assert figures.model_figures(compose_cfg("model=qwen2.5-7b").model).vision_config_json is None


@pytest.mark.parametrize("value", ["3", "[1,2]", "{}", "siglip"])
def test_a_vision_config_that_is_no_mapping_is_refused_in_one_line(value):
    cfg = compose_cfg("model=qwen2.5-7b", f"model.vision_config={value}")
    with pytest.raises(UserError, match=r"model\.vision_config=.* must be a mapping of the checkpoint's"):
        figures.model_figures(cfg.model)


def _cached_config(entry: str) -> dict:
    """The checkpoint's config.json as transformers saves it: its own model_type at the top, the language
    model's figures in a text_config of the text model's type, the vision_config beside it."""
    model = compose_cfg(f"model={entry}").model
    text_type = {"gemma3": "gemma3_text", "mllama": "mllama_text_model"}[model.architecture]
    text = {
        "model_type": text_type,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_embeddings,
        **dict(model.figures or {}),
    }
    return {"model_type": model.architecture, "text_config": text, "vision_config": dict(model.vision_config)}


@pytest.mark.parametrize("entry,repo", [("gemma3-12b", "google/gemma-3-12b-it"),
                                        ("llama3.2-11b-vision", "meta-llama/Llama-3.2-11B-Vision-Instruct")])  # fmt: skip
def test_an_entry_agrees_with_its_cached_multimodal_config_json(tmp_path, monkeypatch, entry, repo):
    """Once the checkpoint is downloaded its config.json is read: the entry names the checkpoint's own
    model_type, the figures come from its text_config (another model_type), and that is no contradiction."""
    from huggingface_hub import constants
    from test_plans_describe_the_model_that_loads import fake_hub_cache

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_hub_cache(tmp_path / "cache", repo, _cached_config(entry))
    fig = _fig(entry)
    assert fig.source.startswith(f"{repo}'s config.json from the HF cache") and fig.config_dir
    assert figures.vision_language(fig) and fig.vision_config_json is None  # the dir's own vision_config
    wider = _cached_config(entry)
    wider["text_config"]["hidden_size"] = 64
    fake_hub_cache(tmp_path / "other", repo, wider)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "other"))
    with pytest.raises(UserError, match="contradicts"):
        _fig(entry)
