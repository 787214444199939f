"""Sharded training proven without GPUs: FSDP2 and DeepSpeed ZeRO-2/3 run for real as 2 CPU ranks
over gloo, through train.py and the trainer's own FSDP / DeepSpeed integration (accelerate), with
the shipped launch configs; they match one process, save sharded checkpoints, survive a kill and
resume, and leave one adapter file that a single process loads and merges.

What differs from a GPU run, and why (each shown by the library's own words in
test_what_the_libraries_refuse_on_cpu):
- FSDP: accelerate 1.15 enters its FSDP branch only for accelerator process groups; on CPU ranks
  (MULTI_CPU) it silently drops the plugin and the trainer would run DDP. qlora_recipes.run.dist
  admits MULTI_CPU to that same branch (dist.admit_fsdp_on_cpu); everything after it (fully_shard
  per decoder layer and on the root, sharded checkpoints) is the libraries' code.
- FSDP with dist.offload_params: FSDP2's CPUOffloadPolicy pins memory, which needs an accelerator
  ("Cannot access accelerator device when none is available"); CPU ranks keep the policy unpinned.
- DeepSpeed: its CPU accelerator (DS_ACCELERATOR=cpu) over the gloo group accelerate opens, no
  oneCCL; it compiles two small C++ extensions (CPU Adam, shared-memory comm) once per machine.
- Not tested here: CUDA kernels, NCCL, real GPU memory (README, Multi-GPU).

`make test` (CI) runs the FSDP 2-rank smoke and needs no DeepSpeed; the ZeRO-2/3 smokes (2-3 min
each on 2 cores) and the rest are `slow`: `make test-dist` installs DeepSpeed and runs them all
(`make test-all` too, where DeepSpeed is installed). Each rank's peak RSS is in its metrics file
(peak_mem_gib).
"""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SMOKE, run_job

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="deepspeed not installed: pip install -r requirements-dist.txt"
)
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
STRATEGIES = [pytest.param(s, marks=needs_deepspeed if s != "fsdp" else ()) for s in ("fsdp", "zero2", "zero3")]
# The 2-rank smoke: FSDP in the fast suite, ZeRO-2/3 `slow` (DeepSpeed's engine on CPU ranks).
SMOKE_STRATEGIES = [
    STRATEGIES[0],
    *(pytest.param(s, marks=(needs_deepspeed, pytest.mark.slow)) for s in ("zero2", "zero3")),
]


