"""trainer.gradient_checkpointing=auto on the tiny default under a host-RAM budget (hardware.host_ram_gib) that
full activations do not fit but one checkpointed layer does: the run resolves it to the first layer of two,
records that in config.yaml and plan.json, trains, and its measured peak (its own process) is within 10 % of
its plan. Step times are the bench's (bench/trace, bench/README.md), never a test's."""

import json
import subprocess
import sys

import yaml
from conftest import REPO, SMOKE, compose_cfg, train_py

from qlora_recipes import planner

GiB = 2**30
STACK = (*SMOKE, "trainer.seq_len=256", "trainer.micro_batch_size=128", "trainer.grad_accum=1", "data.eval_fraction=0")


def _run_start_rss() -> int:
    """A fresh process's RSS with a run's libraries imported, as run/training.py reads it before planning
    (malloc thresholds pinned, the objective's TRL trainer imported): what train.py plans its CPU baseline
    from (a test worker's own footprint, or the stated constant, can sit 100+ MiB away from it)."""
    code = (
        "import peft, transformers, trl; from qlora_recipes.run import lifecycle, training; "
        "from qlora_recipes.run.memory import pin_malloc_thresholds, rss_bytes; "
        "pin_malloc_thresholds(); lifecycle.guarded('sft'); print(rss_bytes())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _peak(gc: str, rss: int) -> int:
    cfg = compose_cfg(*STACK, f"trainer.gradient_checkpointing={gc}")
    with planner.measured_start(rss):
        return planner.plan(cfg, ladder=False)["devices"][0]["peak"]


def test_checkpointing_auto_checkpoints_one_layer_under_a_budget_and_trains_within_its_plan(tmp_path):
    rss = _run_start_rss()
    one, none = _peak("1", rss), _peak("false", rss)
    assert one < none
    budget = (one + none) / 2 / GiB  # one layer checkpointed fits, none does not
    metrics, run_dir, out = train_py(
        tmp_path / "run", *STACK, "trainer.gradient_checkpointing=auto", f"hardware.host_ram_gib={budget:.4f}"
    )
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["gradient_checkpointing"] == 1
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["stack"]["gradient_checkpointing"] == 1
    assert metrics["steps"] == 3
    assert 0.9 <= metrics["peak_mem_gib"] / metrics["planned_peak_gib"] <= 1.1, metrics
