"""Each vision-language family beyond LLaVA (tiny, built offline) loads with its language model in NF4 and
LoRA, its vision parts unquantized and frozen: the parts kept out of bitsandbytes are found on the model
transformers builds (Qwen's `visual`, Gemma 3's `multi_modal_projector`, mllama's `vision_model` beside a
language model that holds its cross-attention layers, Idefics3's `connector`), and the loader and the
planner name the same parts. Qwen-VL and SmolVLM processors need torchvision: without it, one line."""

import importlib.util

import helpers_vlm_families as fam
import pytest
import torch
from conftest import compose_cfg

from qlora_recipes.errors import UserError

# model_type -> (class transformers builds, the language model's prefix, the parts beside it)
EXPECTED = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "model.language_model", ["model.visual"]),
    "gemma3": (
        "Gemma3ForConditionalGeneration",
        "model.language_model",
        ["model.vision_tower", "model.multi_modal_projector"],
    ),
    "mllama": (
        "MllamaForConditionalGeneration",
        "model.language_model",
        ["model.vision_model", "model.multi_modal_projector"],
    ),
    "idefics3": ("Idefics3ForConditionalGeneration", "model.text_model", ["model.vision_model", "model.connector"]),
    "smolvlm": ("SmolVLMForConditionalGeneration", "model.text_model", ["model.vision_model", "model.connector"]),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "model.language_model", ["model.visual"]),
}
NEEDS_TORCHVISION = ("qwen2_5_vl", "qwen3_vl", "smolvlm")


@pytest.fixture(scope="module", params=fam.FAMILIES)
def family(request, tmp_path_factory):
    kind = request.param
    return kind, getattr(fam, f"build_{kind}")(tmp_path_factory.mktemp(kind) / "model")


def _under(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_each_family_finds_its_vision_parts_on_the_model_transformers_builds(family):
    from qlora_recipes.model.vision import is_vision_language, language_model, meta_model, vision_prefixes

    kind, path = family
    cls, lm, parts = EXPECTED[kind]
    assert is_vision_language(compose_cfg(f"model.name_or_path={path}").model)
    meta = meta_model(str(path), False)
    assert type(meta).__name__ == cls
    assert language_model(meta)[0] == lm
    assert vision_prefixes(meta) == parts


def test_each_family_keeps_its_vision_parts_out_of_4_bits_and_lora_on_its_language_model(family, tmp_path):
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import meta_model, skipped_from_quantization, vision_prefixes

    kind, path = family
    _, lm, parts = EXPECTED[kind]
    cfg = compose_cfg(f"model.name_or_path={path}", "quant=nf4", "optim=paged8bit", "precision=bf16")
    base = loading.load_model(cfg, tmp_path)
    # the loader and the planner (which counts the vision row from the meta model) name the same parts
    assert vision_prefixes(base) == vision_prefixes(meta_model(str(path), False)) == parts
    assert set(parts) <= set(skipped_from_quantization(cfg.model, None))
    model = loading.make_trainable(cfg, base)

    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all(f".{lm}." in n for n in four_bit), [n for n in four_bit if f".{lm}." not in n]
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and f".{lm}." not in n]
    assert plain and all(_under(n.split(".", 2)[-1], parts) or n.endswith("lm_head") for n in plain), plain
    vision = [(n, p) for n, p in model.named_parameters() if _under(n.split(".", 2)[-1], parts)]
    assert vision and all(p.dtype == torch.bfloat16 and not p.requires_grad for _, p in vision)

    lora = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    assert lora and all(f".{lm}." in n for n in lora), [n for n in lora if f".{lm}." not in n]
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(f".{lm}." in n and "lora_" in n for n in trained)
    if kind == "mllama":  # its cross-attention layers read the image: part of the language model, adapted
        assert any(".cross_attn.k_proj" in n for n in lora)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision loads these processors")
@pytest.mark.parametrize("kind", NEEDS_TORCHVISION)
def test_a_processor_that_needs_torchvision_is_one_line_without_it(kind, tmp_path):
    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import load_processor

    path = getattr(fam, f"build_{kind}")(tmp_path / "model")
    cfg = compose_cfg(f"model.name_or_path={path}")
    with pytest.raises(UserError) as err:
        load_processor(cfg.model, loading.source(cfg.model))
    assert str(err.value) == (
        f"could not load the processor of vision-language model.name_or_path={path} "
        f"({'SmolVLM' if kind == 'smolvlm' else 'Qwen2VL'}VideoProcessor requires the Torchvision library but it "
        "was not found in your environment); install the torchvision built for your torch, then run again"
    )


def test_a_processor_missing_another_package_names_that_package(tmp_path, monkeypatch):
    """SmolVLM's processor also needs num2words (transformers checks it once torchvision is there)."""
    import transformers

    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import load_processor

    path = fam.build_idefics3(tmp_path / "model")

    def needs_num2words(*args, **kwargs):  # transformers' own words, from SmolVLMProcessor.__init__
        raise ImportError(
            "Package `num2words` is required to run SmolVLM processor. Install it with `pip install num2words`."
        )

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", needs_num2words)
    cfg = compose_cfg(f"model.name_or_path={path}")
    with pytest.raises(
        UserError, match=r"\(Package `num2words` is required to run SmolVLM processor\); install the package it names"
    ):
        load_processor(cfg.model, loading.source(cfg.model))
