"""The OOM ladder takes every option that costs only speed, cheapest first and each with its measured cost,
before it cuts what is trained (sequence length, rank): the 24 GB 8B recipe on an 8 GB card keeps its 2,048
tokens; and it checkpoints the fewest first layers that fit before every layer."""

import json
import re
import subprocess
import sys

from conftest import REPO, compose_cfg

from qlora_recipes import planner
from qlora_recipes.planner.ladder import COSTS, LADDER_ORDER

GiB = 2**30


def test_the_24gb_recipe_fits_an_8gb_card_at_its_2048_tokens_without_a_quality_cut(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "recipe=llama3.1-8b-24gb", "--gpus", "8GB",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ladder = json.loads((tmp_path / "plan.json").read_text())["ladder"]
    kinds = [r["change"] for r in ladder]
    assert ladder[-1]["fits"] and "trainer.seq_len" not in ladder[-1]["overrides"]
    assert not {"seq_len", "rank", "cpu_offload", "disk_offload"} & set(kinds)
    assert "offload.embeddings=true" in ladder[-1]["overrides"]  # a lean option did it
    assert [k for k in kinds if k != "eval_batch"] == [k for k in LADDER_ORDER if k in kinds]


def test_every_option_before_the_quality_cuts_costs_speed_only_and_cites_what_measured_it():
    cuts = LADDER_ORDER.index("seq_len")
    for kind in ("adapter_dtype", "lean_rmsnorm", "host_embeddings", "tiled_mlp"):
        assert LADDER_ORDER.index(kind) < cuts
    assert all(COSTS[k][0] != "quality" for k in LADDER_ORDER[:cuts])
    for kind in ("checkpointing", "activation_offload", "adapter_dtype", "lean_rmsnorm", "tiled_mlp"):
        cited = re.findall(r"bench/results/[\w.*-]+\.md", COSTS[kind][1])
        assert cited, kind
        for pattern in cited:
            assert list(REPO.glob(pattern)), pattern


def test_the_ladder_checkpoints_the_fewest_first_layers_that_fit_before_all():
    cfg = compose_cfg("recipe=llama3.1-8b-24gb", "trainer.micro_batch_size=1", "trainer.gradient_checkpointing=false")
    p = planner.plan(cfg, gpus=[24 * GiB], host_ram=128 * GiB, world_size=1)
    rung = next(r for r in p["ladder"] if r["change"] == "checkpointing")
    n = int(rung["adds"].split("=")[1])
    assert 0 < n < 32 and rung["fits"]
    fewer = compose_cfg(
        "recipe=llama3.1-8b-24gb", "trainer.micro_batch_size=1", f"trainer.gradient_checkpointing={n - 1}"
    )
    assert (
        planner.plan(fewer, gpus=[24 * GiB], host_ram=128 * GiB, world_size=1, ladder=False)["devices"][0][
            "headroom_pct"
        ]
        < rung["headroom_pct"]
    )
