"""Scale-out: the shipped launch configs parse with the libraries' own loaders and agree with what
qlora_recipes/dist.py passes to the trainer; combinations that cannot work are rejected with one
line; FSDP/ZeRO-3 plans are per rank; ranks agree on one run dir. Training on CPU ranks:
e2e/test_ddp_ranks_on_cpu.py (DDP) and e2e/test_sharded_training_on_cpu_ranks.py (FSDP, ZeRO-2/3)."""

import importlib.machinery
import json
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.errors import UserError
from qlora_recipes.run import dist
from qlora_recipes.run.validate import validate

ACCELERATE = sorted((REPO / "launch" / "accelerate").glob("*.yaml"))
DEEPSPEED = sorted((REPO / "launch" / "deepspeed").glob("*.json"))
GiB = 2**30


def test_every_shipped_config_is_found():
    names = {p.stem for p in ACCELERATE} | {p.name for p in DEEPSPEED}
    assert {"ddp", "fsdp_qlora", "zero2", "zero3_offload", "zero2.json", "zero3_offload.json"} <= names


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.name)
def test_accelerate_config_parses_with_accelerate(path):
    from accelerate.commands.config import load_config_from_file
    from accelerate.utils import DistributedType

    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type in (DistributedType.MULTI_GPU, DistributedType.FSDP, DistributedType.DEEPSPEED)
    # precision comes from conf/precision through the trainer (DeepSpeed: the json's "auto")
    assert cfg.mixed_precision == (None if cfg.distributed_type == DistributedType.DEEPSPEED else "no")
    if cfg.distributed_type == DistributedType.DEEPSPEED:
        ds_file = REPO / cfg.deepspeed_config["deepspeed_config_file"]
        assert ds_file.is_file() and ds_file in DEEPSPEED
        assert cfg.deepspeed_config["zero3_init_flag"] is False  # zero.Init cannot build a 4-bit model


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_accelerate_launch_env_passes_the_trainers_deepspeed_check(strategy, monkeypatch):
    """What `accelerate launch --config_file launch/accelerate/<zero>.yaml` hands each rank
    (ACCELERATE_CONFIG_DS_FIELDS) must pass accelerate's own check when the trainer builds its
    DeepSpeedPlugin from the json: a mixed_precision in the yaml was refused there ("the following
    accelerate config variables will be ignored"), on GPUs as on CPU."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin

    cfg = compose_cfg("recipe=llama3.1-405b-8xa100", f"dist={strategy}")
    cmd = dist.launch_command(cfg, "llama3.1-405b-8xa100", [])
    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
    fields = [*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])]  # as launch_command
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields))
    plugin = DeepSpeedPlugin(hf_ds_config=str(cfg.dist.deepspeed_config))
    assert plugin.zero_stage == int(strategy[-1])


@pytest.mark.parametrize("path", DEEPSPEED, ids=lambda p: p.name)
def test_deepspeed_config_parses(path):
    from accelerate.utils.deepspeed import HfDeepSpeedConfig  # no deepspeed import needed

    json.loads(path.read_text())
    ds = HfDeepSpeedConfig(str(path))
    if "zero3" in path.name:
        assert ds.is_zero3() and ds.is_offload()
        assert ds.get_value("zero_optimization.offload_param.device") == "cpu"
        assert ds.get_value("optimizer.type") == "AdamW"  # DeepSpeed's CPU Adam under offload
    else:
        assert ds.is_zero2() and not ds.is_offload()
    assert ds.get_value("train_micro_batch_size_per_gpu") == "auto"  # filled from the trainer


@pytest.mark.parametrize("option", ["none", "ddp", "fsdp", "zero2", "zero3"])
def test_dist_option_composes_and_points_at_shipped_files(option):
    cfg = compose_cfg(f"dist={option}")  # typed: every interpolation resolved
    assert cfg.dist.strategy == option
    for path in (cfg.dist.accelerate_config, cfg.dist.deepspeed_config):
        if path:
            assert Path(path).is_file(), path


def _accelerate_env(config: Path, *extra: str) -> dict:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(config), "--num_processes", "2", *extra, "train.py"]
    )
    _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("offload", [True, False])
def test_fsdp_recipe_passes_the_same_fsdp_settings_as_the_accelerate_config(offload, monkeypatch, tmp_path):
    """accelerate launch (env from launch/accelerate/fsdp_qlora.yaml + the CLI flag launch.py adds)
    and TrainingArguments (dist.strategy_kwargs) must build the same FSDP plugin."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from trl import SFTConfig

    cfg = compose_cfg("recipe=llama3.1-70b-2x24gb", f"dist.offload_params={str(offload).lower()}")
    cmd = dist.launch_command(cfg, "llama3.1-70b-2x24gb", [])
    flag = cmd[cmd.index("--fsdp_offload_params") : cmd.index("--fsdp_offload_params") + 2]
    env = _accelerate_env(Path(cfg.dist.accelerate_config), *flag)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    from_launcher = FullyShardedDataParallelPlugin()
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, report_to=[], **dist.strategy_kwargs(cfg.dist))
    from_trainer = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    for attr in ("fsdp_version", "reshard_after_forward", "state_dict_type", "cpu_ram_efficient_loading",
                 "activation_checkpointing"):  # fmt: skip
        assert getattr(from_launcher, attr) == getattr(from_trainer, attr), attr
    assert type(from_launcher.cpu_offload) is type(from_trainer.cpu_offload)
    assert from_launcher.auto_wrap_policy is from_trainer.auto_wrap_policy
    assert from_trainer.fsdp_version == 2 and bool(args.fsdp)
    assert (type(from_trainer.cpu_offload).__name__ == "CPUOffloadPolicy") is offload


