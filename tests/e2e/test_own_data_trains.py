"""Own data trains: `python train.py data.path=FILE` alone, and an eval file of 100k-character rows stays
within its bounds."""

import json
import logging
import subprocess
import sys

from conftest import REPO, compose_cfg
from helpers_data import GenerateRecorder, own_rows, words, write_jsonl


def _smoke_on(path, run_dir):
    """`python train.py data.path=PATH trainer=smoke` as a user runs it, offline; it must succeed."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"data.path={path}", "trainer=smoke", f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_python_train_py_with_only_data_path(tmp_path):
    """The case users met: a prompt/completion file trained with nothing else set used to evaluate on the
    shipped sample's eval file with its exact-match metric. Now: split from the file, eval loss."""
    path = write_jsonl(tmp_path / "pc.jsonl", own_rows("prompt_completion", 30))
    run_dir = tmp_path / "run"
    proc = _smoke_on(path, run_dir)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("data: ")]
    assert lines == [
        f"data: {path}: prompt_completion rows (detected from the fields); 27 train rows, "
        "3 eval held out (data.eval_fraction=0.1); metric: eval loss"
    ]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["eval_loss"] is not None
    assert metrics["eval_exact_match"] is None and metrics["eval_exact_match_before"] is None
    assert metrics["data"]["eval_source"] == f"0.1 of {path} (seed 0)"
    assert "order" not in json.dumps(metrics["data"])  # nothing of the sample
    assert metrics["data"]["prompt_format"] == {"style": "plain", "prefix": "sort: ", "suffix": "\n"}


# --------------------------------------------------------------------------------------------------
# Bounded evaluation: prompts cut to seq_len, at most max_new_tokens, whatever the eval rows hold
# --------------------------------------------------------------------------------------------------


def test_eval_file_with_100k_character_rows_runs_within_bounds(tmp_path, run_dir, monkeypatch):
    """A real run whose eval file holds 100k-character rows: eval loss on rows truncated to seq_len (and
    counted), exact match on prompts cut to seq_len, generating at most max_new_tokens."""
    from qlora_recipes.run.training import train

    train_path = write_jsonl(tmp_path / "train.jsonl", own_rows("prompt_completion", 16))
    long_rows = [{"prompt": "z" * 100_000 + f"\nsort: {w}\n", "completion": "".join(sorted(w))} for w in words(3)]
    eval_path = write_jsonl(tmp_path / "eval.jsonl", long_rows + own_rows("prompt_completion", 2))
    assert eval_path.stat().st_size > 300_000
    recorder = GenerateRecorder(monkeypatch)
    out = train(
        compose_cfg(
            f"data.path={train_path}",
            f"data.eval_path={eval_path}",
            "data.metric=exact_match",
            "data.max_new_tokens=6",
            "trainer=smoke",
            "trainer.eval_batch_size=1",
        ),
        run_dir,
    )
    assert out["status"] == "ok" and out["eval_loss"] is not None and out["eval_exact_match"] is not None
    data = out["data"]
    assert (
        data["over_seq_len"] == {"train": 0, "eval": 3}
        and data["truncated"]["eval"] + data["dropped_by_truncation"]["eval"] == 3
    )
    assert data["max_tokens"]["eval"] > 100_000
    assert sum(rows for (rows, _), _, _ in recorder.calls) == 2 * 5  # before and after training, every eval row
    for (_, positions), new, (_, out_positions) in recorder.calls:
        assert positions <= 64 and new == 6 and out_positions <= 64 + 6


def test_alpaca_rows_longer_than_64_tokens_train_on_the_default_without_a_seq_len(tmp_path, caplog):
    """`python train.py data.path=my.jsonl trainer=smoke` (the stack it composes, trained in this process:
    the command line with only data.path is the first test's), ordinary Alpaca rows (instruction, input,
    output): with the Alpaca template every row is over 64 tokens of the tiny model's character tokenizer,
    which used to stop the run at "raise trainer.seq_len". trainer.seq_len=auto takes the longest row,
    rounded up to a multiple of 64 within the model's 256 positions, says why, and the run trains, saves
    and plans at that length."""
    from qlora_recipes.run.training import train

    path = write_jsonl(tmp_path / "my.jsonl", own_rows("alpaca", 24))
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="qlora_recipes.planner"):
        train(compose_cfg(f"data.path={path}", "trainer=smoke"), run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    chosen = metrics["data"]["seq_len"]
    longest = metrics["data"]["max_tokens"]["train"]
    assert 64 < longest <= chosen < longest + 64 and chosen % 64 == 0 and chosen <= 256  # the model's positions
    assert min(metrics["data"]["rows"].values()) > 0 and metrics["data"]["over_seq_len"] == {"train": 0, "eval": 0}
    line = (
        f"trainer.seq_len=auto -> {chosen} (the longest tokenized train row of {path}, {longest} tokens, "
        "rounded up to a multiple of 64)"
    )
    assert line in [r.getMessage() for r in caplog.records]
    assert metrics["status"] == "ok" and metrics["steps"] == 3
    assert f"seq_len: {chosen}\n" in (run_dir / "config.yaml").read_text()
    plan = json.loads((run_dir / "plan.json").read_text())  # planned for the rows: their longest, not all chosen long
    assert plan["stack"]["seq_len"] == plan["data_longest_row"] == max(metrics["data"]["max_tokens"].values()) <= chosen
