"""Model cards and pushes to the Hugging Face Hub, before any training: the card's contents, no local
path in it, no config key for a token, and a hub out of reach (a closed local port) answered with one line and nothing pushed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from conftest import REPO, compose_cfg
from helpers_hub import SECRET, SMOKE_WITH_EXACT_MATCH
from helpers_hub import closed_port as _closed_port
from helpers_hub import no_absolute_path as _no_absolute_path
from omegaconf import OmegaConf

from qlora_recipes.errors import UserError
from qlora_recipes.integrations import hub, modelcard


def _fake_run(run_dir: Path, *overrides: str, metrics: dict | None = None) -> Path:
    """A run dir as train writes it (config.yaml, metrics.json, .hydra/overrides.yaml), without training."""
    cfg = compose_cfg(*overrides)
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(list(overrides)))
    (run_dir / "metrics.json").write_text(json.dumps(metrics or {}))
    return run_dir


# ------------------------------------------------------------------------------------------------
# The card: the base model by its hub id, never by a path; data, stack, memory, results, command
# ------------------------------------------------------------------------------------------------
def test_base_model_is_named_by_its_hub_id_never_a_local_path(tmp_path):
    assert modelcard.base_model(compose_cfg("model=llama3.1-8b").model)[0] == "meta-llama/Llama-3.1-8B"
    tiny_id, tiny_text = modelcard.base_model(compose_cfg().model)
    assert tiny_id is None and "`assets/tiny-llama`" in tiny_text and "local tiny model" in tiny_text
    local = tmp_path / "my-base"  # a local copy of a hub model: its config.json remembers the hub id
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "org/base-7b", "model_type": "llama"}))
    model = OmegaConf.create({"name_or_path": str(local), "hub_id": None})
    assert modelcard.base_model(model)[0] == "org/base-7b"
    (local / "config.json").write_text(json.dumps({"_name_or_path": str(local), "model_type": "llama"}))
    unknown_id, unknown_text = modelcard.base_model(model)
    assert unknown_id is None and "`my-base`" in unknown_text and str(tmp_path) not in unknown_text


def test_card_of_a_hub_base_names_base_dataset_stack_memory_results_and_command(tmp_path):
    metrics = {
        "eval_loss": 1.25,
        "eval_perplexity": 3.49,
        "eval_exact_match_before": 0.1,
        "eval_exact_match": 0.9,
        "planned_peak_gib": 7.5,
        "peak_mem_gib": 7.1,
        "plan_ratio": 0.947,
        "peak_quantity": "cuda max_memory_allocated",
        "device": "NVIDIA H100",
        "steps": 100,
        "data": {"rows": {"train": 51000, "eval": 520}, "format": "alpaca"},
    }
    overrides = ("model=llama3.1-8b", "data=alpaca", "peft.r=64", f"data.eval_path={tmp_path}/held.jsonl")
    run_dir = _fake_run(tmp_path / "2026-01-31" / "12-00-00", *overrides, metrics=metrics)
    card = modelcard.run_card(run_dir, "adapter", repo_id="someone/llama-alpaca-qlora")
    text = str(card)
    assert card.data.base_model == "meta-llama/Llama-3.1-8B" and card.data.library_name == "peft"
    assert card.data.datasets == ["tatsu-lab/alpaca"]
    assert "base_model:adapter:meta-llama/Llama-3.1-8B" in card.data.tags
    for needle in (
        "# someone/llama-alpaca-qlora",
        "r 64, alpha",  # the stack's keys
        "nf4 (double quant True",
        "| planned peak (plan.json) | 7.5 |",
        "| measured peak | 7.1 |",
        "| eval loss | 1.25 |",
        "| eval exact match | 0.9 |",
        "qlora train model=llama3.1-8b data=alpaca peft.r=64 data.eval_path=held.jsonl",  # paths shortened
        "AutoPeftModelForCausalLM as Auto",
    ):
        assert needle in text, needle
    _no_absolute_path(text)
    assert {r.metric_type for r in card.data.eval_results} == {"loss", "exact_match"}


# ------------------------------------------------------------------------------------------------
# Checks before any work: repo id, offline, token, the hub in reach
# ------------------------------------------------------------------------------------------------
def test_push_checks_fail_fast_with_one_line(monkeypatch, tmp_path, hub_out_of_reach):
    with pytest.raises(UserError, match="hub.push=true needs hub.repo_id=USER/NAME"):
        hub.check_push(None, None)
    with pytest.raises(UserError, match="is not a hub repo id"):
        hub.check_push("not a repo//id", None)
    with pytest.raises(UserError, match="cannot reach the hub at http://127.0.0.1"):
        hub.check_push("someone/model", None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE=1"):
        hub.check_push("someone/model", None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with pytest.raises(
        UserError, match="needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login`"
    ):
        hub.check_push("someone/model", None)


def test_config_has_no_key_for_a_token():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="hub.token"):
        compose_cfg("hub.push=true", "hub.repo_id=a/b", "hub.token=abc")


def test_train_with_the_hub_out_of_reach_stops_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": _closed_port()}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            *SMOKE_WITH_EXACT_MATCH,
            "hub.push=true",
            "hub.repo_id=someone/tiny",
            f"hydra.run.dir={out}",
        ],
        cwd=REPO,
        env={**env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "cannot reach the hub" in errors[0] and SECRET not in proc.stderr + proc.stdout
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# Progress: huggingface_hub's own upload bars stay on for `qlora push` (our quiet setup keeps them)
# ------------------------------------------------------------------------------------------------
# The hub's network calls answered in the process (the only stand-in here); the rest is the real command.
# It records, at the commit, whether huggingface_hub's bars are on and transformers' loading bars off.
PUSH_RECORDING = """
import json, sys
from types import SimpleNamespace
from qlora_recipes.integrations import hub
from qlora_recipes.cli import push

quiet = hub.quiet_but_upload_progress

def setup(level):
    quiet(level)  # what the command runs, before huggingface_hub is imported
    from huggingface_hub import HfApi
    from huggingface_hub.utils import are_progress_bars_disabled, tqdm
    from transformers.utils import logging as hf_logging  # imported after the setup, as merge does

    def commit(self, repo_id, operations, **kwargs):
        with tqdm(total=1, name="huggingface_hub.lfs_upload") as bar:
            upload_bar = not bar.disable
        state = {"hub_bars": not are_progress_bars_disabled(), "upload_bar": upload_bar,
                 "files": sorted(op.path_in_repo for op in operations),
                 "transformers_bars": hf_logging.is_progress_bar_enabled()}
        print("STATE " + json.dumps(state), flush=True)
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    HfApi.whoami = lambda self, *a, **k: {"name": "someone"}
    HfApi.create_repo = lambda self, *a, **k: None
    HfApi.create_commit = commit

hub.quiet_but_upload_progress = setup
push.run(sys.argv[1:])
"""


@pytest.mark.parametrize("user_env,bars", [({}, True), ({"HF_HUB_DISABLE_PROGRESS_BARS": "1"}, False)])
def test_qlora_push_keeps_the_hubs_upload_progress_bars(tmp_path, user_env, bars):
    import shutil

    model = tmp_path / "merged"
    shutil.copytree(REPO / "assets" / "tiny-llama", model)  # a merged dir: config.json + model.safetensors
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    env.update(HF_TOKEN=SECRET, HF_HUB_OFFLINE="0", PYTHONWARNINGS="ignore", **user_env)
    proc = subprocess.run(
        [sys.executable, "-c", PUSH_RECORDING, str(model), "someone/tiny-merged"],  # qlora push DIR REPO
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    state = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("STATE "))[6:])
    assert state["hub_bars"] is bars and state["upload_bar"] is bars  # a user's HF_HUB_DISABLE_PROGRESS_BARS=1 wins
    assert state["transformers_bars"] is False  # the loading bars stay quiet, as quiet_libraries meant
    assert "model.safetensors" in state["files"]
    assert "pushed the merged model to https://huggingface.co/someone/tiny-merged/commit/0" in proc.stdout


def test_upload_progress_turns_the_hubs_bars_on_for_the_push_only(monkeypatch):
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    disable_progress_bars()
    try:
        with hub.upload_progress():
            assert not are_progress_bars_disabled()
        assert are_progress_bars_disabled()  # as they were: the loading bars stay quiet afterwards
    finally:
        enable_progress_bars()
