"""Recipes (recipes/*.yaml) keep their promises: each is a pure delta with a header that states what
it trains, the hardware it is sized for, the planner's peak and the commands; each composes,
validates, and FITS its declared hardware by the planner; `make` has a target and a plan target per
recipe, generated from the directory; on a machine without the GPUs a recipe target stops with one
line and starts nothing."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, compose_cfg, options

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.errors import UserError
from qlora_recipes.run import dist
from qlora_recipes.run.validate import validate

RECIPES = options("recipe")
# Without the make variables of a `make test ARGS=...` this suite may run under: a make started
# here must see only its own command line.
MAKE_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")
ENV = {
    **{k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES},
    "HF_HUB_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
}
GiB = 2**30
# The recipes the README promises; more may be added, none may disappear.
REQUIRED = {
    "llama2-70b-a100", "llama3.1-70b-48gb", "llama3.1-8b-24gb", "llama2-7b-16gb", "mistral-7b-12gb",
    "qwen2.5-72b-a100", "llama3.1-70b-2x24gb", "llama3.1-405b-8xa100", "llama2-70b-24gb-disk", "tiny-cpu",
}  # fmt: skip
# never (re)install from a test: treat the venv stamp as up to date
MAKE = ("make", "--no-print-directory", "-o", ".venv/.installed")
EXISTING_TARGETS = {
    "help",
    "setup",
    "train",
    "test",
    "test-all",
    "lint",
    "format",
    "smoke",
    "plan",
    "sweep",
    "summarize",
}


def header(name: str) -> list[str]:
    lines = (REPO / "recipes" / f"{name}.yaml").read_text().splitlines()
    out = []
    for ln in lines:
        if not ln.startswith("#"):
            break
        out.append(ln)
    return out


def run(*cmd: str, env=ENV, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_required_recipes_exist():
    assert REQUIRED <= set(RECIPES)
    assert not set(RECIPES) & EXISTING_TARGETS  # a recipe must not shadow a make target


@pytest.mark.parametrize("name", RECIPES)
def test_header_states_what_hardware_peak_and_commands(name):
    head = header(name)
    assert head[0] == "# @package _global_"
    assert len(head[1]) > 20 and not head[1].startswith("# @")  # the one line `make help` shows
    text = "\n".join(head)
    assert "Hardware:" in text and "Planner peak:" in text
    assert f"make {name}" in text and f"make plan-{name}" in text
    body = (REPO / "recipes" / f"{name}.yaml").read_text()
    # a pure delta: group choices by `override /group: option` (a new group by `/group: option`)
    for entry in re.findall(r"^  - (.+)$", body.split("defaults:")[1].split("\n\n")[0], re.M):
        assert entry.startswith(("override /", "/dist:")), entry


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates_on_its_hardware(name):
    cfg = compose_cfg(f"recipe={name}")
    validate(cfg, gpu_available=cfg.hardware.gpus > 0, world_size=devices.ranks(cfg))
    if name != "tiny-cpu":
        effective = cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * devices.ranks(cfg)
        assert effective >= 16  # the standard trainer's real batch, not a smoke run
        assert cfg.model.name_or_path.count("/") == 1  # a real hub model, not the tiny default
        assert cfg.quant.method == "nf4" and cfg.quant.double_quant


def _header_peak(name: str) -> float:
    found = re.search(r"Planner peak: ([0-9.]+) GiB", "\n".join(header(name)))
    assert found, f"recipes/{name}.yaml: no 'Planner peak: N GiB' in the header"
    return float(found.group(1))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_fits_its_declared_hardware_by_the_planner(name):
    cfg = compose_cfg(f"recipe={name}")
    plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    over = [f"{d['device']} {d['peak'] / GiB:.1f} > {d['budget'] / GiB:.1f} GiB" for d in plan["devices"]
            if d["peak"] > d["budget"]]  # fmt: skip
    assert plan["fits"], f"recipes/{name}.yaml no longer fits {devices.describe(cfg)}: {over}"
    first = plan["devices"][0]
    stated = _header_peak(name)
    assert abs(first["peak"] / GiB - stated) <= max(0.1 * stated, 0.1), (
        f"recipes/{name}.yaml states a planner peak of {stated} GiB but the planner now says "
        f"{first['peak'] / GiB:.1f} GiB: run `make plan-{name}` and update the header"
    )


def test_fsdp_recipes_shard_and_match_the_storage_dtype():
    for name in ("llama3.1-70b-2x24gb", "llama3.1-405b-8xa100"):
        cfg = compose_cfg(f"recipe={name}")
        assert cfg.dist.strategy == "fsdp" and cfg.quant.storage_dtype == cfg.precision.dtype == "bfloat16"
        kwargs = dist.strategy_kwargs(cfg.dist)
        assert kwargs["fsdp"] is True and kwargs["fsdp_config"]["version"] == 2
        assert kwargs["fsdp_config"]["cpu_offload"] is bool(cfg.dist.offload_params)
    two = compose_cfg("recipe=llama3.1-70b-2x24gb")
    assert two.dist.offload_params and devices.ranks(two) == 2


def test_recipe_without_its_gpus_stops_with_one_line_and_starts_nothing():
    cfg = compose_cfg("recipe=llama2-70b-a100")
    with pytest.raises(UserError, match=r"needs 1 x 79 GiB GPU .*no CUDA GPU.*make plan-llama2-70b-a100"):
        devices.check_hardware_here(cfg, "llama2-70b-a100", gpus_here=[])
    with pytest.raises(UserError, match=r"cuda:0 has 22\.0 GiB"):
        devices.check_hardware_here(cfg, "llama2-70b-a100", gpus_here=[22 * GiB])
    devices.check_hardware_here(cfg, "llama2-70b-a100", gpus_here=[int(79.2 * GiB)])  # an A100 80GB
    two = compose_cfg("recipe=llama3.1-70b-2x24gb")
    with pytest.raises(UserError, match=r"needs 2 x 23.5 GiB GPUs.*1 GPU\(s\)"):
        devices.check_hardware_here(two, "llama3.1-70b-2x24gb", gpus_here=[int(23.6 * GiB)])
    devices.check_hardware_here(compose_cfg("recipe=tiny-cpu"), "tiny-cpu", gpus_here=[])  # CPU is fine


@pytest.mark.skipif(bool(devices.detect_gpus()), reason="checks the refusal on a machine without a GPU")
def test_make_recipe_target_on_a_cpu_machine_refuses(tmp_path):
    proc = run(*MAKE, "llama3.1-8b-24gb", f"ARGS=hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "make plan-llama3.1-8b-24gb" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # never half-starts


def test_launch_commands_for_one_and_several_gpus(monkeypatch):
    single = dist.launch_command(compose_cfg("recipe=llama2-70b-a100"), "llama2-70b-a100", ["trainer.max_steps=5"])
    # `qlora train` as a module: the same from a checkout or an installed wheel, from any directory
    assert single[1:] == ["-m", "qlora_recipes", "train", "recipe=llama2-70b-a100", "trainer.max_steps=5"]
    cfg = compose_cfg("recipe=llama3.1-70b-2x24gb")
    cmd = dist.launch_command(cfg, "llama3.1-70b-2x24gb", [])
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert cmd[4] == str(REPO / "launch/accelerate/fsdp_qlora.yaml")
    assert cmd[cmd.index("--num_processes") + 1] == "2" and cmd[cmd.index("--fsdp_offload_params") + 1] == "true"
    assert any(a.startswith("hydra.run.dir=") for a in cmd)  # every rank writes one run dir
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(cmd[3:])  # accelerate itself reads our command line
    assert args.module and args.training_script == "qlora_recipes" and args.training_script_args[0] == "train"
    zero3 = dist.launch_command(compose_cfg("recipe=llama3.1-405b-8xa100", "dist=zero3"), "x", [])
    ds = launch_command_parser().parse_args(zero3[3:]).deepspeed_config_file
    assert ds == str(REPO / "launch/deepspeed/zero3_offload.json")  # absolute: no chdir into the repo
    tr = dist.launch_command(compose_cfg("recipe=llama3.1-405b-8xa100", "dist.launcher=torchrun"), "x", [])
    assert tr[1:6] == ["-m", "torch.distributed.run", "--nproc_per_node", "8", "--standalone"]
    assert tr[6:9] == ["-m", "qlora_recipes", "train"]
    nodes = compose_cfg("recipe=llama3.1-405b-8xa100", "hardware.nodes=2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(UserError, match="MASTER_ADDR"):
        dist.launch_command(nodes, "llama3.1-405b-8xa100", [])
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("NODE_RANK", "1")
    cmd = dist.launch_command(nodes, "llama3.1-405b-8xa100", [])
    assert cmd[cmd.index("--num_processes") + 1] == "16" and cmd[cmd.index("--machine_rank") + 1] == "1"
    assert cmd[cmd.index("--main_process_ip") + 1] == "10.0.0.1"


def test_launch_script_dry_run_and_bad_recipe():
    proc = run(sys.executable, "scripts/launch.py", "--dry-run", "llama3.1-70b-2x24gb", "trainer.max_steps=7")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "accelerate.commands.launch" in proc.stdout and "trainer.max_steps=7" in proc.stdout
    bad = run(sys.executable, "scripts/launch.py", "no-such-recipe")
    assert bad.returncode == 2 and bad.stderr.startswith("error: recipe=no-such-recipe is not an option")


def test_make_generates_a_target_and_a_plan_target_per_recipe():
    proc = run(*MAKE, "help")
    assert proc.returncode == 0, proc.stderr
    plain = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)
    for target in ("help", "setup", "train", "test", "test-all", "lint", "format", "smoke", "plan"):
        assert re.search(rf"^  {re.escape(target)}\s", plain, re.M), target
    for name in RECIPES:
        first = header(name)[1][2:]
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(first)}$", plain, re.M), name
    for name in RECIPES:
        dry = run(*MAKE, "-n", name, "ARGS=trainer.max_steps=3")
        assert f"scripts/launch.py {name} trainer.max_steps=3" in dry.stdout, dry.stdout + dry.stderr
        dry = run(*MAKE, "-n", f"plan-{name}")
        assert f"scripts/launch.py --plan {name}" in dry.stdout, dry.stdout + dry.stderr


def test_make_plan_target_prints_the_plan_for_the_declared_hardware():
    proc = run(*MAKE, "plan-llama3.1-70b-2x24gb")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "planned for 2 x 23.5 GiB GPUs" in proc.stdout and "FITS" in proc.stdout
    assert "dist=fsdp: one rank of 2" in proc.stdout


def test_make_test_args_stay_with_pytest():
    """`make test ARGS='-x -q ...'`: the pytest arguments must not reach the `make plan-...`
    the selected test starts, neither through MAKEFLAGS nor the environment; here the outer make
    runs with this test's own environment, as a user's shell would."""
    selected = "tests/unit/test_recipes_keep_their_promises.py::test_make_plan_target_prints_the_plan_for_the_declared_hardware"
    outer = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = run(*MAKE, "test", f"ARGS=-x -q -p no:cacheprovider {selected}", env=outer)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


def test_the_makefile_passes_no_command_line_variable_down():
    """The Makefile's side of the same fix: a process a target starts (its environment, MAKEFLAGS
    included, is what a nested make would read) sees none of the command-line variables."""
    proc = run(*MAKE, "--eval=print-env: ; @env", "print-env", "ARGS=-x -q tests/x.py", "SWEEP=optim_quant")
    assert proc.returncode == 0, proc.stderr
    child_env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert "ARGS" not in child_env and "SWEEP" not in child_env
    assert "ARGS=" not in child_env.get("MAKEFLAGS", "") and "SWEEP=" not in child_env.get("MAKEFLAGS", "")


@pytest.mark.parametrize("name,target_gib", [("llama3.1-8b-8gb", 7.0), ("llama2-70b-a100", 41.0)])
def test_lean_recipes_meet_their_allocated_targets(name, target_gib):
    """What torch.cuda.max_memory_allocated would see (peers publish that figure): the 8B on an
    8 GB card at 1 x 2048 under 7 GiB, the 70B at 1 x 2048 under 41 GiB; and no full logits."""
    cfg = compose_cfg(f"recipe={name}")
    plan = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    assert plan["fits"] and plan["peak_allocated_gib"] <= target_gib, plan["peak_allocated_gib"]
    assert cfg.trainer.seq_len == 2048 and cfg.trainer.micro_batch_size == 1
    assert not any("logits" in name for name in plan["components"])


def test_the_install_shows_its_progress():
    """`make train` / `make test` on a fresh clone installed for minutes with no output
    (pip -q). The requirements install says what it does and shows pip's own progress."""
    out = run("make", "-n", "-B", ".venv/.installed").stdout
    install = [ln for ln in out.splitlines() if "pip install" in ln and "requirements.txt" in ln]
    assert install and all(" -q" not in ln for ln in install), out
    assert "installing requirements.txt" in out, out
