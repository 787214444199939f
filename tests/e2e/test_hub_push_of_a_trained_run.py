"""A trained run's model cards and pushes: the adapter card written with the run, a merged model's card, a
hub out of reach (a closed local port) answered with one line and nothing pushed, the token written nowhere."""

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from conftest import REPO
from helpers_hub import SECRET, SMOKE_WITH_EXACT_MATCH
from helpers_hub import closed_port as _closed_port
from helpers_hub import no_absolute_path as _no_absolute_path
from omegaconf import OmegaConf

from qlora_recipes.errors import UserError
from qlora_recipes.integrations import hub


# ------------------------------------------------------------------------------------------------
# A trained run: its adapter card, a failed push of the adapter and of the merged model, the token
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The default stack trained by `train.py` (so Hydra records its overrides) with a token in the environment."""
    out = tmp_path_factory.mktemp("hub") / "run"
    env = {**os.environ, "HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *SMOKE_WITH_EXACT_MATCH, "peft.r=8", f"hydra.run.dir={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_adapter_card_is_written_with_the_run(trained):
    text = (trained / "adapter" / "README.md").read_text()
    card = huggingface_hub.ModelCard.load(trained / "adapter" / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model is None  # the tiny base is not on the hub
    metrics = json.loads((trained / "metrics.json").read_text())
    for needle in (
        "the local tiny model `assets/tiny-llama`",
        "`assets/data/order/train.jsonl`",
        "groups: `model=tiny, data=order, quant=nf4, peft=lora, optim=paged8bit",
        f"| planned peak (plan.json) | {metrics['planned_peak_gib']:.4g} |",
        f"| measured peak | {metrics['peak_mem_gib']:.4g} |",
        f"| eval loss | {metrics['eval_loss']:.4g} |",
        f"| eval exact match | {metrics['eval_exact_match']:.4g} |",
        "qlora train trainer=smoke data.metric=exact_match data.metric_examples=4 data.max_new_tokens=4 peft.r=8",
    ):
        assert needle in text, needle
    _no_absolute_path(text)


def test_failed_adapter_push_is_one_line_and_leaves_the_run_as_it_was(trained, hub_out_of_reach):
    cfg = OmegaConf.load(trained / "config.yaml")
    cfg.hub.push, cfg.hub.repo_id = True, "someone/tiny-adapter"
    before = {p: p.stat().st_size for p in (trained / "adapter").iterdir()}
    with pytest.raises(UserError, match="to someone/tiny-adapter failed, nothing was committed .*Connection refused"):
        hub.publish_adapter(cfg, trained)
    assert {p: p.stat().st_size for p in (trained / "adapter").iterdir()}.keys() == before.keys()
    card = huggingface_hub.ModelCard.load(trained / "adapter" / "README.md")
    assert card.data.model_name == "someone/tiny-adapter"  # the card names the repo it is meant for
    pushed = hub.portable_adapter_config(trained / "adapter", None)["adapter_config.json"].decode()
    assert json.loads(pushed)["base_model_name_or_path"] == "assets/tiny-llama"  # no local path leaves


@pytest.fixture(scope="module")
def merged(trained) -> dict:
    from qlora_recipes.merge.pipeline import merge

    return merge(trained, out=trained / "merged")


def test_merged_model_card_and_a_refused_push(trained, merged, hub_out_of_reach):
    from qlora_recipes.merge import export
    from qlora_recipes.merge.pipeline import merge

    text = (trained / "merged" / "README.md").read_text()
    card = huggingface_hub.ModelCard.load(trained / "merged" / "README.md")
    assert card.data.library_name == "transformers"
    for needle in (
        "## Merge",
        "merged into the dequantized 4-bit nf4 base",
        "merge quality: max |dlogit|",
        "qlora merge RUN_DIR",
    ):
        assert needle in text, needle
    _no_absolute_path(text)
    # --push-to-hub with the hub out of reach: refused before the merge starts, the earlier merge untouched
    with pytest.raises(UserError, match="--push-to-hub: cannot reach the hub"):
        merge(trained, out=trained / "merged-2", push_to_hub="someone/tiny-merged")
    assert not (trained / "merged-2").exists() and not (trained / "merged-2.partial").exists()
    with pytest.raises(UserError, match="nothing was committed"):
        export.push(trained / "merged", "someone/tiny-merged", None, None, merged, None)
    report = json.loads(export._portable_json(trained / "merged" / "merge_report.json", ("run_dir", "out_dir", "base")))
    assert not report["run_dir"].startswith("/") and report["base"] == "assets/tiny-llama"


def test_the_token_is_written_nowhere_in_the_run_dir(trained, merged):
    leaks = [p for p in trained.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaks, leaks


def test_qlora_push_of_a_run_with_the_hub_out_of_reach_is_one_line(trained):
    env = {**os.environ, "HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": _closed_port()}
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "push", str(trained), "someone/tiny-adapter", "--revision", "v1"],
        cwd=REPO,
        env={**env, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("error: qlora push: cannot reach the hub") and "\n" not in proc.stderr.strip()
    assert SECRET not in proc.stderr + proc.stdout
