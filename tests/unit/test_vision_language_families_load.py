"""Each vision-language family beyond LLaVA (tiny, built offline) loads with its language model in NF4 and
LoRA, its vision parts unquantized and frozen: the parts kept out of bitsandbytes are found on the model
transformers builds (Qwen's `visual`, Gemma 3's `multi_modal_projector`, mllama's `vision_model` beside a
language model that holds its cross-attention layers, Idefics3's `connector`), and the loader and the
planner name the same parts. Qwen-VL and SmolVLM processors build a video processor, which needs
torchvision: without it they load image-only and render image rows the model takes, and the copy a run
saves loads back the same way for merge and generate. A package the processor needs is named in one line."""

import importlib.util
import sys

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
BUILDS_VIDEO = ("qwen2_5_vl", "qwen3_vl", "smolvlm")  # processors that build a video processor
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


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


def _image_row():
    from helpers_vision import COLOURS
    from PIL import Image
    from trl.data_utils import prepare_multimodal_messages

    row = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
    ]
    return prepare_multimodal_messages(row, images=[Image.new("RGB", (56, 28), COLOURS["red"])])


def _render(processor, messages) -> dict:
    """An image row as the trainer's collator renders it (data/images.py counts it the same way)."""
    out = processor.apply_chat_template(
        [messages], tokenize=True, return_dict=True, return_tensors="pt", processor_kwargs={"add_special_tokens": False}
    )
    return dict(out)


@pytest.mark.parametrize("kind", BUILDS_VIDEO)
def test_a_processor_that_builds_a_video_processor_loads_and_renders_image_rows_the_model_takes(kind, tmp_path):
    from transformers import AutoModelForImageTextToText

    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import load_processor
    from qlora_recipes.outputs.generation import load_processor_of

    path = getattr(fam, f"build_{kind}")(tmp_path / "model")
    cfg = compose_cfg(f"model.name_or_path={path}")
    processor = load_processor(cfg.model, loading.source(cfg.model))
    assert type(processor).__name__ == EXPECTED[kind][0].replace("ForConditionalGeneration", "Processor")
    messages = _image_row()
    batch = _render(processor, messages)
    image = processor.image_processor(images=[messages[0]["content"][0]["image"]], return_tensors="pt")
    assert torch.equal(batch["pixel_values"], image["pixel_values"])  # the family's image processor, as it is
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    with torch.no_grad():  # image tokens and image features agree, or the forward refuses
        loss = model(**batch, labels=batch["input_ids"]).loss
    assert torch.isfinite(loss)

    processor.save_pretrained(str(tmp_path / "merged"))  # what train.py and merge save
    again = load_processor_of(tmp_path / "merged", "merged")
    assert type(again).__name__ == type(processor).__name__
    assert all(torch.equal(v, _render(again, messages)[k]) for k, v in batch.items())
    if not HAS_TORCHVISION:
        assert "video_processor" not in processor.get_attributes()
        with pytest.raises(ValueError, match="built without its video processor .*: it renders text and image rows"):
            processor(text=[processor.video_token], videos=[[messages[0]["content"][0]["image"]] * 2])


def test_a_hub_checkout_without_processor_config_loads_its_processor_from_its_image_processor_config(tmp_path):
    """A hub Qwen2.5-VL checkout names its processor in preprocessor_config.json (the torchvision-backed image
    processor class); without that file, one line saying what the dir needs."""
    import json

    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import load_processor

    path = fam.build_qwen2_5_vl(tmp_path / "model")
    (path / "processor_config.json").unlink()
    settings = json.loads((path / "preprocessor_config.json").read_text())
    settings.update(processor_class="Qwen2_5_VLProcessor", image_processor_type="Qwen2VLImageProcessorFast")
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    cfg = compose_cfg(f"model.name_or_path={path}")
    processor = load_processor(cfg.model, loading.source(cfg.model))
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert "pixel_values" in _render(processor, _image_row())

    (path / "preprocessor_config.json").unlink()
    with pytest.raises(UserError, match=r"\(Can't load image processor for .*the dir needs processor_config.json"):
        load_processor(cfg.model, loading.source(cfg.model))


def test_a_processor_missing_a_package_names_it_in_one_line(tmp_path, monkeypatch):
    """SmolVLM's processor needs num2words: without it, one line naming it, and nothing loaded."""
    from transformers.models.smolvlm import processing_smolvlm

    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import load_processor

    path = fam.build_smolvlm(tmp_path / "model")
    monkeypatch.setitem(sys.modules, "num2words", None)  # what importing a package that is not there finds
    monkeypatch.setattr(processing_smolvlm, "num2words", None)  # what transformers bound at import, then
    cfg = compose_cfg(f"model.name_or_path={path}")
    with pytest.raises(UserError) as err:
        load_processor(cfg.model, loading.source(cfg.model))
    assert str(err.value) == (
        f"could not load the processor of vision-language model.name_or_path={path} (Package `num2words` is "
        "required to run SmolVLM processor); install the package it names, then run again"
    )
