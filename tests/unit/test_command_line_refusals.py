"""The command line refuses bad input as a user meets it: real processes, exit code 2, one line naming
what was wrong; Hydra's recipe glob finds every recipe."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, SMOKE

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


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


# slow: each case is also in test_bad_input_gets_one_line.py's catalog (in-process, the same
# one-line, exit-2, nothing-written checks), whose test_the_real_command_* tests cover the real
# process; here every case pays an interpreter start and the imports (~10 s).
@pytest.mark.slow
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
    assert not (tmp_path / "run").exists()  # nothing written, not even Hydra's .hydra/
    assert "Error executing job" not in proc.stderr


@pytest.mark.slow  # test_bad_input_gets_one_line.py: test_the_real_command_refuses_bad_data_in_one_line
def test_malformed_data_row_names_file_row_and_field(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n')
    proc = run(*SMOKE, f"data.path={bad}", "data.eval_path=null", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(proc, "train.jsonl line 2", "completion")
    assert not (tmp_path / "run").exists()  # the data is checked before config.yaml and plan.json


def test_recipe_glob_finds_every_recipe():
    # Hydra's glob(*) sweeps over the options its config loader lists (github.com/facebookresearch/hydra/issues/1942: 0 when
    # the group lives only on hydra.searchpath). conf/recipe links to recipes/, so all are found.
    from conftest import options
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        found = GlobalHydra.instance().config_loader().get_group_options("recipe")
    assert sorted(found) == options("recipe") != []
