"""A vision-language model is told by its config.json's shape, loads through AutoModelForImageTextToText
with its processor, keeps its vision tower and projector unquantized in the compute dtype, and gets LoRA
on its language model's linears only (a tiny LLaVA built offline)."""

import json

import pytest
from conftest import REPO, compose_cfg
from helpers_vision import build_llava

from qlora_recipes.errors import UserError


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


def _model_cfg(*overrides):
    return compose_cfg(*overrides).model


def test_a_model_is_vision_language_by_its_config_shape_or_its_entry(llava, tmp_path):
    from qlora_recipes.model.vision import config_is_vision_language, is_vision_language

    assert is_vision_language(_model_cfg(f"model.name_or_path={llava}"))
    assert not is_vision_language(_model_cfg(f"model.name_or_path={REPO / 'assets/tiny-llama'}"))
    assert not is_vision_language(_model_cfg(f"model.name_or_path={llava}", "model.vision=false"))
    assert is_vision_language(_model_cfg("model.vision=true"))
    # by shape: a vision sub-config; a model type transformers loads only as image-text-to-text
    assert config_is_vision_language({"model_type": "anything", "vision_config": {"hidden_size": 8}})
    assert config_is_vision_language({"model_type": "llava"})
    assert not config_is_vision_language({"model_type": "gemma3_text"})
    assert not config_is_vision_language(json.loads((REPO / "assets/tiny-llama/config.json").read_text()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # bf16: cast back after k-bit prep's fp32 upcast
def test_the_vision_tower_stays_unquantized_and_lora_is_on_the_language_model_only(llava, tmp_path, precision):
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    from qlora_recipes.model import loading
    from qlora_recipes.model.vision import vision_prefixes

    cfg = compose_cfg(f"model.name_or_path={llava}", "quant=nf4", "optim=paged8bit", f"precision={precision}")
    base = loading.load_model(cfg, tmp_path)
    assert type(base).__name__ == "LlavaForConditionalGeneration"
    prefixes = vision_prefixes(base)
    assert prefixes == ["model.vision_tower", "model.multi_modal_projector"]
    model = loading.make_trainable(cfg, base)

    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit, "the language model is in 4 bits"
    assert all(".language_model." in n for n in four_bit), [n for n in four_bit if ".language_model." not in n]
    compute = loading.torch_dtype(cfg.precision.dtype)
    vision = [(n, p) for n, p in model.named_parameters() if ".vision_tower." in n or ".multi_modal_projector." in n]
    assert vision and all(p.dtype == compute and not p.requires_grad for _, p in vision)
    assert all(type(p).__name__ != "Params4bit" for _, p in vision)

    lora = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    assert lora and all(".language_model." in n for n in lora), lora
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".language_model." in n and "lora_" in n for n in trained)


def test_lora_targets_outside_the_language_model_are_one_line(llava):
    from qlora_recipes.model.vision import lora_on_language_model, meta_model

    cfg = compose_cfg(f"model.name_or_path={llava}", "peft.target_modules=[q_proj,fc1]")
    meta = meta_model(str(llava), False)
    with pytest.raises(UserError, match=r"peft.target_modules: \['fc1'\] name no linear layer of the language model"):
        lora_on_language_model(cfg.peft, meta)
    picked = lora_on_language_model(
        compose_cfg(f"model.name_or_path={llava}", "peft.target_modules=[q_proj]").peft, meta
    )
    assert picked.target_modules == r"model\.language_model\..*\.(q_proj)"


@pytest.mark.parametrize("precision, dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_the_plan_counts_the_vision_tower_and_projector_at_the_compute_dtype(llava, precision, dtype):
    from transformers import AutoModelForImageTextToText

    from qlora_recipes import planner
    from qlora_recipes.units import fmt_bytes

    cfg = compose_cfg(
        f"model.name_or_path={llava}", "quant=nf4", "optim=paged8bit", "trainer=smoke", f"precision={precision}"
    )
    plan = planner.plan(cfg)
    model = AutoModelForImageTextToText.from_pretrained(str(llava))
    vision = sum(
        p.numel() for n, p in model.named_parameters() if ".vision_tower." in n or ".multi_modal_projector." in n
    )
    assert plan["counts"]["params_total"] == sum(p.numel() for p in model.parameters())
    notes = [n for n in plan["notes"] if n.startswith("vision:")]
    assert notes[0].startswith(
        f"vision: the vision tower and projector ({vision:,} params) stay unquantized in {dtype}; the sequence "
        "counts each image's tokens; the tower's forward (2 layers of 5 patches an image, 5 image tokens each"
    )
    # k-bit prep casts a 16-bit tower to fp32 while loading: 2 bytes more a parameter, in the note's size
    upcast = [f"vision: k-bit prep holds the tower in fp32 while loading (+{fmt_bytes(2 * vision)})"]
    assert notes[1:] == (upcast if dtype == "bfloat16" else [])
    text = planner.plan(compose_cfg("quant=nf4", "optim=paged8bit", "trainer=smoke"))
    assert not [n for n in text["notes"] if n.startswith("vision:")]


@pytest.mark.parametrize(
    "override, line",
    [
        ("objective=dpo", "objective=dpo: a vision-language model trains with objective=sft"),
        ("dist=fsdp", "dist=fsdp: a vision-language model trains with objective=sft, without sharding"),
        (
            "offload=cpu",
            "offload.device_map=auto: a vision-language model trains with objective=sft, without sharding or offloading",
        ),
    ],
)
def test_what_a_vlm_does_not_train_with_yet_is_one_line(llava, override, line):
    from qlora_recipes.model.vision import refuse_untried

    with pytest.raises(UserError, match=line.replace("(", r"\(")):
        refuse_untried(compose_cfg(f"model.name_or_path={llava}", override))
    refuse_untried(compose_cfg(override))  # a text model: not this check's to refuse
