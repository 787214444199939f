"""Own data: `data.path=FILE` alone. The format is detected from the rows, the eval split is
held out of that file, the metric is eval loss; the shipped sample's eval file, exact-match metric and
generation length stay with the sample (conf/data/order.yaml ties them to its path). Evaluation stays
bounded whatever the eval rows hold."""

from pathlib import Path

import pytest
import yaml
from conftest import REPO, compose_cfg
from helpers_data import GenerateRecorder, own_rows, write_jsonl

from qlora_recipes.config.loader import to_yaml
from qlora_recipes.data import load_splits

SAMPLE_TRAIN = REPO / "assets/data/order/train.jsonl"
SAMPLE_EVAL = REPO / "assets/data/order/eval.jsonl"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")


# --------------------------------------------------------------------------------------------------
# The config: the sample's settings belong to the sample
# --------------------------------------------------------------------------------------------------


def test_sample_settings_do_not_carry_over_to_own_data():
    sample = compose_cfg().data
    assert Path(sample.eval_path) == SAMPLE_EVAL and sample.metric == "exact_match" and sample.max_new_tokens == 8
    assert sample.format == "auto"  # detected: prompt/completion

    own = compose_cfg("data.path=/data/mine.jsonl").data
    assert own.eval_path is None and own.metric is None and own.max_new_tokens == 32
    assert own.format == "auto" and own.eval_fraction == 0.1  # split from the file, eval loss
    written = yaml.safe_load(to_yaml(compose_cfg("data.path=/data/mine.jsonl")))["data"]
    assert written["eval_path"] is None and written["metric"] is None  # config.yaml of the run says so

    chosen = compose_cfg("data.path=/data/mine.jsonl", "data.eval_path=/data/ev.jsonl", "data.metric=exact_match")
    assert chosen.data.eval_path == "/data/ev.jsonl" and chosen.data.metric == "exact_match"

    # the sample under another spelling of its path is still the sample
    again = compose_cfg(f"data.path={SAMPLE_TRAIN.relative_to(REPO)}").data
    assert Path(again.eval_path) == SAMPLE_EVAL and again.metric == "exact_match"
    # other data options are untouched
    assert compose_cfg("data=alpaca").data.metric is None


@pytest.mark.parametrize("fmt", ["alpaca", "prompt_completion", "messages", "sharegpt", "text"])
def test_own_file_of_each_format_is_detected_and_split(tmp_path, tok, caplog, fmt):
    """data.path alone, composed as train.py does: an alpaca file used to fail with "line 1: missing
    field 'prompt'" (the sample's format stuck); every format is now read from the rows."""
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", own_rows(fmt))
    data_cfg = compose_cfg(f"data.path={path}").data
    with caplog.at_level("INFO", logger="qlora_recipes.data"):
        train, eval_ds, stats = load_splits(data_cfg, tok, 512, 0)
    assert stats["detected"] == fmt and stats["format_from"] == "detected"
    assert stats["format"] == ("messages" if fmt == "sharegpt" else fmt)
    assert stats["rows"] == {"train": 18, "eval": 2} and len(train) + len(eval_ds) == 20
    assert stats["eval_source"] == f"0.1 of {path} (seed 0)" and stats["metric"] == "eval loss"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(lines) == 1, lines  # one line says what was detected
    assert f"{path}: {fmt} rows (detected from the fields)" in lines[0]
    assert "18 train rows, 2 eval held out (data.eval_fraction=0.1); metric: eval loss" in lines[0]


def test_eval_split_of_a_large_file_is_capped_and_says_so(tmp_path, caplog):
    """A tenth of a 200,000-row file made a final evaluation of 20,000 rows that ran for minutes,
    silently: the held-out split stops at data.eval_max_rows (2,000), the rest trains, one line says so."""
    path = write_jsonl(tmp_path / "big.jsonl", own_rows("text", 30_000))
    with caplog.at_level("INFO", logger="qlora_recipes.data"):
        train, eval_ds, stats = load_splits(compose_cfg(f"data.path={path}").data, None, 512, 0)
    assert stats["rows"] == {"train": 28_000, "eval": 2_000}
    capped = [r.getMessage() for r in caplog.records if "data.eval_max_rows" in r.getMessage()]
    assert len(capped) == 1 and "capped at data.eval_max_rows=2000 rows" in capped[0] and "hold out 3000" in capped[0]

    caplog.clear()
    with caplog.at_level("INFO", logger="qlora_recipes.data"):
        _, _, stats = load_splits(compose_cfg(f"data.path={path}", "data.eval_max_rows=null").data, None, 512, 0)
    assert stats["rows"]["eval"] == 3_000 and not any("capped" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------------
# Bounded evaluation: prompts cut to seq_len, at most max_new_tokens, whatever the eval rows hold
# --------------------------------------------------------------------------------------------------


def test_exact_match_prompts_are_cut_to_seq_len(monkeypatch, tok):
    import torch
    from transformers import AutoModelForCausalLM

    from qlora_recipes.run import metrics

    model = AutoModelForCausalLM.from_pretrained(REPO / "assets" / "tiny-llama", dtype=torch.float32)
    recorder = GenerateRecorder(monkeypatch)
    long_prompt = "q" * 100_000 + "\norder: dcba\n"
    pairs = [(long_prompt, "abcd"), ("order: ba\n", "ab"), (long_prompt, "abcd")]
    score = metrics.exact_match(model, tok, pairs, max_new_tokens=5, max_batch_tokens=16 * 64, max_prompt_tokens=64)
    assert score is not None and 0 <= score <= 1
    assert recorder.calls, "generate was not called"
    for (rows, positions), new, (_, out_positions) in recorder.calls:
        assert positions <= 64 and new == 5 and out_positions <= 64 + 5
        assert rows * (positions + new) <= 16 * 64  # the batch bound the planner counts

    # what was fed keeps the prompt's end (the task), and the BOS
    from qlora_recipes.outputs.generation import _truncate

    ids = tok(long_prompt)["input_ids"]
    (cut,), n = _truncate([ids], 64, tok.bos_token_id)
    assert n == 1 and len(cut) == 64 and cut[0] == tok.bos_token_id and cut[1:] == ids[-63:]
    assert tok.decode(cut[-13:]) == "\norder: dcba\n"

    # without max_prompt_tokens the batch bound still holds: a prompt gets what a batch leaves
    recorder.calls.clear()
    metrics.exact_match(model, tok, pairs[:1], max_new_tokens=5, max_batch_tokens=128)
    assert recorder.calls[0][0][1] <= 128 - 5
