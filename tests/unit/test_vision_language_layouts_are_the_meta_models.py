"""Gemma 3's, Qwen2.5-VL's, LLaVA's, Idefics3's, SmolVLM's, Qwen3-VL's and Llama-3.2-Vision's (mllama)
vision-language checkpoints are laid out from their figures (planner/vlm_layout.py), not built on the meta
device: the layout is the meta model's inventory block for block (names, linears, parameter counts,
buffers, tied lm_head), its vision row's parameters, tower linears, vision shape and language model's
prefix are the meta model's, and planning their recipes and saved tiny checkpoints imports no
transformers modeling code (nor torch) and plans the peak the meta model's inventory plans."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.planner import figures, vision, vlm_layout
from qlora_recipes.planner.vision_forward import vision_shape


def _fig(*overrides: str) -> figures.Figures:
    return figures.model_figures(compose_cfg(*overrides).model)


def _same(block) -> tuple:
    """A block as compared: every field but the order within it, the layer's mixer (the meta model's
    blocks carry none; only a Gated DeltaNet's is planned apart) and a linear's bias listed among the
    parameters (the meta model's are; layers.py's are the linear's `bias`, counted the same)."""
    biases = {f"{lin.name}.bias" for lin in block.linears}
    return (
        block.name,
        sorted(block.linears, key=lambda lin: lin.name),
        sorted(p for p in block.params if p[0] not in biases),
        sorted(block.buffers),
        sorted(block.embeddings),
        block.is_layer,
        block.tied_to,
        block.experts,
        (block.head_dim, block.kv_heads),
    )


def _tiny_dir(tmp_path, **vision) -> figures.Figures:
    """A local Gemma 3 dir's config.json as transformers saves it (only what differs from the defaults)."""
    from transformers import Gemma3Config

    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    text.update(intermediate_size=128, vocab_size=300)
    config = Gemma3Config(text_config=text, vision_config={"model_type": "siglip_vision_model", **vision})
    config.mm_tokens_per_image = 4
    config.to_json_file(str(tmp_path / "config.json"))
    return figures.model_figures(compose_cfg(f"model.name_or_path={tmp_path}").model)


def _saved(tmp_path, config) -> figures.Figures:
    """A local dir holding `config` as config.json, as transformers saves it (only what differs from the
    defaults, a sub-config's too)."""
    config.to_json_file(str(tmp_path / "config.json"))
    return figures.model_figures(compose_cfg(f"model.name_or_path={tmp_path}").model)


TINY_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=300)  # fmt: skip
TINY_TOWER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip


def _llava(tmp_path, tower: str, text: str, **top) -> figures.Figures:
    from transformers import AutoConfig, LlavaConfig

    vision = AutoConfig.for_model(tower, **TINY_TOWER)
    return _saved(
        tmp_path, LlavaConfig(vision_config=vision, text_config=AutoConfig.for_model(text, **TINY_TEXT), **top)
    )


def _idefics3(tmp_path, family: str, **top) -> figures.Figures:
    from transformers import AutoConfig, LlamaConfig

    config = AutoConfig.for_model(family, vision_config=TINY_TOWER, text_config=LlamaConfig(**TINY_TEXT), **top)
    return _saved(tmp_path, config)


def _qwen3_vl(tmp_path, deepstack: list[int], **text) -> figures.Figures:
    from transformers import Qwen3VLConfig

    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=deepstack)  # fmt: skip
    tiny = {**TINY_TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}, **text}
    return _saved(tmp_path, Qwen3VLConfig(text_config=tiny, vision_config=vision))


def _llava_next(tmp_path, tower: str | None, text: str, **top) -> figures.Figures:
    from transformers import AutoConfig, LlavaNextConfig

    vision = {"vision_config": AutoConfig.for_model(tower, **TINY_TOWER)} if tower else {}
    config = LlavaNextConfig(**vision, text_config=AutoConfig.for_model(text, **TINY_TEXT), **top)
    return _saved(tmp_path, config)


TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _qwen3_vl_moe(tmp_path, deepstack: list[int], **text) -> figures.Figures:
    from transformers import Qwen3VLMoeConfig

    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                  num_position_embeddings=16, deepstack_visual_indexes=deepstack)  # fmt: skip
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    tiny = {**TINY_TEXT, **TINY_MOE, "rope_parameters": rope, "tie_word_embeddings": False, **text}
    return _saved(tmp_path, Qwen3VLMoeConfig(text_config=tiny, vision_config=vision))


