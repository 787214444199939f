"""The command line as a user meets it: real processes, exit codes, one-line errors, multirun."""

import csv
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
SMOKE = ["trainer=smoke", "data.metric=null"]


def run(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_smoke_run_from_another_directory_writes_a_run_dir(tmp_path):
    out = tmp_path / "run"
    proc = run(*SMOKE, f"hydra.run.dir={out}", cwd=tmp_path)  # repo paths resolve from any cwd
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert "quant = nf4" in proc.stdout  # the composed stack printed as a tree


@pytest.mark.parametrize(
    "args,needles",
    [
        (["trainer.micro_batch_sise=2"], ["micro_batch_sise", "check the spelling"]),
        (["quant=nf5"], ["quant=nf5 is not an option", "nf4", "int8"]),
        (["recipe=nope"], ["recipe=nope is not an option", "tiny-cpu"]),
        (["peft.r=big"], ["peft.r", "big"]),
        (["+foo=1"], ["unknown key foo"]),
        (["precision=fp16"], ["precision=fp16 needs a CUDA GPU"]),
        (["offload=disk", "offload.folder=null"], ["offload=disk needs an offload folder"]),
        (["data.path=/nonexistent/train.jsonl"], ["data.path", "/nonexistent/train.jsonl"]),
        (["model.name_or_path=/nonexistent/model"], ["model.name_or_path=/nonexistent/model"]),
    ],
)
def test_bad_input_gets_one_line(args, needles, tmp_path):
    proc = run(*SMOKE, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "run" / "metrics.json").exists()  # nothing half-written


def test_malformed_data_row_names_file_row_and_field(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    proc = run(*SMOKE, f"data.path={bad}", "data.eval_path=null", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(proc, "train.jsonl line 2", "completion")


def test_multirun_launches_one_job_per_combination_and_summarises(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run(
        "-m", *SMOKE, "trainer.max_steps=2", "peft.r=4,8", "optim=paged8bit,adamw8bit", f"hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p.parent for p in sweep.glob("*/metrics.json"))
    assert len(jobs) == 4
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"ok"}
    assert {r["overrides"] for r in rows} == {
        f"trainer=smoke data.metric=null trainer.max_steps=2 peft.r={r} optim={o}"
        for r in (4, 8)
        for o in ("paged8bit", "adamw8bit")
    }
    assert (sweep / "summary.md").read_text().count("\n") == 6


def test_recipe_glob_finds_every_recipe():
    # Hydra's glob(*) sweeps over the options its config loader lists (hydra issue 1942: 0 when
    # the group lives only on hydra.searchpath). conf/recipe links to recipes/, so all are found.
    from conftest import options
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        found = GlobalHydra.instance().config_loader().get_group_options("recipe")
    assert sorted(found) == options("recipe") != []
