"""Fail fast offline: the cause a user can fix is named first (a missing data file
before the model is looked up), and a hub model id with no hub is one line within seconds, not a
minute of "Retrying" lines. Hermetic: the hub endpoint is a closed port on this machine."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg
from huggingface_hub import constants

from qlora_recipes.errors import UserError
from qlora_recipes.model.check import check_hub_model

README_COMMAND = ["model=llama3.1-8b", "trainer=standard", "data.path=my.jsonl"]  # the README's example


def closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_without_hub(cwd: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    """`python train.py OVERRIDES` in `cwd`, the hub endpoint unreachable, an empty HF cache, and
    no HF_HUB_OFFLINE (the tests' default), as on a machine without network."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HOME=str(cwd / "hf-home"))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    return proc, time.time() - started


def test_a_missing_data_file_is_named_before_the_model_is_looked_up(tmp_path):
    proc, _ = train_without_hub(tmp_path, *README_COMMAND)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.path: my.jsonl does not exist"), proc.stderr
    assert "Retrying" not in proc.stderr and "model.name_or_path" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.yaml"))  # nothing written


def test_a_hub_model_id_without_a_hub_is_one_line_in_seconds(tmp_path):
    (tmp_path / "my.jsonl").write_text('{"prompt": "order: ba\\n", "completion": "ab"}\n' * 20)
    proc, seconds = train_without_hub(tmp_path, *README_COMMAND)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no "Retrying in 1s [Retry 1/5]" storm, no traceback
    assert lines[0].startswith(
        "error: model.name_or_path=meta-llama/Llama-3.1-8B is a hub id and the hub (http://127.0.0.1:"
    )
    assert "model.name_or_path=/path/to/dir" in lines[0]  # how to point at a local dir instead
    assert seconds < 90  # the imports on a busy machine; today's retries alone took about a minute
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.yaml"))


@pytest.fixture
def hub_model():
    return compose_cfg("model=llama3.1-8b").model


def test_offline_mode_and_no_cached_copy_is_one_line_without_asking_the_network(hub_model, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://never.asked.invalid")
    with pytest.raises(UserError, match=r"HF_HUB_OFFLINE is set and it is not in the cache .*model.name_or_path="):
        check_hub_model(hub_model)


def test_a_cached_hub_model_loads_offline_when_the_hub_cannot_be_reached(hub_model, tmp_path, monkeypatch, caplog):
    """The HF cache holds it: no error, and this process goes offline so loading reads the cache."""
    repo = tmp_path / "cache" / "models--meta-llama--Llama-3.1-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the test, as the constant is
    started = time.time()
    check_hub_model(hub_model)
    assert time.time() - started < 10
    assert constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"
    assert any("loads from the local cache" in r.getMessage() for r in caplog.records)


def test_a_local_model_dir_is_never_probed(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://never.asked.invalid")
    check_hub_model(compose_cfg().model)  # the shipped tiny model: a local dir, nothing to ask
