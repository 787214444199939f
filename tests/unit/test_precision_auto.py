"""precision=auto, the default: bf16 where the hardware computes it natively, fp16 on older GPUs,
fp32 on other CPUs; said in one line, resolved before anything reads it, and planned as it picks.
The device facts are faked (devices.cuda_device, devices.cpu_flags), so every case runs here."""

import json
import logging
import subprocess
import sys

import pytest
from conftest import REPO, compose_cfg

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.config.loader import precision_for
from qlora_recipes.errors import UserError
from qlora_recipes.run.resume import resume_checkpoint
from qlora_recipes.run.training import train
from qlora_recipes.run.validate import validate
from qlora_recipes.units import GiB

NO_GPU = None
A100, H100 = ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA H100 80GB HBM3", (9, 0))
T4, V100 = ("Tesla T4", (7, 5)), ("Tesla V100-SXM2-16GB", (7, 0))
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})  # Sapphire Rapids and later
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})  # Cooper Lake, Zen 4
AVX2 = frozenset({"avx2", "fma"})  # most CPUs: bf16 emulated


@pytest.fixture
def device(monkeypatch):
    """Fake this machine: device(gpu, cpu_flags)."""

    def fake(gpu, flags=AVX2):
        monkeypatch.setattr(devices, "cuda_device", lambda: gpu)
        monkeypatch.setattr(devices, "cpu_flags", lambda: flags)

    return fake


@pytest.mark.parametrize(
    "gpu,flags,picked,why",
    [
        (A100, AVX2, "bf16", "NVIDIA A100-SXM4-80GB, compute capability 8.0, computes bf16 natively"),
        (H100, AVX2, "bf16", "compute capability 9.0, computes bf16 natively"),
        (T4, AMX, "fp16", "Tesla T4, compute capability 7.5, has no native bf16"),
        (V100, AVX2, "fp16", "compute capability 7.0, has no native bf16"),
        (NO_GPU, AMX, "bf16", "this CPU computes bf16 natively: avx512_bf16, amx_bf16"),
        (NO_GPU, AVX512_BF16, "bf16", "this CPU computes bf16 natively: avx512_bf16"),
        (NO_GPU, AVX2, "fp32", "this CPU has no native bf16: no avx512_bf16/amx_bf16 flag"),
        (NO_GPU, frozenset(), "fp32", "no avx512_bf16/amx_bf16 flag"),  # no /proc/cpuinfo
    ],
)
def test_auto_picks_what_the_device_computes_natively(device, gpu, flags, picked, why):
    device(gpu, flags)
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[picked]
    cfg = compose_cfg()
    assert (cfg.precision.name, cfg.precision.dtype, cfg.quant.compute_dtype) == (picked, dtype, dtype)
    line = devices.precision_line(cfg)
    assert line.startswith(f"precision=auto: {picked} (") and why in line and "\n" not in line
    assert cfg.precision.auto and precision_for(cfg, None) is cfg  # picked once, for this machine


@pytest.mark.parametrize("gpu,flags", [(A100, AMX), (T4, AVX2), (NO_GPU, AMX), (NO_GPU, AVX2)])
@pytest.mark.parametrize("named", ["bf16", "fp16", "fp32"])
def test_a_named_precision_is_kept_whatever_the_device(device, gpu, flags, named):
    device(gpu, flags)
    cfg = compose_cfg(f"precision={named}")
    assert devices.precision_line(cfg) is None and cfg.precision.name == named and not cfg.precision.auto
    assert precision_for(cfg, [80 * GiB]) is cfg


def test_recipes_that_name_a_precision_keep_it(device):
    device(T4, AVX2)
    assert compose_cfg("recipe=llama3.1-8b-24gb").precision.name == "bf16"
    assert compose_cfg("recipe=llama2-7b-16gb").precision.name == "fp16"
    assert compose_cfg("recipe=tiny-cpu").precision.name == "fp32"  # one plan on every CPU
    assert compose_cfg().precision.auto  # the default names none: auto


def test_a_recipe_without_bf16_never_gets_it(device):
    """hardware.bf16=false (a T4 / V100 recipe): fp16 on a GPU, even one with bf16; fp32 on a CPU."""
    for gpu, flags, picked in ((A100, AVX2, "fp16"), (T4, AVX2, "fp16"), (NO_GPU, AMX, "fp32")):
        device(gpu, flags)
        cfg = compose_cfg("recipe=llama2-7b-16gb", "precision=auto")
        assert devices.precision_line(cfg).startswith(f"precision=auto: {picked} (")
        assert cfg.precision.name == picked