def test_sft_kwargs_per_strategy():
    assert dist.strategy_kwargs(compose_cfg().dist, world_size=1) == {}
    assert dist.strategy_kwargs(compose_cfg().dist, world_size=2) == {"ddp_find_unused_parameters": False}
    assert dist.strategy_kwargs(compose_cfg("dist=ddp").dist, world_size=2) == {"ddp_find_unused_parameters": False}
    zero3 = dist.strategy_kwargs(compose_cfg("dist=zero3").dist)
    assert zero3 == {"deepspeed": str(REPO / "launch/deepspeed/zero3_offload.json")}


FSDP_OK = ("recipe=llama3.1-70b-2x24gb",)


# precision=bf16 where the message names the dtype: precision=auto follows this machine's CPU
@pytest.mark.parametrize(
    "overrides,gpu,message",
    [
        (["dist=fsdp", "precision=bf16", "quant.storage_dtype=uint8"], True, "needs quant.storage_dtype=bfloat16"),
        (["dist=fsdp", "precision=bf16", "quant.storage_dtype=float16"], True, "needs quant.storage_dtype=bfloat16"),
        (
            ["dist=zero3", "precision=bf16", "quant.storage_dtype=uint8", "optim=adamw"],
            True,
            "needs quant.storage_dtype=bfloat16",
        ),
        (["dist=fsdp", "quant=int8"], True, "cannot shard an int8"),
        ([*FSDP_OK, "optim=paged8bit"], True, "cannot use optim.name=paged_adamw_8bit"),
        ([*FSDP_OK, "optim=adamw8bit"], True, "cannot use optim.name=adamw_bnb_8bit"),
        ([*FSDP_OK, "offload=cpu"], True, "cannot run under"),
        ([*FSDP_OK, "optim=paged8bit"], False, "cannot use optim.name=paged_adamw_8bit"),  # CPU ranks too
        (["dist=ddp", "offload=disk"], True, "cannot run under"),
        (["dist=zero3", "precision=bf16", "optim=paged8bit"], True, "DeepSpeed's CPU AdamW"),
        (["dist=zero2"], True, "needs DeepSpeed, which is not installed"),
        (["dist=fsdp2"], True, "dist=fsdp2 is not an option"),
        (["dist=fsdp", "dist.strategy=fsdp2"], True, "dist.strategy=fsdp2 is not an option"),
        (["dist=ddp", "dist.launcher=mpirun"], True, "dist.launcher=mpirun is not an option"),
        (["recipe=llama2-7b-16gb", "precision=bf16"], True, "has no bfloat16"),
        (["hardware.gpus=2"], True, "needs hardware.gpu_memory_gib"),
    ],
)
def test_impossible_distributed_combinations_are_rejected_before_launch(overrides, gpu, message, monkeypatch):
    try:
        cfg = compose_cfg(*overrides)
    except Exception as err:  # an unknown option fails at composition, with the options listed
        assert "fsdp2" in str(err) and "fsdp" in str(err), err
        return
    deepspeed_installed(monkeypatch, "not installed" not in message)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        validate(cfg, gpu_available=gpu, world_size=2)


