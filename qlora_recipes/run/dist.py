"""The `dist` group: what each strategy adds to the trainer's arguments, and the command that
starts a recipe's ranks. `strategy_kwargs` gives the extra SFTConfig/TrainingArguments keywords of
`dist.strategy` (DDP: no unused-parameter search; FSDP: fsdp=True + fsdp_config; ZeRO: the
DeepSpeed json); `launch_command` gives `python train.py ...` for one process, and `accelerate
launch` (with the shipped config in launch/accelerate/) or `torchrun` for several, every rank in one
run dir (a plain `torchrun ... train.py` without hydra.run.dir too: `shared_run_dir`). What one
rank holds in memory is the planner's (qlora_recipes/planner); the hardware node is read in
devices.py. Inside the ranks (training.py calls them): CPU ranks for FSDP / ZeRO over
gloo (`prepare_ranks`), every rank starting from rank 0's adapters (`sync_adapters`), the adapter
gathered into one file (`save_gathered_adapter`) and what each rank holds, measured
(`sharding_figures`). Nothing here imports torch, deepspeed or accelerate at import time.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from pathlib import Path

from ..config import devices as _dev
from ..config.schema import DistConfig, HardwareConfig, TrainConfig
from ..errors import UserError
from ..integrations import cluster as _cluster
from ..invocation import hydra_override


def fsdp_config(dist: DistConfig) -> dict:
    """TrainingArguments.fsdp_config for FSDP2 + QLoRA; the same settings as
    launch/accelerate/fsdp_qlora.yaml (tests/unit/test_distributed_configs_and_plans.py checks they agree)."""
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # decoder layers: the model's _no_split_modules
        "reshard_after_forward": True,  # FULL_SHARD
        "cpu_offload": bool(dist.offload_params),
        "cpu_ram_efficient_loading": bool(dist.cpu_ram_efficient_loading),
        "state_dict_type": str(dist.state_dict_type),
        # trainer.gradient_checkpointing does the recomputation; FSDP's own would be a second one
        "activation_checkpointing": False,
    }


def strategy_kwargs(dist: DistConfig, world_size: int | None = None) -> dict:
    """Extra SFTConfig keywords for dist.strategy (merged into trainer_args.sft_config's call)."""
    strategy = dist.strategy
    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if strategy == "ddp" or (strategy == "none" and ws > 1):
        # LoRA leaves most parameters frozen and checkpointing re-enters forward: no search for
        # unused parameters (it fails with reentrant checkpointing and costs a pass otherwise).
        return {"ddp_find_unused_parameters": False}
    if strategy == "fsdp":
        return {"fsdp": True, "fsdp_config": fsdp_config(dist)}
    if strategy in ("zero2", "zero3"):
        return {"deepspeed": str(dist.deepspeed_config)}
    return {}


def _rendezvous(hardware: HardwareConfig) -> tuple[int, str, str]:
    """(node rank, master address, master port) for a multi-node run, from the environment."""
    addr = os.environ.get("MASTER_ADDR")
    rank = os.environ.get("NODE_RANK", os.environ.get("SLURM_NODEID"))
    if (not addr or rank is None) and _cluster.slurm_rendezvous():  # under srun: SLURM's own variables
        return _cluster.slurm_rendezvous()
    if not addr or rank is None:
        raise UserError(
            f"hardware.nodes={hardware.nodes}: set MASTER_ADDR (the first node's address) and NODE_RANK "
            "(0, 1, ...) on every node, then run the same command on each"
        )
    return int(rank), addr, os.environ.get("MASTER_PORT", "29500")


def default_run_dir(recipe: str) -> str:
    """One run dir for every rank (Hydra's default has the time in it and would differ per rank);
    under ./runs like Hydra's own; in a SLURM job, named after the job (every node, every requeue)."""
    if _cluster.slurm_run_dir(recipe):
        return _cluster.slurm_run_dir(recipe)
    now = _dt.datetime.now()
    return str(Path.cwd() / "runs" / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}-{recipe}")


RUN_DIR_KEY = "qlora_recipes/run_dir"  # in the launcher's store: the run dir every rank of this launch writes


def _has_run_dir(argv: list[str]) -> bool:
    return any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv)