def _torchrun(*args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


def _run(cmd: list[str], cwd: Path, faults: str = "", timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**ENV, "QLORA_RECIPES_FAULTS": faults} if faults else ENV
    proc = run_job(cmd, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def train_ranks(run: Path, *overrides: str, faults: str = "") -> list[dict]:
    """`torchrun --nproc_per_node 2 train.py ...` into `run`; both ranks' metrics."""
    _run(_torchrun(str(REPO / "train.py"), *overrides, f"hydra.run.dir={run}"), run.parent, faults)
    return rank_metrics(run)


def train_one(run: Path, *overrides: str) -> dict:
    _run([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={run}"], run.parent)
    return json.loads((run / "metrics.json").read_text())


def rank_metrics(run: Path) -> list[dict]:
    return [json.loads((run / name).read_text()) for name in ("metrics.json", "metrics.rank1.json")]


def assert_ranks_agree(ranks: list[dict], steps: int) -> None:
    """Both ranks trained the same steps, logged the same finite losses, started from the same
    adapters and ended with the same (whole, gathered) adapters."""
    for m in ranks:
        assert m["status"] == "ok" and m["steps"] == steps, m
        assert all(math.isfinite(x) for x in m["train_losses"]), m["train_losses"]
    for key in ("train_losses", "eval_loss", "adapter_sha256", "adapter_sha256_step0"):
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["adapter_sha256_step0"], "no step-0 digest: adapters were not synchronised"


def assert_sharded(strategy: str, ranks: list[dict]) -> None:
    """The measured share of each rank: under FSDP and ZeRO-3 half of the 4-bit base and of the
    adapters; under ZeRO-2 whole weights and half of the optimizer state."""
    for m in ranks:
        s = m["sharding"]
        assert s["world_size"] == 2, s
        assert s["base_4bit_whole"] > 0 and s["adapters_whole"] > 0, s
        if strategy == "fsdp":
            assert s["distributed_type"] == "FSDP", s
        else:
            assert s["distributed_type"] == "DEEPSPEED" and s["zero_stage"] == int(strategy[-1]), s
            assert s["optimizer_partition_numel"] * 2 == s["adapters_whole"], s
        if strategy in ("fsdp", "zero3"):
            assert s["base_4bit_local"] * 2 == s["base_4bit_whole"], s
            assert s["adapters_local"] * 2 == s["adapters_whole"], s
        else:
            assert s["base_4bit_local"] == s["base_4bit_whole"] and s["adapters_local"] == s["adapters_whole"], s


def assert_one_adapter_file(run: Path, ranks: list[dict]) -> None:
    from safetensors.torch import load_file

    tensors = load_file(run / "adapter" / "adapter_model.safetensors")
    assert sum(t.numel() for t in tensors.values()) == ranks[0]["sharding"]["adapters_whole"]
    assert not (run / "adapter.partial").exists()


def assert_rank_peaks_against_the_rank_plan(run: Path, strategy: str, ranks: list[dict]) -> None:
    """Every rank records its own peak RSS, beside the plan of one CPU rank (plan.json is that plan:
    planner/sharded.py plan_cpu_rank; bench/results/planner-sharded.json compares the two)."""
    from qlora_recipes.run.memory import CPU_QUANTITY, planned_peak_gib

    plan = json.loads((run / "plan.json").read_text())
    assert plan["dist"] == {"strategy": strategy, "world_size": 2, "ranks_per_node": 2, "cpu_ranks": True}
    planned = planned_peak_gib(plan, gpu=False)
    for m in ranks:
        assert m["peak_quantity"] == CPU_QUANTITY and m["peak_mem_gib"] > 0.3, m
        # each rank plans from its own RSS at its start (planner/process.py); plan.json is rank 0's
        assert m["planned_peak_gib"] == pytest.approx(planned, abs=0.02), m
    assert ranks[0]["planned_peak_gib"] == planned


def _peaks(ranks: list[dict]) -> str:
    return ", ".join(f"rank {i} peak RSS {m['peak_mem_gib']:.3f} GiB" for i, m in enumerate(ranks))


# ------------------------------------------------------------------------------------ fast (CI), ZeRO slow


def test_what_the_libraries_refuse_on_cpu(tmp_path):
    """The libraries' own behaviour on CPU ranks, and the nearest path each allows: accelerate
    drops an FSDP plugin on a MULTI_CPU state (no error: it would run DDP), which
    dist.admit_fsdp_on_cpu turns into its FSDP branch; torch refuses FSDP2's pinned CPU offload,
    and allows it unpinned."""
    code = r"""
import json, os, torch
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
os.environ["MASTER_PORT"] = str(29700 + os.getpid() % 200)
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
out = {}
PartialState(cpu=True)  # what TrainingArguments(use_cpu=True) sets up on CPU ranks
acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
out["plain"] = [str(acc.distributed_type), getattr(AcceleratorState(), "fsdp_plugin", None) is not None]
AcceleratorState._reset_state(reset_partial_state=True)
from qlora_recipes.run import dist
dist.admit_fsdp_on_cpu()
PartialState(cpu=True)
acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True))
out["admitted"] = [str(acc.distributed_type), AcceleratorState().fsdp_plugin is not None,
                   AcceleratorState().fsdp_plugin.cpu_offload.pin_memory]
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
try:
    fully_shard(torch.nn.Linear(4, 4), offload_policy=CPUOffloadPolicy())
    out["pinned"] = "ok"
except RuntimeError as err:
    out["pinned"] = str(err)
fully_shard(torch.nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=False))
out["unpinned"] = "ok"
print("RESULT " + json.dumps(out))
"""
    proc = _run([sys.executable, "-c", code], tmp_path, timeout=300)
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["plain"] == ["DistributedType.MULTI_CPU", False]  # accelerate: FSDP silently dropped
    assert out["admitted"] == ["DistributedType.FSDP", True, False]
    assert "Cannot access accelerator device when none is available" in out["pinned"]  # torch's own words
    assert out["unpinned"] == "ok"


@pytest.mark.parametrize("strategy", SMOKE_STRATEGIES)
def test_two_cpu_ranks_shard_train_and_agree(strategy, tmp_path):
    """`torchrun --nproc_per_node 2 train.py dist=S trainer=smoke`: 3 steps on 2 ranks through the
    trainer's FSDP / DeepSpeed path, equal finite losses on both ranks, the weights really split
    (measured per rank), a sharded checkpoint at step 2 (each rank's part), and one adapter file.
    Adapters identical at step 0 by construction: rank 1 is made to start from other adapters
    (QLORA_RECIPES_FAULTS=adapter_skew_rank=1) and must still start from rank 0's."""
    run = tmp_path / "run"
    ranks = train_ranks(run, f"dist={strategy}", *SMOKE, "trainer.save_steps=2", faults="adapter_skew_rank=1")
    assert_ranks_agree(ranks, steps=3)
    assert_sharded(strategy, ranks)
    assert_one_adapter_file(run, ranks)
    assert_rank_peaks_against_the_rank_plan(run, strategy, ranks)
    checkpoint = run / "checkpoints" / "checkpoint-2"
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= {p.name for p in checkpoint.iterdir()}
    if strategy == "fsdp":  # torch.distributed.checkpoint: one file per rank
        assert sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    else:  # DeepSpeed: one optimizer partition per rank
        assert len(list((checkpoint / "global_step2").glob("*optim_states.pt"))) == 2
    print(f"dist={strategy}: losses {ranks[0]['train_losses']}; {_peaks(ranks)}")


# ------------------------------------------------------------------------------------ slow


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_documented_command_runs_on_cpu(strategy, tmp_path):
    """Exactly `torchrun --nproc_per_node 2 train.py dist=S trainer=smoke` (the run dir pinned so
    both ranks share it), exact-match generation included."""
    run = tmp_path / "run"
    ranks = train_ranks(run, f"dist={strategy}", "trainer=smoke")
    assert_ranks_agree(ranks, steps=3)
    assert ranks[0]["eval_exact_match"] == ranks[1]["eval_exact_match"] is not None
    print(f"dist={strategy}: losses {ranks[0]['train_losses']}; {_peaks(ranks)}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_saved_adapter_has_the_configured_dtype_on_every_strategy(strategy, tmp_path):
    """precision=bf16 computes in bf16 (DeepSpeed keeps bf16 weights for it); the adapter and a
    checkpoint's adapter are saved in peft.adapter_dtype (float32), from the fp32 weights the
    optimizer steps: values bf16 cannot hold, not bf16 ones upcast. (FSDP's sharded checkpoints
    hold the weights in their .distcp files, no adapter file.)"""
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "run"
    ranks = train_ranks(run, f"dist={strategy}", *SMOKE, "precision=bf16", "peft.adapter_dtype=float32",
                        "trainer.save_steps=2")  # fmt: skip
    assert_ranks_agree(ranks, steps=3)
    files = [run / "adapter" / "adapter_model.safetensors"]
    if strategy != "fsdp":
        files.append(run / "checkpoints" / "checkpoint-2" / "adapter_model.safetensors")
    for path in files:
        tensors = load_file(path)
        assert tensors and {t.dtype for t in tensors.values()} == {torch.float32}, (path, tensors.keys())
        trained = [t for name, t in tensors.items() if "lora_B" in name]  # zero at the start, trained since
        assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in trained), path


# One process on the same global batch: micro-batch 4 here, 2 per rank there (the distributed
# sampler deals each rank every other batch of 2 of the same order). LoRA dropout off: its masks
# are drawn per rank, so with dropout the gradients differ from one process by design.
SAME_BATCH = (*SMOKE, "peft.dropout=0", "optim=adamw")
# fp32: the same math, summed in another order across ranks: bit-identical before the first
# update, then within rel 1e-6 (seen: 1.2e-7). bf16: FSDP's MixedPrecisionPolicy(param_dtype=bf16)
# and DeepSpeed's bf16 mode cast the weights k-bit prep keeps in fp32 (norms, embeddings,
# lm_head) to bf16 for compute, where one process autocasts op by op: within rel 2e-2 (seen 6e-3).
TOLERANCE = {"fp32": 1e-6, "bf16": 2e-2}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    cache: dict[str, dict] = {}

    def get(precision: str) -> dict:
        if precision not in cache:
            run = tmp_path_factory.mktemp(f"one-{precision}") / "run"
            cache[precision] = train_one(run, *SAME_BATCH, "trainer.micro_batch_size=4", f"precision={precision}")
        return cache[precision]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", [STRATEGIES[0], STRATEGIES[2]])
def test_two_ranks_match_one_process(strategy, precision, one_process, tmp_path):
    one = one_process(precision)
    ranks = train_ranks(tmp_path / "run", f"dist={strategy}", *SAME_BATCH, f"precision={precision}")
    assert_ranks_agree(ranks, steps=3)
    assert ranks[0]["adapter_sha256_step0"] == one["adapter_sha256_step0"]  # rank 0's init is one process's
    two = ranks[0]["train_losses"]
    if precision == "fp32":
        assert two[0] == one["train_losses"][0]  # bit-identical before any update
    assert two == pytest.approx(one["train_losses"], rel=TOLERANCE[precision])
    print(f"dist={strategy} {precision}: 2 ranks {two} vs one process {one['train_losses']}")


def _kill_after(cmd: list[str], cwd: Path, ready: Path) -> None:
    """Start `cmd`, SIGKILL it and every rank under it once `ready` exists (no clean shutdown)."""
    import psutil

    with open(cwd / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while not ready.is_dir() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before {ready.name} could be killed"
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            try:
                p.send_signal(signal.SIGKILL)  # the ranks too: torchrun does not pass it on
            except psutil.NoSuchProcess:
                pass
        proc.wait()


# FSDP: bit-identical after a resume. ZeRO-3 offloads the optimizer to DeepSpeed's CPU Adam, which
# keeps beta^t as a running float product and recomputes it with pow() after a restart
# (csrc/includes/cpu_adam.h, IncrementStep): the first step after the resume is bit-identical, the
# next ones within rel 1e-5 in fp32 (seen: 3e-6); in bf16 that ulp is amplified to ~3e-3.
RESUME = {"fsdp": ("bf16", 0.0), "zero3": ("fp32", 1e-5)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [STRATEGIES[0], STRATEGIES[2]])
def test_kill_and_resume_on_two_ranks_then_merge(strategy, tmp_path):
    """Checkpoint every 2 of 6 steps; SIGKILL every process once checkpoint-2 exists; relaunch
    with resume=auto on 2 ranks: the same losses as an uninterrupted 2-rank run. The gathered
    adapter (one safetensors file) then loads in a single process and merges (`qlora merge`)."""
    precision, rel = RESUME[strategy]
    overrides = [
        f"dist={strategy}",
        *SAME_BATCH,
        "trainer.max_steps=6",
        "trainer.save_steps=2",
        f"precision={precision}",
    ]
    whole = train_ranks(tmp_path / "whole", *overrides)
    run = tmp_path / "run"
    _kill_after(
        _torchrun(str(REPO / "train.py"), *overrides, f"hydra.run.dir={run}"),
        tmp_path,
        run / "checkpoints" / "checkpoint-2",
    )
    assert not (run / "metrics.json").exists()
    resumed = train_ranks(run, *overrides, "resume=auto")
    assert_ranks_agree(resumed, steps=6)
    assert resumed[0]["resumed_from"].endswith("checkpoint-2")
    losses, expected = resumed[0]["train_losses"], whole[0]["train_losses"]
    assert losses[:3] == expected[:3]  # up to and including the first step after the checkpoint
    if rel == 0.0:
        assert losses == expected and resumed[0]["adapter_sha256"] == whole[0]["adapter_sha256"]
    else:
        assert losses == pytest.approx(expected, rel=rel)
    assert_one_adapter_file(run, resumed)
    merged = tmp_path / "merged"
    _run([sys.executable, str(REPO / "scripts" / "merge.py"), str(run), "--out", str(merged)], tmp_path)
    assert list(merged.glob("*.safetensors")) and (merged / "config.json").is_file()
    print(f"dist={strategy} resumed: {losses} vs uninterrupted {expected}; {_peaks(resumed)}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,extra,strategy",
    [
        ("llama3.1-70b-2x24gb", (), "fsdp"),  # with dist.offload_params (CPUOffloadPolicy, unpinned here)
        pytest.param("llama3.1-405b-8xa100", ("dist=zero3", "hardware.gpus=2"), "zero3", marks=needs_deepspeed),
        pytest.param("llama3.1-405b-8xa100", ("dist=zero2", "hardware.gpus=2"), "zero2", marks=needs_deepspeed),
    ],
)
def test_qlora_launch_starts_the_recipe_ranks_on_cpu(recipe, extra, strategy, tmp_path):
    """`scripts/launch.py --cpu RECIPE` (= `qlora launch --cpu`): the recipe's stack with the tiny
    model, started by `accelerate launch --config_file launch/accelerate/...` as on GPUs."""
    run = tmp_path / "run"
    args = [recipe, *extra, "model=tiny", "data=order", *SMOKE, f"hydra.run.dir={run}"]
    proc = _run([sys.executable, str(REPO / "scripts" / "launch.py"), "--cpu", *args], tmp_path)
    assert "accelerate.commands.launch --config_file" in proc.stdout
    ranks = rank_metrics(run)
    assert_ranks_agree(ranks, steps=3)
    assert_sharded(strategy, ranks)
    if strategy == "fsdp":
        assert ranks[0]["sharding"]["fsdp_offload"] == "CPUOffloadPolicy"
    if strategy == "zero3":
        assert ranks[0]["sharding"]["zero_offload"] == {"offload_param": "cpu", "offload_optimizer": "cpu"}
    print(f"launch --cpu {recipe} dist={strategy}: losses {ranks[0]['train_losses']}; {_peaks(ranks)}")
