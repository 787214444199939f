"""Image rows whose images are held in the data, not named by path: a dataset saved with save_to_disk
(an Image column) or a parquet of image bytes loads as the file rows do, decoded on access and counted;
embedded bytes that are not an image, an embedded image over data.image_file_max_pixels, or an entry
that is neither a path nor bytes stop the run in one line naming the row."""

import io

import pytest
from conftest import compose_cfg
from helpers_vision import COLOURS, build_llava

from qlora_recipes.errors import UserError


def _png(rgb, size=(28, 28)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def _rows(images: list) -> dict:
    """Columns of one colour row per image: the question with an image part, the colour as the answer."""
    names = list(COLOURS) * (len(images) // len(COLOURS) + 1)
    turn = lambda role, parts: {"role": role, "content": parts}  # noqa: E731
    messages = [
        [turn("user", [{"type": "image", "text": None}, {"type": "text", "text": "colour?"}]),
         turn("assistant", [{"type": "text", "text": names[i]}])]
        for i in range(len(images))
    ]  # fmt: skip
    return {"messages": messages, "images": [[image] for image in images]}


def _saved(tmp_path, images: list, *, as_image_feature: bool = True):
    from datasets import Dataset, Image, List

    ds = Dataset.from_dict(_rows(images))
    if as_image_feature:
        ds = ds.cast_column("images", List(Image()))
    ds.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def _colours(repeats: int = 2) -> list:
    return [{"bytes": _png(rgb), "path": None} for _ in range(repeats) for rgb in COLOURS.values()]


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from qlora_recipes.model.loading import source
    from qlora_recipes.model.vision import load_processor

    model = compose_cfg(f"model.name_or_path={build_llava(tmp_path_factory.mktemp('llava') / 'model')}").model
    return load_processor(model, source(model))


def _load(path, processor, *overrides):
    from qlora_recipes.data.images import load_image_splits

    cfg = compose_cfg(f"data.path={path}", "data.eval_fraction=0.25", *overrides)
    return load_image_splits(cfg.data, processor, lambda lengths, source: int(lengths.max()), 0)


def test_a_saved_dataset_with_an_image_column_loads_decoded_and_counted(tmp_path, processor):
    train, held, stats = _load(_saved(tmp_path, _colours()), processor)
    assert (len(train), len(held)) == (6, 2)
    image = train[0]["images"][0]
    assert image.size == (28, 28) and image.getpixel((3, 3)) in [tuple(c) for c in COLOURS.values()]
    assert stats["seq_len"] == stats["max_tokens"]["train"] > 5  # the image's tokens counted


def test_a_parquet_of_image_bytes_loads_as_well(tmp_path, processor):
    from datasets import load_from_disk

    load_from_disk(str(_saved(tmp_path, _colours()))).to_parquet(str(tmp_path / "rows.parquet"))
    train, held, _ = _load(tmp_path / "rows.parquet", processor)
    assert (len(train), len(held)) == (6, 2) and train[0]["images"][0].size == (28, 28)


def test_bytes_that_are_not_an_image_name_the_row(tmp_path, processor):
    images = _colours(1) + [{"bytes": b"not a picture", "path": "notes.png"}]
    path = _saved(tmp_path, images)
    with pytest.raises(UserError) as err:
        _load(path, processor)
    assert str(err.value).startswith(
        f"{path} row index 4: images[0] (the embedded image 'notes.png') is not an image PIL can read ("
    )
    assert str(err.value).endswith("); replace or remove it") and "\n" not in str(err.value)


def test_an_embedded_image_over_the_pixel_bound_names_the_row(tmp_path, processor):
    images = _colours(1) + [{"bytes": _png((0, 0, 0), size=(40, 30)), "path": None}]
    path = _saved(tmp_path, images)
    with pytest.raises(UserError) as err:
        _load(path, processor, "data.image_file_max_pixels=1000")
    assert str(err.value) == (
        f"{path} row index 4: images[0] (the embedded image) is 40 x 30 = 1,200 pixels, over "
        "data.image_file_max_pixels=1,000; resize it, or raise data.image_file_max_pixels"
    )


def test_image_entries_that_store_a_path_are_checked_as_files(tmp_path, processor):
    """A parquet whose images column stores `{"bytes": null, "path": ...}`, as an Image column of files
    does: each path is read as a file row's is, relative to the data file's folder."""
    from datasets import Dataset

    (tmp_path / "red.png").write_bytes(_png(COLOURS["red"]))
    images = [{"bytes": None, "path": "red.png"}] * 3 + [{"bytes": None, "path": "gone.png"}]
    Dataset.from_dict(_rows(images)).to_parquet(str(tmp_path / "rows.parquet"))
    with pytest.raises(UserError) as err:
        _load(tmp_path / "rows.parquet", processor)
    assert str(err.value) == (
        f"{tmp_path / 'rows.parquet'} row index 3: images[0] '{tmp_path / 'gone.png'}' does not exist; relative "
        "paths are read from the data file's folder"
    )


def test_an_entry_neither_a_path_nor_bytes_is_one_line(tmp_path, processor):
    from datasets import Dataset

    rows = _rows([1, 2])
    Dataset.from_dict(rows).to_parquet(str(tmp_path / "rows.parquet"))
    with pytest.raises(UserError, match=r"row index 0: field 'images' must be a list of image file paths or image "):
        _load(tmp_path / "rows.parquet", processor)
