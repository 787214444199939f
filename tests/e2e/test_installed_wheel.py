"""The installable package: a wheel that ships the configs, recipes and tiny model (no benchmark code),
with a `qlora` command that trains the embedded default from outside the repository."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, SMOKE

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # hatchling is in requirements.txt, so the build needs no network (no isolated build env).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (path,) = out.glob("qlora_recipes-*.whl")
    return path


def test_wheel_ships_the_configs_recipes_and_tiny_model_and_no_benchmark_code(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = "qlora_recipes/shipped/"
    for rel in ("conf/train.yaml", "recipes/llama2-70b-a100.yaml", "launch/accelerate/fsdp_qlora.yaml"):
        assert shipped + rel in names, rel
    assert shipped + "assets/tiny-llama/model.safetensors" in names
    assert shipped + "assets/data/order/train.jsonl" in names
    # conf/recipe is a link to recipes/ in the repo: the wheel holds the files themselves.
    assert shipped + "conf/recipe/tiny-cpu.yaml" in names
    assert not any(n.startswith(("bench/", "tests/", "scripts/")) for n in names)
    assert "qlora_recipes/bench.py" not in names  # only the `qlora bench` subcommand, which runs bench/
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "qlora = qlora_recipes.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_trains_the_default_from_outside_the_repo(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    # The dependencies (torch, transformers, ...) come from this interpreter's site-packages; the
    # package itself only from the fresh venv (the checkout is not on the path).
    env = {**ENV, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import qlora_recipes; print(qlora_recipes.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert str(venv) in where.stdout and str(REPO) not in where.stdout
    run_dir = elsewhere / "run"
    proc = subprocess.run(
        [str(venv / "bin" / "qlora"), "train", *SMOKE, f"hydra.run.dir={run_dir}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["steps"] == 3
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def qlora(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qlora_recipes", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )
