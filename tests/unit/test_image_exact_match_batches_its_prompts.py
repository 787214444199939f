"""The image exact-match metric generates its prompts in batches (the processor's batch call, left-padded),
as the text metric does, bounded by prompts and positions a batch, and answers each prompt as it would
alone: same answers, same scores, on the tiny LLaVA of helpers_vision."""

import inspect
from pathlib import Path

import pytest
import torch
from helpers_vision import build_llava, draw_images

from qlora_recipes.outputs.images import generate_with_images, image_inputs, image_prompt, open_images
from qlora_recipes.outputs.prompts import Prompt, PromptFormat
from qlora_recipes.planner import loss
from qlora_recipes.run import metrics

# questions of different lengths (left padding in every batch), one or two images each
ASKED = [
    ("colour?", ["red"]),
    ("what colour is this square, in one word?", ["blue"]),
    ("and these two?", ["green", "yellow"]),
    ("name it", ["yellow"]),
    ("which colour do you see here", ["red"]),
]
NEW = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = build_llava(tmp_path_factory.mktemp("llava") / "model")
    model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    images: dict[str, Path] = draw_images(tmp_path_factory.mktemp("images"))
    fmt = PromptFormat(style="chat")
    return [image_prompt(Prompt("text", q), fmt, open_images([str(images[c]) for c in cs])) for q, cs in ASKED]


class _Calls:
    """Counts model.generate calls and the rows of each."""

    def __init__(self, model, monkeypatch):
        self.rows: list[int] = []
        original = model.generate

        def generate(*args, **kwargs):
            self.rows.append(int(kwargs["input_ids"].shape[0]))
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "generate", generate)


def test_batched_answers_equal_the_prompts_answered_one_at_a_time(llava, prompts, monkeypatch):
    model, processor = llava
    alone = generate_with_images(model, processor, prompts, NEW)
    calls = _Calls(model, monkeypatch)
    together = generate_with_images(model, processor, prompts, NEW, batch_size=4)
    assert calls.rows == [4, 1]
    assert together == alone
    assert any(text.strip() for text in alone)  # the tiny model says something to compare


def test_a_batch_is_left_padded_by_the_processor(llava, prompts):
    from qlora_recipes.outputs.images import _batch_inputs

    _, processor = llava
    batch = _batch_inputs(processor, prompts[:2])
    lengths = [int(image_inputs(processor, p)["input_ids"].shape[1]) for p in prompts[:2]]
    assert lengths[0] < lengths[1] and batch["input_ids"].shape[1] == lengths[1]
    pad = lengths[1] - lengths[0]
    assert batch["attention_mask"][0].tolist() == [0] * pad + [1] * lengths[0]
    assert batch["input_ids"][0, pad:].tolist() == image_inputs(processor, prompts[0])["input_ids"][0].tolist()
    assert batch["pixel_values"].shape[0] == 2


def test_a_batch_holds_no_more_positions_than_max_batch_tokens(llava, prompts, monkeypatch):
    model, processor = llava
    lengths = [int(image_inputs(processor, p)["input_ids"].shape[1]) for p in prompts]
    budget = 2 * (max(lengths[:2]) + NEW)  # room for the first two prompts, not a third
    calls = _Calls(model, monkeypatch)
    generate_with_images(model, processor, prompts, NEW, batch_size=32, max_batch_tokens=budget)
    assert sum(calls.rows) == len(prompts) and calls.rows[0] == 2 and max(calls.rows) <= 2


def test_image_exact_match_scores_the_same_batched_as_one_at_a_time(llava, prompts, monkeypatch):
    model, processor = llava
    said = generate_with_images(model, processor, prompts, NEW)
    pairs = [(p, s if i % 2 else s + "x") for i, (p, s) in enumerate(zip(prompts, said, strict=True))]
    alone = metrics.image_exact_match(model, processor, pairs, NEW, batch_size=1)
    calls = _Calls(model, monkeypatch)
    batched = metrics.image_exact_match(model, processor, pairs, NEW)
    assert calls.rows == [len(prompts)]
    assert batched == alone == 2 / 5


def test_image_batches_are_the_size_the_planner_counts_for_the_metric():
    """The planner's generation term (planner/loss.py) counts GEN_METRIC_BATCH prompts under the eval
    batch's positions, whatever the rows: image rows now batch to the same bound."""
    batch = inspect.signature(metrics.image_exact_match).parameters["batch_size"].default
    assert batch == loss.GEN_METRIC_BATCH == inspect.signature(metrics.exact_match).parameters["batch_size"].default