# ---------------------------------------------------------------------------------------------
# the planner plans what auto picks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,same_as", [(AVX2, "fp32"), (AMX, "bf16")])
def test_the_plan_of_the_default_is_the_plan_of_what_auto_picks_here(device, flags, same_as):
    device(NO_GPU, flags)
    auto = planner.plan(compose_cfg(), host_ram=24 * GiB)
    assert auto == planner.plan(compose_cfg(f"precision={same_as}"), host_ram=24 * GiB)
    other = "bf16" if same_as == "fp32" else "fp32"
    assert auto != planner.plan(compose_cfg(f"precision={other}"), host_ram=24 * GiB)


def test_planning_for_named_gpus_picks_for_those_gpus_not_this_cpu(device):
    device(NO_GPU, AVX2)  # this CPU would pick fp32
    cfg = compose_cfg("model=llama3.1-8b")
    gpus = devices.parse_gpus("80GB")
    plan = planner.plan(cfg, gpus=gpus, host_ram=64 * GiB)
    assert plan["stack"]["dtype"] == "bfloat16"  # no hardware node: a GPU with bf16
    assert plan == planner.plan(compose_cfg("model=llama3.1-8b", "precision=bf16"), gpus=gpus, host_ram=64 * GiB)
    assert cfg.precision.auto and cfg.precision.name == "fp32"  # the caller's config is left as it was
    t4 = compose_cfg("recipe=llama2-7b-16gb", "precision=auto")
    fp16 = planner.plan(t4, gpus=devices.declared_gpus(t4), host_ram=64 * GiB)
    assert fp16["stack"]["dtype"] == "float16"
    assert fp16 == planner.plan(compose_cfg("recipe=llama2-7b-16gb"), gpus=devices.declared_gpus(t4), host_ram=64 * GiB)


def _plan_command(tmp_path, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", *args, f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("precision=auto:")]
    return said, json.loads((tmp_path / "plan.json").read_text())["stack"]["dtype"]


def test_plan_command_says_what_auto_picks_for_the_gpus_it_plans_for(tmp_path):
    said, dtype = _plan_command(tmp_path / "a", "--gpus", "80GB", "model=llama3.1-8b")
    assert len(said) == 1 and said[0].startswith("precision=auto: bf16 (the GPUs planned for") and dtype == "bfloat16"
    said, dtype = _plan_command(tmp_path / "b", "recipe=llama2-7b-16gb", "precision=auto")  # its hardware node
    assert len(said) == 1 and said[0].startswith("precision=auto: fp16 (") and dtype == "float16"
    said, dtype = _plan_command(tmp_path / "c", "--gpus", "80GB", "model=llama3.1-8b", "precision=fp32")
    assert said == [] and dtype == "float32"


# ---------------------------------------------------------------------------------------------
# a run: one line, the concrete precision everywhere it is recorded, resume compares it
# ---------------------------------------------------------------------------------------------
SMOKE = ["trainer=smoke", "data.metric=null", "trainer.save_steps=1"]


def test_a_run_says_its_choice_once_and_records_the_concrete_precision(device, run_dir, caplog):
    device(NO_GPU, AVX2)
    with caplog.at_level(logging.INFO, logger="train"):
        m = train(compose_cfg(*SMOKE), run_dir)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("precision=auto")]
    assert said == ["precision=auto: fp32 (this CPU has no native bf16: no avx512_bf16/amx_bf16 flag)"]
    assert m["steps"] == 3
    saved = (run_dir / "config.yaml").read_text()
    assert "name: fp32" in saved and "dtype: float32" in saved and "compute_dtype: float32" in saved
    assert "auto_precision" not in saved
    assert json.loads((run_dir / "plan.json").read_text())["stack"]["dtype"] == "float32"

    # resume compares against what the run recorded: auto picking bf16 on another machine is a change
    more = [*SMOKE, "trainer.max_steps=4", "resume=auto"]
    device(NO_GPU, AMX)
    with pytest.raises(UserError, match=r"differs .* in .*precision\.name"):
        resume_checkpoint(compose_cfg(*more), run_dir)
    assert resume_checkpoint(compose_cfg(*more, "precision=fp32"), run_dir).endswith("checkpoint-3")
    device(NO_GPU, AVX2)
    assert resume_checkpoint(compose_cfg(*more), run_dir).endswith("checkpoint-3")  # same pick: resumes


def test_a_dtype_set_by_hand_is_not_overwritten_but_refused(device):
    device(NO_GPU, AVX2)
    cfg = compose_cfg("precision.dtype=float16")
    assert (cfg.precision.name, cfg.precision.dtype) == ("fp32", "float16")
    with pytest.raises(UserError, match="precision.dtype=float16 contradicts precision=fp32"):
        validate(cfg, gpu_available=False)
