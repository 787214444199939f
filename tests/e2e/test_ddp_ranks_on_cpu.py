"""2-process DDP on CPU (torchrun, gloo) trains the tiny model with the ranks in step, and ranks started
apart by torchrun agree on one run dir. FSDP and ZeRO-2/3 on CPU ranks: test_sharded_training_on_cpu_ranks.py."""

import json
import os
import sys

import pytest
from conftest import REPO, SMOKE, run_job

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def test_two_process_ddp_on_cpu_trains_with_ranks_in_step(tmp_path):
    """torchrun --nproc_per_node 2 train.py (gloo on CPU) into one run dir: rank 0 writes
    metrics.json and the adapter, rank 1 metrics.rank1.json. The ranks log the same (all-reduced)
    losses and end with identical adapters (same digest of the trainable weights); and each optimizer step consumed 2 ranks x 2 examples (the logged epoch
    after 3 steps is 12 / 2000 rows, one process would be at 6 / 2000): they trained together on
    different shards of the data, not side by side on the same batches."""
    import re

    from safetensors.torch import load_file

    proc = run_job(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(REPO / "train.py"), *SMOKE, f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path, env=ENV, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / "run" / name).read_text()) for name in ("metrics.json", "metrics.rank1.json")]
    assert all(m["status"] == "ok" and m["steps"] == 3 for m in ranks)
    for key in ("train_loss_first", "train_loss_last", "train_loss_mean", "eval_loss", "adapter_sha256"):
        assert ranks[0][key] == ranks[1][key], key
    assert load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert not (tmp_path / "run" / "adapter.partial").exists()
    rows = ranks[0]["data"]["rows"]["train"]
    epochs = [float(e) for e in re.findall(r"'epoch': '([0-9.e-]+)'", proc.stdout + proc.stderr)]
    assert epochs and epochs[-1] == pytest.approx(3 * 2 * 2 / rows, abs=6e-4), epochs


# Rank 1 starts 1.5 s after rank 0, so its clock reads another second than rank 0's.
_LATE_RANK = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(1.5)
from qlora_recipes.run import dist
print("RUN_DIR", os.environ["RANK"], dist.shared_run_dir(sys.argv[1:])[0], flush=True)
"""


def test_torchrun_ranks_started_seconds_apart_agree_on_one_run_dir(tmp_path):
    """Through torchrun's own store (--standalone, the c10d rendezvous): both ranks print the
    same hydra.run.dir although they start in different seconds."""
    script = tmp_path / "late_rank.py"
    script.write_text(_LATE_RANK)
    proc = run_job(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         "trainer=smoke"],
        cwd=tmp_path, env={**ENV, "PYTHONPATH": str(REPO)}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("RUN_DIR")]
    assert sorted(rank for _, rank, _ in lines) == ["0", "1"]
    assert len({d for _, _, d in lines}) == 1 and lines[0][2].startswith("hydra.run.dir=runs/"), lines


@pytest.mark.slow
def test_plain_torchrun_train_writes_one_run_dir(tmp_path):
    """`torchrun --nproc_per_node 2 train.py trainer=smoke` with no hydra.run.dir, rank 1 started
    1.5 s late: one run dir under ./runs with rank 0's metrics.json and rank 1's metrics.rank1.json."""
    script = tmp_path / "late_train.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    time.sleep(1.5)\n"
        "from qlora_recipes.cli import train\ntrain.run(sys.argv[1:], prog='train.py')\n"
    )
    proc = run_job(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         *SMOKE],
        cwd=tmp_path, env={**ENV, "PYTHONPATH": str(REPO)}, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dirs = [p for p in (tmp_path / "runs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    assert {"metrics.json", "metrics.rank1.json"} <= {p.name for p in run_dirs[0].iterdir()}
