"""mllama: a row holds one token an image and the text cross-attends to every tile's features. The plan
says so, and counts the cross-attention layers' k/v over those features, the features and the mask they
read, sized by what the tiny Llama-3.2-Vision's cross-attention layer projects (a real forward)."""

import dataclasses
from collections import defaultdict

import pytest
import torch
from conftest import compose_cfg
from helpers_vlm_families import build_mllama

from qlora_recipes import planner
from qlora_recipes.planner.cross_attention import add_cross_attention, kv_bytes
from qlora_recipes.planner.spec import spec_from_cfg

COMMON = ("quant=nf4", "precision=bf16", "trainer.seq_len=64", "data.metric=null", "trainer.micro_batch_size=2")


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    return build_mllama(tmp_path_factory.mktemp("mllama") / "model")


def _projected(mllama) -> tuple[int, int]:
    """(features an image, kv width) the cross-attention layer's k_proj makes in a real forward on a
    picture the processor cuts into its most tiles."""
    from PIL import Image
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(mllama)
    model = MllamaForConditionalGeneration.from_pretrained(mllama)
    seen = []
    layer = model.model.language_model.layers[model.config.text_config.cross_attention_layers[0]]
    layer.cross_attn.k_proj.register_forward_hook(lambda m, i, out: seen.append(tuple(out.shape)))
    inputs = processor(text="<|image|> hi", images=Image.new("RGB", (56, 28)), return_tensors="pt")
    with torch.no_grad():
        model(**inputs)
    (shape,) = seen  # (rows x images x tiles, patches, kv width): one row, one image
    return shape[0] * shape[1], shape[2]


def test_the_plan_counts_the_cross_attention_over_every_tiles_features(mllama):
    features, width = _projected(mllama)
    cfg = compose_cfg(f"model.name_or_path={mllama}", *COMMON)
    st = spec_from_cfg(cfg, 1)
    assert width == st.fig.num_kv_heads * st.fig.head_dim
    plan = planner.plan(cfg, world_size=1, ladder=False)
    notes = "\n".join(plan["notes"])
    assert f"read {features} image features a row" in notes  # 2 tiles x (4 patches + a class token)
    assert f"one image token each in the row, the text cross-attending to its {features} features" in notes
    assert "the sequence counts one token an image" in notes
    # checkpointed: one layer's k/v in the backward's working set; without, every layer keeps its own
    for checkpointing in (True, False):
        st_ck = dataclasses.replace(st, checkpointing=checkpointing)
        comp, rows = defaultdict(lambda: defaultdict(int)), st.train_rows
        add_cross_attention(st_ck, comp, "cpu", features, [])
        per_layer = kv_bytes(st, rows, features, 2)
        kept = rows * features * st.fig.hidden_size * 2 + rows * st.seq_len * features * 2  # features, mask
        layers = len(st.fig.cross_attention_layers)
        assert comp["layer_working"]["cpu"] == (per_layer if checkpointing else 0)
        assert comp["activations"]["cpu"] == kept + (0 if checkpointing else layers * per_layer)


def test_the_kv_bytes_grow_with_the_repeat_to_every_query_head(mllama):
    st = spec_from_cfg(compose_cfg(f"model.name_or_path={mllama}", *COMMON), 1)
    fig = st.fig
    kv = 10 * fig.num_kv_heads * fig.head_dim
    repeated = 2 * 10 * fig.num_heads * fig.head_dim * 2 if fig.num_heads != fig.num_kv_heads else 0
    assert kv_bytes(st, 2, 5, 2) == 2 * kv * 2 + kv * 4 + repeated
