"""A finished run's dir, shared by every test here (one 1-step run from the command line, in a dir
whose name holds non-ASCII, `;`, `()`, `,`, `=` and a space, on a copy of the tiny base): a new run
there is refused unless it continues (resume=auto) or replaces (overwrite=true) it; the printed
resume line runs as printed; a resume on other base weights at the same path is refused; and the
one step, all warmup by the default ratio, trained."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMOKE, compose_cfg
from safetensors.torch import load_file, save_file

from qlora_recipes.errors import UserError
from qlora_recipes.run.resume import resume_checkpoint
from qlora_recipes.run.training import train

ODD = "rün; (1),a=b"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


@dataclass
class Finished:
    run_dir: Path
    base: Path
    overrides: list[str]
    output: str
    metrics: dict


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Finished:
    root = tmp_path_factory.mktemp("finished")
    base = root / "base"
    shutil.copytree(REPO / "assets" / "tiny-llama", base)
    run_dir = root / ODD
    overrides = [*SMOKE, f"model.name_or_path={base}", "trainer.max_steps=1", "trainer.save_steps=1"]
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides, f"hydra.run.dir='{run_dir}'"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return Finished(run_dir, base, overrides, proc.stdout + proc.stderr, metrics)


def adapter_bytes(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def test_a_single_step_all_warmup_by_the_default_ratio_still_trains(finished):
    assert finished.metrics["steps"] == 1
    assert finished.metrics["adapter_sha256"] != finished.metrics["adapter_sha256_step0"]
    assert "training without warmup" in finished.output


def test_a_new_run_in_a_finished_run_dir_is_refused_and_changes_nothing(finished):
    before = adapter_bytes(finished.run_dir)
    with pytest.raises(UserError) as refused:
        train(compose_cfg(*finished.overrides, "peft.r=4"), finished.run_dir)
    line = str(refused.value)
    assert "\n" not in line and str(finished.run_dir) in line
    assert "already holds a finished run" in line and "resume=auto" in line and "overwrite=true" in line
    assert adapter_bytes(finished.run_dir) == before


def test_overwrite_true_replaces_the_run_and_leaves_nothing_of_it(finished, tmp_path):
    run_dir = tmp_path / "replaced"
    shutil.copytree(finished.run_dir, run_dir)
    metrics = train(compose_cfg(*finished.overrides, "peft.r=4", "trainer.save_steps=0", "overwrite=true"), run_dir)
    assert metrics["status"] == "ok"
    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert not list((run_dir / "checkpoints").glob("checkpoint-*"))  # the r=16 checkpoint went with its run


def test_the_printed_resume_line_runs_as_printed(finished):
    resume = next(ln.strip() for ln in finished.output.splitlines() if ln.strip().startswith("resume "))
    line = resume.removeprefix("resume").strip()
    assert line.startswith("python train.py ")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python`: this interpreter
    proc = subprocess.run(
        ["bash", "-c", line], cwd=REPO, env={**ENV, "PATH": path}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((finished.run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["resumed_from"].endswith("checkpoint-1")


def test_resuming_on_other_base_weights_at_the_same_path_is_refused(finished, tmp_path):
    # A copy of the run and its base: the copied run names the copied base (a copy is the same base).
    run_dir, base = tmp_path / "run", tmp_path / "base"
    shutil.copytree(finished.run_dir, run_dir)
    shutil.copytree(finished.base, base)
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace(str(finished.base), str(base)))
    overrides = [*finished.overrides, f"model.name_or_path={base}", "trainer.max_steps=4", "resume=auto"]
    assert resume_checkpoint(compose_cfg(*overrides), run_dir)

    weights = load_file(str(base / "model.safetensors"))
    name = sorted(weights)[len(weights) // 2]
    weights[name] = weights[name] + torch.ones_like(weights[name])  # same shapes, same size on disk
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"resume: the base model .* changed since checkpoint-\d+ was written") as err:
        resume_checkpoint(compose_cfg(*overrides), run_dir)
    assert "\n" not in str(err.value) and "resume.allow_changes=true" in str(err.value)
    assert resume_checkpoint(compose_cfg(*overrides, "resume.allow_changes=true"), run_dir)