def _text_config_edited(fig: figures.Figures, **keys) -> figures.Figures:
    """The dir's config.json with its text_config's `keys` set (None: left out), its figures read again."""
    path = Path(str(fig.config_dir)) / "config.json"
    cj = json.loads(path.read_text())
    for key, value in keys.items():
        cj["text_config"].pop(key, None)
        if value is not None:
            cj["text_config"][key] = value
    path.write_text(json.dumps(cj))
    return figures.model_figures(compose_cfg(f"model.name_or_path={fig.config_dir}").model)


def _without_head_dim(fig: figures.Figures) -> figures.Figures:
    """The dir's config.json with its text_config's head_dim left out, its figures read again."""
    path = Path(str(fig.config_dir)) / "config.json"
    cj = json.loads(path.read_text())
    del cj["text_config"]["head_dim"]
    path.write_text(json.dumps(cj))
    return figures.model_figures(compose_cfg(f"model.name_or_path={fig.config_dir}").model)


def _mllama(tmp_path, **text) -> figures.Figures:
    from transformers import MllamaConfig

    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=28, patch_size=14, max_num_tiles=2, vision_output_dim=64,
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])  # fmt: skip
    tiny = {**{k: v for k, v in TINY_TEXT.items() if k != "head_dim"}, "pad_token_id": 0}
    return _saved(tmp_path, MllamaConfig(text_config={**tiny, **text}, vision_config=vision))


