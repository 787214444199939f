"""Each family people fine-tune now trains under the default stack (`model.name_or_path=DIR quant=nf4
optim=paged8bit trainer=smoke`, chat rows) and measures within [0.9, 1.1] of its plan: the peak the run
measures (process RSS on CPU) over the planned peak of the same quantity, in metrics.json. Each run is a
process of its own, as a user starts it: in a test worker an earlier test's heap would set the RSS
high-water mark (read 0.86 so)."""

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, SMOKE
from helpers_families import build_family

from qlora_recipes.families import traits

# ~20 s each on 2 cores: the Gated DeltaNet family in the default run, the others with the slow ones
FAMILIES = [
    "qwen3_5_text",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text")),
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("gpt_oss", "llama4_text", "smollm3")),
]
WORDS = ["dcba", "cab", "fed", "hgf", "ba", "ji", "lk", "onm", "qp", "tsr", "wvu", "zyx"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"order: {w}"}, {"role": "assistant", "content": "".join(sorted(w))}]}
        for w in WORDS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_measures_within_a_tenth_of_its_plan(tmp_path, chats, model_type):
    assert traits(model_type).known  # planned from its figures, not a meta model
    folder = build_family(model_type, tmp_path / model_type)
    run = tmp_path / "run"
    args = [*SMOKE, f"model.name_or_path={folder}", f"data.path={chats}", "quant=nf4", "optim=paged8bit"]
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["architecture"] == model_type
    saved = json.loads((run / "metrics.json").read_text())
    assert 0.9 <= saved["plan_ratio"] <= 1.1, saved