def deepspeed_installed(monkeypatch, installed: bool) -> None:
    """What validation finds for `deepspeed` (importlib.util.find_spec), whether or not this machine
    installed it: `make test` runs without DeepSpeed, `make test-dist` installs it."""
    spec = importlib.machinery.ModuleSpec("deepspeed", None) if installed else None
    module = types.ModuleType("deepspeed") if installed else None
    if module is not None:
        module.__spec__ = spec
    monkeypatch.setitem(sys.modules, "deepspeed", module)  # find_spec reads sys.modules first


def test_valid_distributed_stacks_pass(monkeypatch):
    deepspeed_installed(monkeypatch, True)
    for name in ("llama3.1-70b-2x24gb", "llama3.1-405b-8xa100"):
        cfg = compose_cfg(f"recipe={name}")
        validate(cfg, gpu_available=True, world_size=devices.ranks(cfg))
    validate(compose_cfg("dist=ddp"), gpu_available=False, world_size=2)  # DDP on CPU (gloo) is fine
    # and so are the sharded strategies (e2e/test_sharded_training_on_cpu_ranks.py)
    for option in ("fsdp", "zero2", "zero3"):
        validate(compose_cfg(f"dist={option}"), gpu_available=False, world_size=2)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_a_sharded_strategy_over_an_unquantized_base_is_not_refused_for_the_storage_dtype_it_sets(strategy):
    """The dist group sets quant.storage_dtype for the 4-bit base it shards; over quant=none that is moot."""
    from qlora_recipes.config.checks import check_stack

    check_stack(compose_cfg(f"dist={strategy}", "quant=none"))
    with pytest.raises(UserError, match="quant.storage_dtype only applies to 4-bit"):  # set by the user: said
        check_stack(compose_cfg("quant=none", "quant.storage_dtype=bfloat16", "precision=fp32"))


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_qlora_plan_refuses_a_sharded_int8_base_as_train_does(strategy, capsys):
    from qlora_recipes.cli import plan

    with pytest.raises(SystemExit) as done:
        plan.run([f"dist={strategy}", "quant=int8", "--gpus", "2x24GB"])
    assert done.value.code == 2
    assert f"error: dist={strategy} cannot shard an int8 (LLM.int8) base" in capsys.readouterr().err


def test_dist_option_brings_an_optimizer_it_can_shard():
    """dist=fsdp / dist=zero3 choose torch AdamW unless one is named (the default paged 8-bit one
    cannot run there); a named optimizer, on the command line or in a recipe, still wins."""
    assert compose_cfg("dist=fsdp").optim.name == compose_cfg("dist=zero3").optim.name == "adamw_torch"
    assert compose_cfg("dist=fsdp", "optim=paged8bit").optim.name == "paged_adamw_8bit"
    assert compose_cfg("recipe=tiny-cpu", "dist=fsdp").optim.name == "adamw_bnb_8bit"
    assert compose_cfg("dist=zero2").optim.name == compose_cfg().optim.name  # ZeRO-2 steps a client optimizer


@pytest.mark.parametrize(
    "recipe,extra,config",
    [
        ("llama3.1-70b-2x24gb", [], "fsdp_qlora.yaml"),
        ("llama3.1-405b-8xa100", ["dist=zero3", "hardware.gpus=2"], "zero3_offload.yaml"),
    ],
)
def test_launch_cpu_dry_run_starts_the_recipes_ranks_on_cpu(recipe, extra, config, capsys, monkeypatch):
    """`qlora launch --cpu RECIPE`: no GPU check, the GPUs hidden from the ranks, and the same
    accelerate launch command (config, ranks) a GPU machine gets."""
    from qlora_recipes.cli.launch import launch

    deepspeed_installed(monkeypatch, True)

    assert launch(recipe, [*extra, "model=tiny", "data=order", "trainer=smoke"], dry_run=True, cpu=True) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("CUDA_VISIBLE_DEVICES= ") and f"launch/accelerate/{config}" in line
    assert "--num_processes 2 " in line and " --cpu" not in line  # accelerate's --cpu would start one process


def test_fsdp_plan_is_per_rank():
    """Sharding halves a rank's share of the 4-bit weights; offload moves shards to host RAM;
    the quantization state and the gathered layers stay on every GPU."""
    base = ("recipe=llama3.1-70b-2x24gb", "dist.offload_params=false", "dist.load_on_cpu=true")
    gpus, host = [80 * GiB] * 8, 2048 * GiB

    def plan(*extra, ws):
        cfg = compose_cfg(*base, *extra)
        return planner.plan(cfg, gpus=gpus, host_ram=host, world_size=ws)

    two, four = plan(ws=2), plan(ws=4)
    w2, w4 = two["components"]["quantized_weights"]["cuda:0"], four["components"]["quantized_weights"]["cuda:0"]
    state = two["counts"]["quant_state_bytes"]
    assert (w2 - state) == pytest.approx(2 * (w4 - state), rel=1e-6)  # data shards: 1/ws each
    assert two["dist"] == {**two["dist"], "strategy": "fsdp", "world_size": 2}
    off = plan("dist.offload_params=true", ws=2)
    assert off["components"]["quantized_weights"]["cuda:0"] == state  # only the quant state stays
    # both ranks of the node keep their shards in its RAM: the whole 4-bit data once
    assert off["components"]["quantized_weights"]["cpu"] == pytest.approx(2 * (w2 - state), rel=1e-6)
    assert off["devices"][0]["peak"] < two["devices"][0]["peak"]
    # Without load_on_cpu every rank first loads the whole 4-bit base on its GPU: no fit on 24 GB,
    # and the plan says so (the load phase) instead of promising what the loader cannot do.
    gpu_load = planner.plan(compose_cfg("recipe=llama3.1-70b-2x24gb", "dist.load_on_cpu=false"),
                               gpus=[int(23.5 * GiB)] * 2, host_ram=128 * GiB)  # fmt: skip
    assert not gpu_load["fits"] and gpu_load["devices"][0]["peak_phase"] == "load"


def test_ddp_plan_is_a_full_replica_per_gpu():
    cfg = compose_cfg("model=llama3.1-8b", "trainer=standard", "dist=ddp")
    ddp = planner.plan(cfg, gpus=[int(23.5 * GiB)] * 2, host_ram=64 * GiB, world_size=2)
    one_process = compose_cfg("model=llama3.1-8b", "trainer=standard", "peft.adapter_dtype=float32")  # as DDP's auto
    one = planner.plan(one_process, gpus=[int(23.5 * GiB)], host_ram=64 * GiB)
    assert ddp["peak_gib"] == one["peak_gib"] and ddp["effective_batch"] == 2 * one["effective_batch"]


# --------------------------------------------------------------- one run dir for every rank
def _store_env(monkeypatch, port: int, world_size: int = 2) -> None:
    for key, value in {"WORLD_SIZE": str(world_size), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)


def test_ranks_with_different_clocks_agree_on_the_first_ranks_run_dir(monkeypatch):
    """Two ranks whose clocks read different seconds (Hydra would give them two dirs) get the run
    dir the first of them set in the launcher's store; a dir given on the command line is kept."""
    import datetime as dt

    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", 0, 1, is_master=True)  # what torchrun's agent hosts
    _store_env(monkeypatch, agent.port)
    first = dist.shared_run_dir(["trainer=smoke"], now=dt.datetime(2026, 1, 2, 3, 4, 5))
    second = dist.shared_run_dir(["trainer=smoke"], now=dt.datetime(2026, 1, 2, 3, 4, 7))
    assert first == second == ["hydra.run.dir=runs/2026-01-02/03-04-05"]
    assert dist.shared_run_dir(["hydra.run.dir=/x"]) == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert dist.shared_run_dir([]) == []


def test_ranks_without_a_launcher_store_take_the_slurm_jobs_dir_or_must_name_one(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # srun-started ranks: one job, one dir
    assert dist.shared_run_dir(["trainer=smoke"]) == [f"hydra.run.dir={tmp_path}/runs/slurm/4242-train"]
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(UserError, match="pass hydra.run.dir="):
        dist.shared_run_dir(["trainer=smoke"])