CASES = {
    # no vision_config: Gemma3Config's default SigLIP, its linears planned (and adapted) with the text's
    "gemma3-27b": lambda tmp: _fig("model=gemma3-27b"),
    # the entry's vision_config: the language model in the inventory, the tower and projector a row apart
    "gemma3-12b": lambda tmp: _fig("model=gemma3-12b"),
    # the entry's vision_config, Qwen2_5_VLVisionConfig's defaults for the rest: the tower and merger a row
    "qwen2.5-vl-7b": lambda tmp: _fig("model=qwen2.5-vl-7b"),
    # a saved config.json: SigLIP's defaults fill what it leaves out (its pooling head); a tiny tower
    "tiny-dir": lambda tmp: _tiny_dir(tmp, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, image_size=32, patch_size=8),
    # LLaVA: a CLIP tower (its class token), a llama text model under model.language_model
    "llava-clip-llama": lambda tmp: _llava(tmp, "clip_vision_model", "llama"),
    # a SigLIP tower (its pooling head), two feature layers concatenated into the projector, a tied qwen2
    "llava-siglip-qwen2": lambda tmp: _llava(tmp, "siglip_vision_model", "qwen2", vision_feature_layer=[-2, -1],
                                             tie_word_embeddings=True),
    # no vision_config at all: LlavaConfig's CLIP-L/14 at 336 px; a projector without biases
    "llava-default-tower": lambda tmp: _saved(tmp, __import__("transformers").LlavaConfig(
        text_config=__import__("transformers").MistralConfig(**TINY_TEXT), multimodal_projector_bias=False)),
    # Idefics3: the tower under model.vision_model, the pixel shuffle's connector, model.text_model
    "idefics3": lambda tmp: _idefics3(tmp, "idefics3", scale_factor=2),
    # SmolVLM: the same tree, a larger shuffle, tied at the top level
    "smolvlm": lambda tmp: _idefics3(tmp, "smolvlm", scale_factor=1, tie_word_embeddings=True),
    # Qwen3-VL: Qwen3's layers under model.language_model, the tower's merger and two deepstack mergers
    "qwen3-vl": lambda tmp: _qwen3_vl(tmp, [0, 1]),
    # biases on q/k/v/o, no deepstack layer
    "qwen3-vl-biased": lambda tmp: _qwen3_vl(tmp, [], attention_bias=True),
    # a text_config saved without its head_dim: Qwen3VLTextConfig's 128, not hidden / heads
    "qwen3-vl-head-dim": lambda tmp: _without_head_dim(_qwen3_vl(tmp, [1], head_dim=128)),
    # Llama-3.2-Vision's entry: cross-attention layers at the figures' indices, the tiled tower's 32 local
    # and 8 global layers, the projector one linear
    "llama3.2-11b-vision": lambda tmp: _fig("model=llama3.2-11b-vision"),
    # a saved mllama: its text_config's cross-attention layer
    "mllama-dir": lambda tmp: _mllama(tmp, cross_attention_layers=[1], num_hidden_layers=3),
    # a text_config without cross_attention_layers: MllamaTextConfig's list, the layers it reaches
    "mllama-default-cross": lambda tmp: _mllama(tmp, num_hidden_layers=9),
    # LLaVA-NeXT: LLaVA's CLIP tower and projector, image_newline a block of its own beside the text model
    "llava-next-clip-llama": lambda tmp: _llava_next(tmp, "clip_vision_model", "llama",
                                                     image_grid_pinpoints=[[28, 56], [56, 56]]),
    # a SigLIP tower, two feature layers into a bias-free projector, a tied qwen2
    "llava-next-siglip-qwen2": lambda tmp: _llava_next(tmp, "siglip_vision_model", "qwen2",
                                                       vision_feature_layer=[-2, -1], tie_word_embeddings=True,
                                                       multimodal_projector_bias=False),
    # no vision_config: LlavaNextConfig's CLIP-L/14 at 336 px and its default pinpoints
    "llava-next-default-tower": lambda tmp: _llava_next(tmp, None, "mistral"),
    # Qwen3-VL-MoE: Qwen3-MoE's layers (router, 3-D experts) under model.language_model, two deepstack mergers
    "qwen3-vl-moe": lambda tmp: _qwen3_vl_moe(tmp, [0, 1]),
    # biased q/k/v/o, tied at the top level, no deepstack layer
    "qwen3-vl-moe-biased-tied": lambda tmp: _qwen3_vl_moe(tmp, [], attention_bias=True, tie_word_embeddings=True),
    # the experts' count under its older name; top-k, the experts' width, head_dim and the text's tie left
    # out: the class's 4, 1408, hidden / heads and (untied at the top level) an lm_head of its own
    "qwen3-vl-moe-defaults": lambda tmp: _text_config_edited(
        _qwen3_vl_moe(tmp, [1]), num_local_experts=None, num_experts=3, num_experts_per_tok=None,
        moe_intermediate_size=None, head_dim=None, tie_word_embeddings=None),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_vlms_layout_is_the_meta_models_inventory_and_vision_parts(tmp_path, case):
    import torch

    from qlora_recipes.model.vision import language_model, vision_prefixes
    from qlora_recipes.model.vision_tower import tower_prefix

    fig = CASES[case](tmp_path)
    known = vlm_layout.layout(fig)
    assert known is not None
    analytic = figures.inventory(fig)
    meta_blocks = figures._meta_inventory(fig)
    assert [_same(b) for b in analytic] == [_same(b) for b in meta_blocks]
    if not figures.vision_language(fig):
        assert [b.name for b in analytic][:2] == [
            "model.vision_tower.embeddings",
            "model.vision_tower.encoder.layers.0",
        ]
        return
    meta = figures.meta_model(fig, "bfloat16")
    prefixes = vision_prefixes(meta)
    assert list(known.prefixes) == prefixes
    assert known.text_prefix == language_model(meta)[0]
    st = type("St", (), {"fig": fig})()
    assert vision.vision_params(st) == sum(p.numel() for x in prefixes for p in meta.get_submodule(x).parameters())
    tower = meta.get_submodule(tower_prefix(meta, prefixes))
    want = [(m.in_features, m.out_features) for m in tower.modules() if isinstance(m, torch.nn.Linear)]
    assert vision.tower_linears(st) == want
    full = meta.config.to_dict()
    assert vision_shape(vision.vision_config(st), fig.hidden_size) == vision_shape(full, fig.hidden_size)
    assert vision.vision_config(st)["vision_config"]["hidden_act"] == full["vision_config"]["hidden_act"]


def test_a_dir_with_its_own_code_or_another_tower_keeps_the_meta_model(tmp_path):
    fig = _tiny_dir(tmp_path, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)
    assert vlm_layout.layout(fig) is not None
    cj = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cj, "auto_map": {"AutoConfig": "own.Config"}}))
    vlm_layout.layout.cache_clear()
    assert vlm_layout.layout(fig) is None
    other = dataclasses.replace(fig, config_dir=None, vision_config_json=json.dumps({"model_type": "clip"}))
    assert vlm_layout.layout(other) is None
    pair = dataclasses.replace(fig, config_dir=None, vision_config_json=json.dumps({"image_size": [224, 160]}))
    assert vlm_layout.layout(pair) is None
    qwen = _fig("model=qwen2.5-vl-7b")
    assert vlm_layout.layout(qwen) is not None
    assert vlm_layout.layout(dataclasses.replace(qwen, config_dir=str(tmp_path))) is None  # its text_config's family
    assert vlm_layout.layout(dataclasses.replace(qwen, vision_config_json=None)) is None  # its tower in the inventory
    (tmp_path / "llava").mkdir()
    llava = _llava(tmp_path / "llava", "clip_vision_model", "llama")
    assert vlm_layout.layout(llava) is not None
    cj = json.loads((tmp_path / "llava" / "config.json").read_text())
    for other in ({"vision_config": {"model_type": "dinov2"}}, {"auto_map": {"AutoConfig": "own.Config"}}):
        (tmp_path / "llava" / "config.json").write_text(json.dumps({**cj, **other}))
        vlm_layout.layout.cache_clear()
        assert vlm_layout.layout(llava) is None, other
    (tmp_path / "llava" / "config.json").write_text(json.dumps(cj))
    # a text family layers.py does not know: the meta model builds it
    assert vlm_layout.layout(dataclasses.replace(llava, architecture="mllama")) is None


