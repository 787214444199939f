"""A vision-language model's language model sits under model.language_model (planner/vlm_layout.py): its
plans place and size the same parts by those names that a text model's plan does by model.X - the output
head's tied input embeddings kept beside it on the execution device, the final norm in FSDP's gathered tail."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.planner import figures, placement
from qlora_recipes.units import GiB

STACK = ("precision=bf16", "quant=nf4", "data.metric=null", "trainer.seq_len=512")


def _plan(*overrides: str, ws: int = 1) -> dict:
    cfg = compose_cfg("model=gemma3-12b", *STACK, *overrides)
    return planner.plan(cfg, gpus=[80 * GiB] * ws, host_ram=512 * GiB, world_size=ws, ladder=False)


def test_an_offloaded_vlms_tied_embeddings_stay_on_the_execution_device_with_its_head():
    # 3 GiB: the vision parts fit the GPU, the language model as a whole does not (offloaded in one piece)
    plan = _plan("offload=cpu", "offload.max_memory.gpu=3GiB")
    dmap = plan["device_map"]
    assert placement.place("model.vision_tower", dmap) == 0
    assert placement.place("model.language_model.layers.0", dmap) == "cpu"
    assert placement.place("lm_head", dmap) == 0
    assert placement.place("model.language_model.embed_tokens", dmap) == 0  # the head's weight is its own
    kept = [n for n in plan["notes"] if "kept on the execution device" in n]
    assert kept and "model.language_model.embed_tokens" in kept[0]
    # the rest of the language model stays offloaded, every block of it still placed
    assert placement.place("model.language_model.norm", dmap) == "cpu"
    assert placement.place("model.language_model.rotary_emb", dmap) == "cpu"


def test_a_sharded_vlm_gathers_its_final_norm_with_its_head_as_the_text_model_does():
    vlm = _plan("dist=fsdp", ws=2)
    text = _plan("dist=fsdp", "model.architecture=gemma3_text", "model.vision_config=null", ws=2)
    assert text["stack"]["dist"] == vlm["stack"]["dist"] == "fsdp"
    gathered = vlm["components"]["offload_staging"]["cuda:0"]
    assert gathered == text["components"]["offload_staging"]["cuda:0"]


@pytest.mark.parametrize(
    "entry,prefix",
    [
        ("gemma3-12b", "model.language_model"),
        ("qwen2.5-vl-7b", "model.language_model"),
        ("llama3.2-11b-vision", "model.language_model"),  # mllama: from the meta model
        ("qwen3-8b", "model"),
    ],
)
def test_the_final_norm_gathered_is_a_block_of_the_models_inventory(entry, prefix):
    fig = figures.model_figures(compose_cfg(f"model={entry}").model)
    assert figures.final_norm(fig) == f"{prefix}.norm"
    assert figures.final_norm(fig) in {b.name for b in figures.inventory(fig)}
