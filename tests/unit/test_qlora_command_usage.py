"""The `qlora` command without installing a wheel: every subcommand's --help, usage for no or an unknown
command; and no module edits sys.path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def qlora(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qlora_recipes", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("command", ["train", "plan"])
def test_hydra_commands_help_lists_the_groups_and_their_options(command):
    proc = qlora(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"usage: qlora {command}" in proc.stdout
    for line in ("quant ", "peft ", "optim ", "offload ", "precision ", "model ", "recipe "):
        assert any(ln.strip().startswith(line.strip()) for ln in proc.stdout.splitlines()), line
    assert "nf4*" in proc.stdout and "llama2-70b-a100" in proc.stdout  # default marked, recipes listed
    assert len(proc.stdout.splitlines()) < 40  # a page, not a config dump
    if command == "plan":
        assert "--gpus" in proc.stdout and "--host-ram" in proc.stdout and "--check" in proc.stdout


@pytest.mark.parametrize("command", ["launch", "merge", "generate", "summarize"])
def test_other_commands_help(command):
    proc = qlora(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert f"usage: qlora {command}" in proc.stdout


def test_qlora_without_or_with_an_unknown_command_gets_usage_or_one_line():
    listing = qlora("--help")
    assert listing.returncode == 0
    for name in ("train", "plan", "merge", "generate", "summarize", "bench", "launch"):
        assert f"  {name} " in listing.stdout
    bad = qlora("trian")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no such command" in bad.stderr
    assert "train" in bad.stderr


def test_no_sys_path_edits_anywhere():
    offenders = [
        str(p.relative_to(REPO))
        for folder in ("qlora_recipes", "scripts", "tests", "bench")
        for p in (REPO / folder).rglob("*.py")
        if "sys.path.insert" in p.read_text() and p.name != Path(__file__).name
    ]
    assert offenders == [] and "sys.path.insert" not in (REPO / "train.py").read_text()
