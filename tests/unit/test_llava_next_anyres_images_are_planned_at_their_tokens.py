"""LLaVA-NeXT's anyres tiling is planned as its processor renders it: an image is a base view and up to
as many crops as its best grid pinpoint cuts (the tower runs on all of them), and its tokens in the row
are the base view's and the crops' features with a newline token a row of them, the most when the
image has its pinpoint's own aspect (held to the tiny saved checkpoint's processor)."""

import json

import pytest
from conftest import compose_cfg
from helpers_vlm_families import LLAVA_NEXT_PINPOINTS, build_llava_next

from qlora_recipes import planner
from qlora_recipes.planner.vision_forward import image_tokens, images_per_row, vision_shape

# (width, height) in pixels: each pinpoint's own aspect and size, larger and smaller, and other aspects
SIZES = [(28, 56), (56, 28), (56, 56), (200, 200), (90, 60), (37, 100), (1000, 500), (20, 20)]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    return build_llava_next(tmp_path_factory.mktemp("llava_next") / "model")


def _settings(folder) -> dict:
    return json.loads((folder / "processor_config.json").read_text())


def _shape(folder):
    from transformers import AutoConfig

    return vision_shape(AutoConfig.from_pretrained(folder).to_dict(), 64)


def _render(processor, size: tuple[int, int]) -> tuple[int, int]:
    """(image tokens in the row, views the tower runs on) of one image of `size`."""
    from PIL import Image
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    rendered = processor(text="<image> hi", images=Image.new("RGB", size), return_tensors="pt")
    tokens = int((rendered["input_ids"] == processor.image_token_id).sum())
    views = image_size_to_num_patches(rendered["image_sizes"][0], LLAVA_NEXT_PINPOINTS, 28)  # what the model runs
    return tokens, views


def test_the_planned_image_tokens_and_views_are_the_most_the_processor_renders(llava_next):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_next)
    img = image_tokens(_shape(llava_next), _settings(llava_next), seq_len=4096)
    rendered = {size: _render(processor, size) for size in SIZES}
    assert img.tokens == max(tokens for tokens, _ in rendered.values()) == rendered[(56, 56)][0] == 24
    assert img.tiles == max(views for _, views in rendered.values()) == 5  # the base view and 2x2 crops
    assert img.patches == 5 and img.extra == 1  # 2x2 patches and CLS a view ("default" drops CLS from the row)
    assert rendered[(28, 56)] == (16, 3) and rendered[(20, 20)][0] < img.tokens  # unpadded to the aspect
    assert images_per_row(img, 64) == 2


def test_the_processors_pinpoints_decide_and_without_them_the_configs(llava_next):
    settings = _settings(llava_next)
    settings["image_processor"]["image_grid_pinpoints"] = [[28, 84]]
    wider = image_tokens(_shape(llava_next), settings, seq_len=4096)
    assert (wider.tokens, wider.tiles) == (4 + 2 * 6 + 2, 4)  # one row of 3 crops: 2 x 6 features, 2 newlines
    settings["image_processor"].pop("image_grid_pinpoints")
    img = image_tokens(_shape(llava_next), settings, seq_len=4096)
    assert (img.tokens, img.tiles) == (24, 5)


def test_a_llava_next_plan_counts_every_view_through_the_tower_and_every_token_in_the_row(llava_next):
    cfg = compose_cfg(f"model.name_or_path={llava_next}", "trainer.seq_len=64", "data.metric=null")
    plan = planner.plan(cfg, world_size=1, ladder=False)
    tower = next(n for n in plan["notes"] if "the tower's forward" in n)
    assert "2 layers of 25 patches an image" in tower and "24 image tokens each" in tower
    assert "up to 4 crops" in tower and "seq_len holds up to 2" in tower