def test_a_qwen3_vl_moe_with_dense_layers_among_its_experts_keeps_the_meta_model(tmp_path):
    fig = _qwen3_vl_moe(tmp_path, [0])
    assert vlm_layout.layout(fig) is not None
    for dense in ({"mlp_only_layers": [1]}, {"mlp_only_layers": None, "decoder_sparse_step": 2}):
        vlm_layout.layout.cache_clear()
        assert vlm_layout.layout(_text_config_edited(fig, **dense)) is None, dense


# plans each argument's overrides (space-separated) in a fresh process: which modules planning imports,
# its peaks, its seconds
PLAN_SCRIPT = """
import json, sys, time
from qlora_recipes import planner
from qlora_recipes.config import devices, loader
out = {}
for recipe in sys.argv[1:]:
    cfg = loader.load(recipe.split())
    start = time.perf_counter()
    plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    out[recipe] = {"peak": plan["devices"][0]["peak"], "seconds": time.perf_counter() - start}
out["modules"] = sorted(m for m in sys.modules if m == "torch" or ".modeling_" in m)
print(json.dumps(out))
"""


def test_planning_the_vlm_recipes_builds_no_meta_model_and_keeps_their_peaks(monkeypatch):
    recipes = ["gemma-3-27b-24gb", "gemma-3-12b-vision-24gb", "qwen2.5-vl-7b-16gb", "llama3.2-11b-vision-24gb"]
    _plans_alike_without_the_meta_model([f"recipe={r}" for r in recipes], monkeypatch)


def _plans_alike_without_the_meta_model(plans: list[str], monkeypatch) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PLAN_SCRIPT, *plans], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["modules"] == []  # neither torch nor any transformers modeling module
    # the meta models' plans (the layouts switched off, the text model the meta model's too) peak where
    # the layouts' do
    monkeypatch.setattr(figures, "layout", lambda fig: None)
    monkeypatch.setattr(vision, "layout", lambda fig: None)
    monkeypatch.setattr(figures, "_analytic_inventory", figures._meta_inventory)
    for overrides in plans:
        cfg = compose_cfg(*overrides.split())
        plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
        assert plan["devices"][0]["peak"] == got[overrides]["peak"], overrides


def test_planning_saved_tiny_vlms_of_every_laid_out_family_builds_no_meta_model_and_keeps_their_peaks(
    tmp_path, monkeypatch
):
    import helpers_vlm_families as fam
    from helpers_vision import build_llava

    builds = {"llava": build_llava, "idefics3": fam.build_idefics3, "smolvlm": fam.build_smolvlm}
    builds.update(qwen3_vl=fam.build_qwen3_vl, mllama=fam.build_mllama)
    builds.update(llava_next=fam.build_llava_next, qwen3_vl_moe=fam.build_qwen3_vl_moe)
    on_a_gpu = "hardware.gpus=1 hardware.gpu_memory_gib=24"
    plans = [f"model.name_or_path={build(tmp_path / name)} {on_a_gpu}" for name, build in builds.items()]
    # the MoE's fused experts in 4 bits (quant.experts=4bit, nf4's default) and in the compute dtype
    plans.append(f"{plans[-1]} quant.experts=16bit")
    _plans_alike_without_the_meta_model(plans, monkeypatch)
