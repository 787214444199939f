"""`qlora plan --longest-seq`: the longest sequence a stack fits at, found on the planner's own plans."""

import copy
import subprocess
import sys

from conftest import REPO, compose_cfg

from qlora_recipes import planner

GiB = 2**30


def _fits(cfg, seq_len: int, gpus: list[int]) -> bool:
    trial = copy.deepcopy(cfg)
    trial.trainer.seq_len = seq_len
    return planner.plan(trial, gpus=gpus, host_ram=64 * GiB, ladder=False)["fits"]


def test_longest_seq_len_is_the_boundary_of_fitting_plans():
    cfg = compose_cfg("model=llama3.1-8b", "trainer=standard", "trainer.micro_batch_size=1", "data.metric=null")
    gpus = [24 * GiB]
    longest = planner.longest_seq_len(cfg, gpus=gpus, host_ram=64 * GiB)
    assert longest is not None and longest % 64 == 0
    assert _fits(cfg, longest, gpus) and not _fits(cfg, longest + 64, gpus)
    assert planner.longest_seq_len(cfg, gpus=[4 * GiB], host_ram=64 * GiB) is None  # the weights alone do not fit


def test_plan_command_prints_the_longest_sequence(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "--longest-seq", "recipe=llama3.1-8b-8gb",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("longest sequence that fits"))
    assert "7.6 GiB GPU" in line and "trainer.seq_len=" in line
    assert int(line.split("trainer.seq_len=")[1].split()[0]) >= 2048  # the recipe's own length fits
    # no data read: every row planned seq_len long, and said (a run plans the batches its rows make)
    assert "planned as if every row were trainer.seq_len=2,048 tokens long: an upper bound" in proc.stdout
