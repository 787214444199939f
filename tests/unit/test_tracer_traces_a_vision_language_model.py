"""The memory tracer on a vision-language model (bench/trace/vision.py): Gemma 3's image-text-to-text model
with its SigLIP tower unquantized, image rows rendered by its processor, the tower's forward a phase of its
own; and the committed trace of recipe gemma-3-12b-vision-24gb beside its plan."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from test_memory_tracer import needs_fake_cuda

RECIPE = "gemma-3-12b-vision-24gb"


def _gemma3_config(layers: int = 2):
    from bench.trace.model import hf_config
    from qlora_recipes.config.loader import load

    cfg = load([f"recipe={RECIPE}"])
    return cfg, hf_config(cfg, layers)


def test_gemma3_image_rows_hold_each_images_soft_tokens_at_the_checkpoints_ids():
    """Each row: <start_of_image>, mm_tokens_per_image soft tokens, <end_of_image> at the config's ids,
    pixel_values at the vision config's 896 px, no loss on the image's tokens, text to seq_len."""
    from bench.trace.vision import image_rows

    _, config = _gemma3_config()
    batch = image_rows(config, 2, 512)
    ids = batch["input_ids"]
    assert ids.shape == (2, 512)
    image = ids == config.image_token_index
    assert image.sum(1).tolist() == [256, 256]
    assert (batch["token_type_ids"] == 1).equal(image)
    assert (ids == config.boi_token_index).sum(1).tolist() == [1, 1]
    assert (ids == config.eoi_token_index).sum(1).tolist() == [1, 1]
    assert tuple(batch["pixel_values"].shape) == (2, 3, 896, 896)
    assert (batch["labels"][image] == -100).all()
    assert batch["attention_mask"].sum(1).tolist() == [512, 511]  # the last row padded, as step.py's
    assert int(ids.max()) < config.text_config.vocab_size


def test_the_tracers_gemma3_skeleton_quantizes_the_language_model_alone():
    """The tracer builds the image-text-to-text model (a 2-layer slice of the language model) with the
    loader's skip list: the SigLIP tower and projector stay unquantized, the decoder's linears 4-bit."""
    import bitsandbytes as bnb
    import torch

    from bench.trace.model import meta_base

    cfg, _ = _gemma3_config()
    model, _ = meta_base(cfg, 2)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert model.config.text_config.num_hidden_layers == 2
    tower = [m for n, m in model.named_modules() if n.startswith("model.vision_tower")]
    assert tower and not any(isinstance(m, bnb.nn.Linear4bit) for m in tower)
    assert any(isinstance(m, torch.nn.Linear) for m in tower)
    decoder = [m for n, m in model.named_modules() if n.startswith("model.language_model.layers")]
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in decoder) == 2 * 7


@pytest.mark.slow
@needs_fake_cuda
def test_a_gemma3_slice_traces_the_towers_forward_as_its_own_phase():
    """A 2-layer slice of the recipe traced on image rows: the vision phase holds the tower's forward, the
    training step runs on to the optimizer, and the 4-bit rows are the plan's layer for layer."""
    from bench.trace.run import run_child

    r = run_child({"overrides": [f"recipe={RECIPE}"], "device": "cuda", "layers": 2})
    phases = {k.split("|")[1]: v for k, v in r["phases"].items()}
    assert {"vision", "forward", "loss", "backward", "optimizer"} <= set(phases)
    assert phases["vision"]["components"]["vision_forward"] > 0
    assert r["tokens"] == 2 * 2048


def test_the_committed_traces_hold_the_gemma3_vision_recipe_beside_its_plan():
    """bench/results/planner-traced.json: recipe gemma-3-12b-vision-24gb traced on image rows within 10 % of
    its plan, with the command that traced it, the tower's forward as a phase of its own, its weights
    (vision tower, projector, bf16 embeddings) the plan's row, and the activations (the checkpointed tower
    layers' inputs among them) the plan's within 10 %."""
    cases = {c["case"]: c for c in json.loads((REPO / "bench/results/planner-traced.json").read_text())["cases"]}
    c = cases[f"recipe {RECIPE}"]
    assert c["within"] and 0.9 <= c["ratio"] <= 1.1, c
    assert c["command"].startswith("python -m bench trace --suite") and RECIPE in c["command"]
    assert c["layers"] == 48 and c["layers_traced"] == [2, 3]
    assert "train: vision forward" in c["phases"]
    acts = c["components"]["activations"]
    assert abs(acts["traced_gib"] / acts["planned_gib"] - 1) <= 0.1, acts
    for row in ("other_params", "quantized_weights", "lora_weights"):
        got = c["components"][row]
        assert abs(got["traced_gib"] - got["planned_gib"]) <= 0.01, (row, got)
