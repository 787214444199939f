"""The shipped image sample (data=shapes): its files are what scripts/make_shapes_data.py draws, byte for
byte; its held-out images are none of the train ones while every shape and colour occurs in both; it
composes with its eval file and exact_match; its rows load as image rows for a vision-language model, and
a text model given them is told in one line."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg
from helpers_vision import build_llava

from qlora_recipes.errors import UserError

SAMPLE = REPO / "assets" / "data" / "shapes"


def _rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLE / f"{split}.jsonl").read_text().splitlines()]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_shipped_files_are_what_the_script_draws(tmp_path):
    out = tmp_path / "shapes"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_shapes_data.py"), "--out", str(out)], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    assert _files(out) == _files(SAMPLE)
    assert sum(len(b) for b in _files(SAMPLE).values()) < 300_000  # small enough to ship


def test_held_out_images_are_new_while_every_shape_and_colour_is_trained():
    from PIL import Image

    def pixels(split: str) -> dict[str, str]:
        return {
            r["images"][0]: hashlib.sha256(Image.open(SAMPLE / r["images"][0]).tobytes()).hexdigest()
            for r in _rows(split)
        }

    train, held = pixels("train"), pixels("eval")
    assert (len(train), len(held)) == (192, 32)
    assert not set(train.values()) & set(held.values())  # no held-out picture is a train picture
    answers = {
        s: {(r["messages"][0]["content"][1]["text"], r["messages"][1]["content"][0]["text"]) for r in _rows(s)}
        for s in ("train", "eval")
    }
    words = {
        "What shape is this?": {"circle", "square", "triangle"},
        "What colour is this?": {"red", "green", "blue", "yellow"},
    }
    for split in ("train", "eval"):
        for question, wanted in words.items():
            assert {a for q, a in answers[split] if q == question} == wanted


def test_the_sample_composes_with_its_eval_file_and_exact_match():
    data = compose_cfg("data=shapes").data
    assert (Path(data.path), Path(data.eval_path)) == (SAMPLE / "train.jsonl", SAMPLE / "eval.jsonl")
    assert (data.metric, data.max_new_tokens) == ("exact_match", 12)
    own = compose_cfg("data=shapes", "data.path=rows.jsonl").data  # a user's own rows: the generic defaults
    assert (own.eval_path, own.metric, own.max_new_tokens) == (None, None, 32)


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from qlora_recipes.model.loading import source
    from qlora_recipes.model.vision import load_processor

    model = compose_cfg(f"model.name_or_path={build_llava(tmp_path_factory.mktemp('llava') / 'model')}").model
    return load_processor(model, source(model))


def test_its_rows_load_as_image_rows_for_a_vision_language_model(processor):
    from qlora_recipes.data.images import load_image_splits

    cfg = compose_cfg("data=shapes")
    train, held, stats = load_image_splits(cfg.data, processor, lambda lengths, source: int(lengths.max()), 0)
    assert (len(train), len(held)) == (384, 64)
    assert train[0]["images"][0].size == (32, 32) and stats["eval_source"].endswith("eval.jsonl")
    assert stats["over_seq_len"] == {"train": 0, "eval": 0}


def test_a_text_model_given_image_rows_is_told_in_one_line(tok):
    from qlora_recipes.data import load_splits

    cfg = compose_cfg("data=shapes")
    with pytest.raises(UserError) as err:
        load_splits(cfg.data, tok, 64, 0)
    msg = str(err.value)
    assert msg.startswith(f"{SAMPLE / 'train.jsonl'} line 1: field 'messages[0].content' holds an image part")
    assert "point model.name_or_path at one (`make shapes` builds a tiny one)" in msg and "\n" not in msg
