"""A rank of a sharded or data-parallel MoE run (FSDP, ZeRO-3 on GPUs; FSDP, ZeRO-3 on CPU ranks) keeps
the router logits of its own micro-batch for the load-balancing loss, as one process does: the rank's
plan is rewritten from the one-process plan of that micro-batch, its activations included, so the
logits it counts do not grow or shrink with the world size."""

import json

import pytest
from conftest import compose_cfg
from helpers_families import build_family

from qlora_recipes import planner
from qlora_recipes.planner import moe
from qlora_recipes.planner.spec import spec_from_cfg

GiB = 2**30
STACK = ("precision=bf16", "trainer.micro_batch_size=2", "trainer.seq_len=128", "data.metric=null")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    on, off = build_family("qwen3_moe", root / "on"), build_family("qwen3_moe", root / "off")
    cj = json.loads((off / "config.json").read_text())
    (off / "config.json").write_text(json.dumps({**cj, "router_aux_loss_coef": 0.0}))
    return on, off


def _activations(folder, strategy: str, ws: int, gpus: bool) -> tuple[int, int]:
    cfg = compose_cfg(f"model.name_or_path={folder}", *STACK, f"dist={strategy}")
    plan = planner.plan(cfg, gpus=[80 * GiB] * ws if gpus else [], host_ram=512 * GiB, world_size=ws, ladder=False)
    st = spec_from_cfg(cfg, world_size=ws)
    logits = moe.router_logits_bytes(st, st.train_rows * st.seq_len, st.fig.num_layers, st.act_bytes)
    return sum(plan["components"]["activations"].values()), logits


@pytest.mark.parametrize("strategy,gpus", [("fsdp", True), ("zero3", True), ("fsdp", False), ("zero3", False)])
def test_a_ranks_plan_counts_its_micro_batchs_router_logits(folders, strategy, gpus):
    on, off = folders
    (two, logits), (four, logits_four) = _activations(on, strategy, 2, gpus), _activations(on, strategy, 4, gpus)
    without, _ = _activations(off, strategy, 2, gpus)
    assert logits > 0 and logits == logits_four  # the rank's own tokens, whatever the world size
    assert two - without == logits and four == two