def shared_run_dir(argv: list[str], now: _dt.datetime | None = None) -> list[str]:
    """`hydra.run.dir=...` for every rank of a multi-process launch that names none, else [].

    Hydra's default run dir has the time in it, read by each rank on its own: ranks starting a
    second apart would write two run dirs (metrics.json in one, metrics.rank1.json in the other, a
    checkpoint split in halves). The ranks agree through the key-value store of the launcher that
    started them (torchrun and accelerate launch: TORCHELASTIC_USE_AGENT_STORE, the TCPStore at
    MASTER_ADDR:MASTER_PORT that init_process_group also joins): the first rank to ask sets Hydra's
    own pattern, runs/DATE/TIME, from its clock (compare-and-set), and every rank reads that one
    value back. An elastic restart of the same launch finds the key set and keeps the dir. Ranks
    started without such a store take their SLURM job's dir (srun: cluster.slurm_run_dir), and
    elsewhere (mpirun, hand-set RANK/WORLD_SIZE) must be given the dir."""
    if _world_size() <= 1 or _has_run_dir(argv):
        return []
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("MASTER_ADDR"):
        if _cluster.slurm_run_dir("train"):
            return [hydra_override("hydra.run.dir", _cluster.slurm_run_dir("train"))]  # any cwd
        raise UserError(
            f"{_world_size()} ranks started without torchrun's store: pass hydra.run.dir=DIR (the same on every rank) "
            "so that they write one run dir"
        )
    from datetime import timedelta

    from torch.distributed import TCPStore

    # a client of the launcher's store; it counts no worker (the process group's own client does)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=300),
        wait_for_workers=False,
    )
    now = now or _dt.datetime.now()
    mine = f"runs/{now.strftime('%Y-%m-%d')}/{now.strftime('%H-%M-%S')}"  # conf/train.yaml hydra.run.dir
    agreed = store.compare_set(RUN_DIR_KEY, "", mine).decode()
    return [f"hydra.run.dir={agreed}"]


def launch_command(cfg: TrainConfig, recipe: str, overrides: list[str], python: str | None = None) -> list[str]:
    """The command that trains `recipe` with `overrides` on this node: `qlora train` as a module, so
    it runs the same from a checkout or an installed wheel, from any directory."""
    python = python or sys.executable
    train = ["-m", "qlora_recipes", "train", f"recipe={recipe}", *overrides]
    ws = _dev.ranks(cfg)
    if ws <= 1:
        return [python, *train]
    if not _has_run_dir(overrides):
        train.append(hydra_override("hydra.run.dir", default_run_dir(recipe)))
    hw, d = cfg.hardware, cfg.dist
    if d.launcher == "torchrun":
        cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(hw.gpus)]
        if hw.nodes > 1:
            rank, addr, port = _rendezvous(hw)
            cmd += ["--nnodes", str(hw.nodes), "--node_rank", str(rank), "--master_addr", addr, "--master_port", port]
        else:
            cmd += ["--standalone"]
        return cmd + train
    if not d.accelerate_config:
        raise UserError(
            f"dist.launcher=accelerate needs dist.accelerate_config (a launch/accelerate/*.yaml) for dist={d.strategy}"
        )
    cmd = [
        python,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(d.accelerate_config),
        "--num_processes",
        str(ws),
        "--num_machines",
        str(hw.nodes),
    ]
    if hw.nodes > 1:
        rank, addr, port = _rendezvous(hw)
        cmd += ["--machine_rank", str(rank), "--main_process_ip", addr, "--main_process_port", port]
    if d.strategy == "fsdp":
        cmd += ["--fsdp_offload_params", "true" if d.offload_params else "false"]
    if d.deepspeed_config:  # absolute, so the ranks need not start in the repository
        cmd += ["--deepspeed_config_file", str(d.deepspeed_config)]
    return cmd + train


# ---------------------------------------------------------------------------------------------
# Inside the ranks: what training.py calls under a strategy. torch, accelerate and deepspeed are
# imported here, at call time only.
# ---------------------------------------------------------------------------------------------
SHARDED = ("fsdp", "zero2", "zero3")  # strategies run by the trainer's FSDP / DeepSpeed integration


