"""trainer.tiled_mlp on an MoE model (planner/tiled_moe.py): the layer backward holds one tile's routed
rows through the experts beside that tile's recomputed tensors, not the micro-batch's; traced on the fake
CUDA device within 10 % of the plan; the ladder offers the option to MoE models; and at long sequences
the plan's layer working set shrinks with it."""

import pytest
from conftest import compose_cfg
from test_memory_tracer import TINY_MOE, needs_fake_cuda

from qlora_recipes import planner
from qlora_recipes.planner import components, tiled_moe
from qlora_recipes.planner.spec import spec_from_cfg
from qlora_recipes.units import GiB

# many routed rows a token (4 of 8 narrow experts), 4,096 tokens: the routed backward weighs
MANY_ROWS = [*TINY_MOE, "model.figures.num_experts_per_tok=4", "model.figures.moe_intermediate_size=32"]
MANY_ROWS += ["trainer.micro_batch_size=1", "trainer.seq_len=4096"]


def _layer_backward(*overrides) -> int:
    """What one layer holds in its backward: its saved tensors and its working set."""
    st = spec_from_cfg(compose_cfg(*MANY_ROWS, *overrides), world_size=1)
    bb = next(bb for blk, bb in components.block_bytes(st) if blk.is_layer)
    return components.layer_saved_bytes(st, bb, 1) + components.backward_working_bytes(st, 1, bb=bb)


def test_the_routed_backward_of_a_tiled_block_is_one_tiles():
    st = spec_from_cfg(compose_cfg(*MANY_ROWS), world_size=1)
    c, r, _ = components.act_dtypes(st, False)
    whole, tile = tiled_moe.tile_routed_bytes(st, 4096, c, r), tiled_moe.tile_routed_bytes(st, 1024, c, r)
    assert tile > 0 and whole == 4 * tile
    untiled = _layer_backward()
    halves, quarters = (_layer_backward("trainer.tiled_mlp=true", f"trainer.tiled_mlp_tile={t}") for t in (2048, 1024))
    assert quarters < halves < untiled


def test_the_ladder_offers_tiled_mlp_to_an_moe_model():
    from qlora_recipes.planner.ladder import _lean_candidates

    st = spec_from_cfg(compose_cfg("recipe=qwen3-30b-a3b-24gb", "trainer.seq_len=32768"), world_size=1)
    (tiled, adds), *_ = _lean_candidates("tiled_mlp", st, None)  # the hardware decides host_embeddings only
    assert adds == {"trainer.tiled_mlp": "true"} and tiled.mlp_tile == st.fig.hidden_size


def test_a_tiled_moe_plans_a_smaller_layer_working_set_at_long_sequences():
    def working(*overrides):
        cfg = compose_cfg(
            "recipe=qwen3-30b-a3b-24gb", "trainer.micro_batch_size=1", "trainer.seq_len=32768", *overrides
        )
        p = planner.plan(cfg, gpus=[80 * GiB], host_ram=128 * GiB, world_size=1, ladder=False)
        return p["components"]["layer_working"]["cuda:0"]

    assert working("trainer.tiled_mlp=true") < 0.7 * working()


@pytest.mark.slow
@needs_fake_cuda
@pytest.mark.parametrize("tile", [2048, 1024])
def test_a_tiled_moe_layers_backward_is_traced_as_planned(tile):
    """4,096 tokens in 2 or 4 tiles: the layer backward's traced peak (the tile's routed backward beside
    its recomputed tensors) is the plan's within 10 % (~2 min on 2 cores each)."""
    from bench.trace.run import compare, plan_for, run_child

    overrides = [*MANY_ROWS, "trainer.tiled_mlp=true", f"trainer.tiled_mlp_tile={tile}"]
    r = run_child({"overrides": overrides, "device": "cuda"})
    row = compare(r, plan_for(overrides, [24 * GiB]), "cuda:0")["phases"]["train: layer backward"]
    print(f"tile {tile}: traced {row['traced_gib']:.4f} GiB, planned {row['planned_gib']:.4f} GiB")
    assert 0.9 <= row["traced_gib"] / row["planned_gib"] <= 1.1, row
