"""Image size bounds as config: data.image_max_pixels / image_min_pixels resize a Qwen-VL-style image
processor's images within those pixel counts, data.image_longest_edge an Idefics3-style one's longest
side, and the rows' token counts (trainer.seq_len=auto) follow; a key a processor cannot take is one
line; an image file over data.image_file_max_pixels is refused in one line naming the row."""

import json

import pytest
from conftest import compose_cfg
from helpers_vision import build_llava, colour_row, write_colour_rows

from qlora_recipes.data.image_bounds import bound_image_processor, bound_processor
from qlora_recipes.errors import UserError


def _data(*overrides: str):
    return compose_cfg(*overrides).data


def _qwen_tokens(image_processor, width: int, height: int) -> int:
    from PIL import Image

    grid = image_processor(images=[Image.new("RGB", (width, height))])["image_grid_thw"][0]
    return int(grid.prod()) // image_processor.merge_size**2


def test_qwen_vl_images_are_resized_within_the_pixel_bounds():
    from transformers import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil()
    before = _qwen_tokens(image_processor, 1024, 768)
    bound_image_processor(image_processor, _data("data.image_max_pixels=200704", "data.image_min_pixels=3136"))
    assert (image_processor.size.shortest_edge, image_processor.size.longest_edge) == (3136, 200704)
    after = _qwen_tokens(image_processor, 1024, 768)
    assert before == 999 and after <= 200704 // 28**2 == 256 and after == 234  # 1024x768 -> 26x36 patches
    bound_image_processor(image_processor, _data("data.image_min_pixels=100352"))  # a small image is enlarged
    assert _qwen_tokens(image_processor, 56, 56) >= 100352 // 28**2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("data.image_min_pixels=500000", "data.image_max_pixels=200704"), r"data.image_max_pixels=200704 is below "
         r"data.image_min_pixels \(500000\); raise data.image_max_pixels or set data.image_min_pixels at most that"),
        (("data.image_max_pixels=500",), r"data.image_max_pixels=500 is less than one image token of "
         r"Qwen2VLImageProcessorPil \(784 pixels, 28x28\); give at least 784"),
        (("data.image_longest_edge=512",), r"data.image_longest_edge=512: Qwen2VLImageProcessorPil sizes images by "
         r"pixel count; set data.image_max_pixels / data.image_min_pixels instead; drop data.image_longest_edge"),
    ],
)  # fmt: skip
def test_a_bound_a_qwen_vl_processor_cannot_take_is_one_line(overrides, message):
    from transformers import Qwen2VLImageProcessorPil

    with pytest.raises(UserError, match=message):
        bound_image_processor(Qwen2VLImageProcessorPil(), _data(*overrides))


def test_a_fixed_size_processor_takes_no_bound(tmp_path):
    from transformers import CLIPImageProcessorPil, Idefics3ImageProcessorPil

    with pytest.raises(UserError) as err:
        bound_image_processor(CLIPImageProcessorPil(), _data("data.image_max_pixels=200704"))
    assert str(err.value) == (
        "data.image_max_pixels=200704: CLIPImageProcessorPil resizes every image to one size ({'shortest_edge': 224}, "
        "then crops {'height': 224, 'width': 224}), so each image makes the same tokens and takes no bound; drop "
        "data.image_max_pixels"
    )
    with pytest.raises(UserError, match=r"sizes images by their longest edge; set data.image_longest_edge instead"):
        bound_image_processor(Idefics3ImageProcessorPil(), _data("data.image_max_pixels=200704"))


def test_a_bound_out_of_range_is_refused_by_the_config():
    from qlora_recipes.config.loader import load

    with pytest.raises(UserError, match=r"data.image_max_pixels=0"):
        load(["data.image_max_pixels=0"])


def _idefics3_processor():
    """A real Idefics3 processor (no model): images resized to 112 px and split into 28-px tiles of one
    token each, plus the whole image."""
    from helpers_vision import CHAT_TEMPLATE, TINY
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    grid = [f"<row_{i}_col_{j}>" for i in range(1, 5) for j in range(1, 5)]
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<end_of_utterance>",
                "<global-img>",
                *grid,
            ]
        }
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    return Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=1, chat_template=CHAT_TEMPLATE
    )


def test_seq_len_auto_counts_the_tokens_of_the_bounded_images(tmp_path):
    from qlora_recipes.data.images import load_image_splits

    path = write_colour_rows(tmp_path, repeats=1)  # 28 px squares: drawn larger here
    from PIL import Image

    for png in (tmp_path / "images").glob("*.png"):
        Image.open(png).resize((112, 112)).save(png)
    longest = lambda lengths, source: int(lengths.max())  # noqa: E731
    counted = {}
    for edge in (None, 28):
        processor = _idefics3_processor()
        overrides = [f"data.path={path}", "data.eval_fraction=0"] + (
            [f"data.image_longest_edge={edge}"] if edge else []
        )
        _, _, stats = load_image_splits(compose_cfg(*overrides).data, processor, longest, 0)
        counted[edge] = stats["seq_len"]
        assert processor.image_processor.size.longest_edge == (edge or 112)
    # 112 px: 4x4 tiles and the whole image, 17 image tokens with their markers; 28 px: one tile
    assert counted[28] < counted[None] - 16, counted


@pytest.fixture(scope="module")
def llava_processor(tmp_path_factory):
    from qlora_recipes.model.loading import source
    from qlora_recipes.model.vision import load_processor

    model = compose_cfg(f"model.name_or_path={build_llava(tmp_path_factory.mktemp('llava') / 'model')}").model
    return load_processor(model, source(model))


def test_a_bound_on_the_tiny_llava_is_refused_before_rows_are_read(tmp_path, llava_processor):
    from qlora_recipes.data.images import load_image_splits

    path = write_colour_rows(tmp_path, repeats=1)
    with pytest.raises(UserError, match=r"^data.image_longest_edge=64: CLIPImageProcessorPil resizes every image"):
        load_image_splits(_data(f"data.path={path}", "data.image_longest_edge=64"), llava_processor, 64, 0)
    bound_processor(llava_processor, _data(f"data.path={path}"))  # no key set: the processor as it was
    assert dict(llava_processor.image_processor.size)["shortest_edge"] == 28


def test_an_image_file_over_the_pixel_bound_is_one_line_naming_the_row(tmp_path, llava_processor):
    from qlora_recipes.data.images import load_image_splits

    path = write_colour_rows(tmp_path, repeats=1)
    rows = path.read_text().splitlines()
    from PIL import Image

    Image.new("RGB", (40, 30)).save(tmp_path / "images" / "wide.png")
    rows.insert(1, json.dumps(colour_row("red", "images/wide.png")))
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError) as err:
        load_image_splits(_data(f"data.path={path}", "data.image_file_max_pixels=1000"), llava_processor, 64, 0)
    assert str(err.value) == (
        f"{path} line 2: images[0] {str(tmp_path / 'images' / 'wide.png')!r} is 40 x 30 = 1,200 pixels, over "
        "data.image_file_max_pixels=1,000; resize it, or raise data.image_file_max_pixels"
    )
    train, _, _ = load_image_splits(
        _data(f"data.path={path}", "data.image_file_max_pixels=1200"), llava_processor, 64, 0
    )
    assert len(train) + 1 >= 5  # at the bound: kept
