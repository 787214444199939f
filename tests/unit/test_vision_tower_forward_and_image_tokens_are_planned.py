"""A vision-language model's plan counts its vision tower's forward (held to what the tiny LLaVA's tower
allocates on CPU, measured as the planner's other checks measure: torch's allocation events), k-bit prep's
fp32 copy of the tower while loading, and each image's tokens from the processor's settings (held to what
the processors render: LLaVA's fixed size, Qwen2.5-VL's pixel budget, Idefics3's tiles)."""

import json

import pytest
import torch
from conftest import REPO, compose_cfg
from helpers_vision import build_llava
from test_planner_loss_is_trls_fused_head import allocated_peak

from qlora_recipes import planner
from qlora_recipes.planner.vision_forward import (
    forward_bytes,
    image_tokens,
    images_per_row,
    vision_shape,
)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


def _settings(folder) -> dict:
    return json.loads((folder / "processor_config.json").read_text())


def _config(folder) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).to_dict()


@pytest.mark.parametrize("attn,bf16", [("sdpa", True), ("eager", True), ("sdpa", False)])
def test_the_planned_tower_forward_holds_what_the_tiny_llava_tower_allocates(llava, attn, bf16):
    """The tower and projector on a micro-batch's images, frozen, in training mode, under the bf16
    autocast the Trainer runs (or fp32); the pixels made inside, as the collator makes them per step."""
    from transformers import LlavaForConditionalGeneration

    dtype = torch.bfloat16 if bf16 else torch.float32
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=dtype, attn_implementation=attn)
    model.requires_grad_(False).train()
    images, side = 256, model.config.vision_config.image_size  # enough images that the tensors, not overheads, count

    def forward():
        pixels = torch.randn(images, 3, side, side)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model.model.get_image_features(
                pixel_values=pixels, vision_feature_layer=-1, vision_feature_select_strategy="full"
            )

    forward()  # one-time allocations (kernels, thread pools) before measuring
    measured = allocated_peak(forward)
    shape = vision_shape(_config(llava), model.config.text_config.hidden_size)
    img = image_tokens(shape, _settings(llava), seq_len=64)
    planned = forward_bytes(shape, img, images, 2 if bf16 else 4, eager=attn == "eager")
    print(f"{attn} bf16={bf16}: the tower's forward allocates {measured} B, planned {planned} B")
    assert abs(planned - measured) / measured < 0.10


def test_llava_image_tokens_from_its_processor_settings_are_what_it_renders(llava):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava)
    shape = vision_shape(_config(llava), 64)
    img = image_tokens(shape, _settings(llava), seq_len=64)
    rendered = processor(text="<image> hi", images=Image.new("RGB", (90, 60)), return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert img.tokens == int((rendered["input_ids"] == image_id).sum()) == 5  # 2x2 patches and CLS ("full")
    assert img.patches == 5 and img.tiles == 1
    assert images_per_row(img, 64) == 12 and images_per_row(img, 3) == 1
    # the default strategy drops CLS; without processor settings, the vision config's image size
    default = image_tokens(shape, {**_settings(llava), "vision_feature_select_strategy": "default"}, 64)
    assert default.tokens == 4 and default.patches == 5
    assert image_tokens(shape, {}, 64).tokens == 4 and "image_size 28 px" in image_tokens(shape, {}, 64).source


def test_qwen_image_tokens_are_bounded_by_its_max_pixels_and_the_sequence():
    from PIL import Image
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2})
    shape = vision_shape(config.to_dict(), 64)
    assert (shape.layers, shape.heads, shape.patch, shape.merge, shape.temporal) == (2, 2, 14, 2, 2)
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 300})
    img = image_tokens(shape, processor.to_dict(), seq_len=4096)
    grid = processor(images=Image.new("RGB", (1600, 1200)), return_tensors="pt")["image_grid_thw"][0]
    rendered = int(grid.prod()) // shape.merge**2
    assert img.tokens == 300 and 0.95 * img.tokens <= rendered <= img.tokens
    assert img.patches == 4 * img.tokens  # the tower sees merge^2 patches a token
    assert image_tokens(shape, processor.to_dict(), seq_len=256).tokens == 256  # no row holds more
    assert image_tokens(shape, {}, seq_len=512).tokens == 512  # no settings: the sequence bounds it


def test_idefics_splitting_counts_every_tile_and_the_whole_image():
    from PIL import Image
    from transformers import Idefics3Config, Idefics3ImageProcessorPil

    config = Idefics3Config(vision_config={"image_size": 56, "patch_size": 14}, scale_factor=2)
    shape = vision_shape(config.to_dict(), 64)
    processor = Idefics3ImageProcessorPil(size={"longest_edge": 3 * 56}, max_image_size={"longest_edge": 56})
    img = image_tokens(shape, processor.to_dict(), seq_len=4096)
    tiles = processor(images=Image.new("RGB", (900, 900)), return_tensors="pt")["pixel_values"].shape[1]
    assert img.tiles == tiles == 3 * 3 + 1
    assert img.tokens == tiles * (56 // 14) ** 2 // 2**2 and img.patches == 16


def test_a_vlm_plan_counts_the_tower_forward_and_its_upcast_and_a_text_model_neither(llava):
    common = ("quant=nf4", "precision=bf16", "trainer.micro_batch_size=2", "trainer.seq_len=64", "data.metric=null")
    plan = planner.plan(compose_cfg(f"model.name_or_path={llava}", *common), world_size=1, ladder=False)
    assert plan["components"]["vision_forward"]["cpu"] > 0
    assert "train: vision forward" in plan["devices"][0]["peak_by_phase"]
    tower = next(n for n in plan["notes"] if "the tower's forward" in n)
    assert "1 image a row (data.images_per_row=auto with no data read" in tower and "seq_len holds up to 12" in tower
    assert any("k-bit prep holds the tower in fp32" in n for n in plan["notes"])
    fp32_cfg = compose_cfg(f"model.name_or_path={llava}", *common[:1], "precision=fp32", *common[2:])
    fp32 = planner.plan(fp32_cfg, world_size=1, ladder=False)
    assert not any("k-bit prep holds the tower" in n for n in fp32["notes"])  # nothing to upcast in fp32
    text = planner.plan(
        compose_cfg(f"model.name_or_path={REPO / 'assets/tiny-llama'}", *common), world_size=1, ladder=False
    )
    assert "vision_forward" not in text["components"]


def test_a_vision_config_mapping_alone_gives_the_tower_its_class_defaults():
    from qlora_recipes.planner.vision import _filled

    vc = _filled({"model_type": "clip_vision_model", "num_hidden_layers": 3})
    shape = vision_shape({"vision_config": vc}, 4096)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.patch, shape.image_size) == (
        3,
        768,
        3072,
        12,
        32,
        224,
    )
    assert shape.out_hidden == 4096
    assert vision_shape({"vision_config": {"model_type": "x"}}, 64) is None  # no sizes: the forward is not counted