def _world_size() -> int:
    """WORLD_SIZE as a number; a value that is not one counts as 1 here (validation names it)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def prepare_ranks(dist: DistConfig, on_gpu: bool) -> None:
    """Before the trainer is built. On CPU ranks (no GPU, several processes, gloo) the sharded
    strategies take the same trainer path as on GPUs: DeepSpeed gets its CPU accelerator
    (DS_ACCELERATOR=cpu; it talks over the gloo group accelerate opens), and FSDP goes through
    accelerate's FSDP branch (`admit_fsdp_on_cpu`). Nothing changes on GPUs or in one process."""
    if on_gpu or _world_size() <= 1 or dist.strategy not in SHARDED:
        return
    if dist.strategy in ("zero2", "zero3"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        admit_fsdp_on_cpu()


def build_deepspeed_cpu_ops() -> None:
    """Compile, once per machine (torch's extension cache, ~/.cache/torch_extensions), the two C++
    extensions DeepSpeed's CPU accelerator loads: CPU Adam (ZeRO-3's offloaded optimizer) and its
    shared-memory collectives. Needs g++ and ninja; `make test-dist` and CI run it right after
    installing requirements-dist.txt, so that no test pays for the build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)


def admit_fsdp_on_cpu() -> None:
    """accelerate 1.15 takes its FSDP branch only for accelerator process groups
    (AcceleratorState.__init__: distributed_type in MULTI_GPU, MULTI_XPU, ...): on CPU ranks
    (MULTI_CPU, gloo) it drops the FSDP plugin without a word and the trainer wraps the model in
    DDP instead. This admits MULTI_CPU to that branch, doing what the branch does (distributed
    type FSDP, the plugin and its mixed precision); from there on it is accelerate's and the
    trainer's own FSDP2 code: fully_shard per decoder layer and on the root, sharded checkpoints,
    the gathered state dict. One more difference: dist.offload_params keeps FSDP2's
    CPUOffloadPolicy but without pinned memory (pinning needs an accelerator: torch raises "Cannot
    access accelerator device when none is available"). Idempotent; only called for CPU ranks."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    original = AcceleratorState.__init__
    if getattr(original, "_qlora_cpu_fsdp", False):
        return

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if isinstance(fsdp_plugin.cpu_offload, CPUOffloadPolicy) and fsdp_plugin.cpu_offload.pin_memory:
                fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)

    __init__._qlora_cpu_fsdp = True
    AcceleratorState.__init__ = __init__


def tensors_digest(tensors: dict) -> str:
    """sha256 over named tensors as fp32 (metrics.trainable_digest's scheme: the two compare)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy())  # its buffer: no bytes copy
    return digest.hexdigest()


def process_group_size() -> int:
    """The ranks of the open process group; 1 without one."""
    import torch.distributed as tdist

    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def sync_adapters(model) -> str | None:
    """Every rank starts from rank 0's adapters: the trainable weights are broadcast from rank 0
    (FSDP2 does not copy them for a 4-bit base, and ZeRO-2 and DDP trust every rank's own init),
    then every rank's digest is compared; a mismatch raises. Returns the step-0 digest; None in one
    process, where there is nothing to synchronise (the run hashes its host copy of the initial
    adapters after the timed part: `tensors_digest`), and when an earlier trainer already sharded
    them, as in an out-of-memory retry. Call once the trainer is built (the process group is open)
    and before train().

    QLORA_RECIPES_FAULTS=adapter_skew_rank=R (tests) perturbs rank R's adapters first, as a rank
    that drew another init would have them."""
    import torch
    import torch.distributed as tdist

    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if process_group_size() <= 1:
        return None
    if any(hasattr(p, "to_local") or hasattr(p, "ds_tensor") for p in params.values()):
        return None  # FSDP2 / ZeRO-3 shards: synchronised when they were made
    rank = tdist.get_rank()
    if f"adapter_skew_rank={rank}" in os.environ.get("QLORA_RECIPES_FAULTS", "").split(","):
        with torch.no_grad():
            for p in params.values():
                p.add_(1e-2 * (rank + 1))
    nccl = tdist.get_backend() == "nccl"
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            buf = p.data.to(f"cuda:{torch.cuda.current_device()}") if nccl and p.device.type != "cuda" else p.data
            tdist.broadcast(buf, src=0)
            if buf is not p.data:
                p.data.copy_(buf)
    digest = tensors_digest(params)
    digests: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"adapters differ across ranks at step 0 after the broadcast: {digests}")
    return digest


# What a collective raises on a rank whose peer is gone (gloo: the TCP pair closes under it)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(err: BaseException) -> str | None:
    """The reason, when `err` is a collective failing because another rank of this process group
    ended (killed outright, or crashed), else None: gloo's "Connection closed by peer [addr]:port",
    without its source path and advice."""
    import torch.distributed as tdist

    if not (isinstance(err, RuntimeError) and tdist.is_available() and tdist.is_initialized()):
        return None
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    for sign in _PEER_GONE:
        if sign in text:
            return sign + text.split(sign, 1)[1].split(". ", 1)[0]
    return None


def _zero_stage(trainer) -> int:
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return 0
    return int(trainer.accelerator.state.deepspeed_plugin.zero_stage)


def gathered_trainable(trainer) -> dict:
    """Every trainable weight whole, on every rank (collectives: all ranks call it together):
    FSDP2 DTensors are all-gathered, ZeRO-3 partitions gathered; otherwise the weights as they are."""
    model = trainer.model
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if _zero_stage(trainer) == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {name: p.detach().clone() for name, p in params.items()}
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for name, p in params.items()}


def adapter_digest(trainer) -> str:
    """sha256 of the whole trainable weights after training: equal on every rank when they agree."""
    return tensors_digest(gathered_trainable(trainer))


def zero_adapter_state(trainer, dtypes: dict) -> dict | None:
    """Under DeepSpeed with an optimizer: every trainable weight whole, from the optimizer's fp32
    master copy, in the dtype it had before DeepSpeed cast it (`dtypes`: name -> peft.adapter_dtype),
    for the adapter file. In bf16 mode the engine keeps bf16 weights for compute and ZeRO-3 saves
    those (stage3_gather_16bit_weights_on_model_save), ZeRO-2 too; one process, DDP and FSDP save
    the adapter in its own dtype. Collectives (all ranks call it together); None elsewhere."""
    stage = _zero_stage(trainer)
    if not stage or getattr(trainer.model_wrapped, "optimizer", None) is None:
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            if full is None:  # not held by the optimizer: the trainer's own save is right
                return None
            out[name] = full.detach().to("cpu", dtypes.get(name, full.dtype))
    return out


def save_gathered_adapter(trainer, out_dir: str, main: bool) -> bool:
    """Under FSDP the trainer saves no model with SHARDED_STATE_DICT (and a full state dict would
    gather the whole base): the adapter weights are gathered here and rank 0 writes them as one
    adapter_model.safetensors. False when the trainer's own save_model does it (one process, DDP,
    ZeRO: ZeRO-3 gathers the 16-bit adapter with stage3_gather_16bit_weights_on_model_save)."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return False
    full = gathered_trainable(trainer)
    if main:
        trainer.model.save_pretrained(out_dir, state_dict={k: v.cpu() for k, v in full.items()})
    return True


def sharding_figures(trainer) -> dict:
    """What this rank holds, measured: the distributed type accelerate runs, and for the 4-bit base
    and the adapters the elements of this rank's share vs the whole model (FSDP2 local shards,
    ZeRO-3 partitions; ZeRO-2 partitions the optimizer state, the weights stay whole)."""
    import bitsandbytes as bnb

    state = trainer.accelerator.state
    out: dict = {"distributed_type": str(state.distributed_type).split(".")[-1], "world_size": state.num_processes}
    local = {"base_4bit": 0, "adapters": 0}
    whole = {"base_4bit": 0, "adapters": 0}
    stage = _zero_stage(trainer)
    base = {id(m.weight) for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)}
    for p in trainer.model.parameters():
        key = "adapters" if p.requires_grad else ("base_4bit" if id(p) in base else None)
        if key is None:
            continue
        if hasattr(p, "to_local"):  # FSDP2 DTensor
            local[key] += p.to_local().numel()
            whole[key] += p.numel()
        elif hasattr(p, "ds_tensor"):  # ZeRO-3 partition
            local[key] += p.ds_tensor.numel()
            whole[key] += p.ds_numel
        else:
            local[key] += p.numel()
            whole[key] += p.numel()
    out.update({f"{k}_local": local[k] for k in local} | {f"{k}_whole": whole[k] for k in whole})
    if out["distributed_type"] == "FSDP":
        out["fsdp_offload"] = type(state.fsdp_plugin.cpu_offload).__name__  # CPUOffloadPolicy: offload_params
    if stage:
        out["zero_stage"] = stage
        zero = state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        out["zero_offload"] = {k: zero.get(k, {}).get("device", "none") for k in ("offload_param", "offload_optimizer")}
        opt = getattr(trainer.model_wrapped, "optimizer", None)
        groups = getattr(opt, "single_partition_of_fp32_groups", None)  # ZeRO-2; ZeRO-3 below
        groups = groups or getattr(opt, "fp32_partitioned_groups_flat", None)
        if groups:
            out["optimizer_partition_numel"] = int(sum(g.numel() for g in groups))
    return out
