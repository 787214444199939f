"""Image rows (messages with image parts + an `images` column of files) are read with the real loader:
good rows give the trainer decoded images and their token counts (image tokens included); a missing
file, a file that is not an image, or image parts that do not match the files stop the run in one
line naming the file, the row and what to do."""

import json

import pytest
from conftest import compose_cfg
from helpers_vision import build_llava, colour_row, write_colour_rows

from qlora_recipes.errors import UserError


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def processor(llava):
    from qlora_recipes.model.loading import source
    from qlora_recipes.model.vision import load_processor

    model = compose_cfg(f"model.name_or_path={llava}").model
    return load_processor(model, source(model))


def _load(path, processor, *overrides, seq_len=64):
    from qlora_recipes.data.images import load_image_splits

    cfg = compose_cfg(f"data.path={path}", *overrides)
    return load_image_splits(cfg.data, processor, seq_len, 0)


def _with_row(tmp_path, row, line=3):
    """The colour rows with `row` as line `line`."""
    path = write_colour_rows(tmp_path, repeats=1)
    rows = path.read_text().splitlines()
    rows.insert(line - 1, json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_good_rows_give_decoded_images_and_counted_tokens(tmp_path, processor):
    path = write_colour_rows(tmp_path, repeats=4)
    train, eval_ds, stats = _load(
        path, processor, "data.eval_fraction=0.25", seq_len=lambda lengths, source: int(lengths.max())
    )
    assert (len(train), len(eval_ds)) == (12, 4)
    row = train[0]
    assert row["images"][0].size == (28, 28)  # decoded on access
    assert [p["type"] for p in row["messages"][0]["content"]] == ["image", "text"]
    # the longest row's tokens, its 5 image tokens included, became trainer.seq_len=auto
    assert stats["seq_len"] == stats["max_tokens"]["train"] > 5 and stats["images"]


def test_a_missing_image_names_the_row_and_the_file(tmp_path, processor):
    path = _with_row(tmp_path, colour_row("red", "images/nowhere.png"))
    with pytest.raises(UserError) as err:
        _load(path, processor)
    msg = str(err.value)
    assert msg.startswith(f"{path} line 3: images[0] ") and "nowhere.png' does not exist" in msg
    assert "relative paths are read from the data file's folder" in msg and "\n" not in msg


def test_a_file_that_is_not_an_image_names_the_row_and_the_file(tmp_path, processor):
    path = write_colour_rows(tmp_path, repeats=1)
    (tmp_path / "images" / "notes.png").write_text("not a picture")
    _with_row(tmp_path, colour_row("red", "images/notes.png"), line=2)
    with pytest.raises(
        UserError, match=r"line 2: images\[0\] '.*notes\.png' is not an image PIL can read .*replace or remove it"
    ):
        _load(path, processor)


def test_image_parts_must_match_the_images(tmp_path, processor):
    row = colour_row("red", "images/red.png")
    row["images"].append("images/blue.png")
    path = _with_row(tmp_path, row, line=4)
    with pytest.raises(UserError, match=r"line 4: 1 image part\(s\) in 'messages' but 2 file\(s\) in 'images'"):
        _load(path, processor)


def test_rows_longer_than_seq_len_are_refused_not_cut(tmp_path, processor):
    path = write_colour_rows(tmp_path, repeats=1)
    with pytest.raises(UserError, match=r"longer than trainer.seq_len=8, and a cut would split an image's tokens"):
        _load(path, processor, "data.eval_fraction=0", seq_len=8)


def test_an_image_past_pils_size_bound_is_one_line(tmp_path, processor):
    """A PNG whose header says 20000 x 20000 pixels (a decompression bomb): refused when opened, named."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path = write_colour_rows(tmp_path, repeats=1)
    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    (tmp_path / "images" / "huge.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    _with_row(tmp_path, colour_row("red", "images/huge.png"), line=1)
    with pytest.raises(UserError, match=r"line 1: images\[0\] '.*huge\.png' is too large to load safely .*resize it"):
        _load(path, processor)
