"""What a run says about its data points the right way: preference pairs whose chosen answer is their
rejected one are counted (and, past a tenth of a split, warned about; all of them is refused in one line:
test_bad_input_gets_one_line.py), and rows longer than trainer.seq_len are told to raise it only while
the model has positions for it, else to set model.rope_scaling."""

import json

import pytest
from conftest import compose_cfg, write_jsonl

from qlora_recipes.data import load_splits
from qlora_recipes.errors import UserError


def pairs(n: int, same: int) -> list[dict]:
    """n pairs, the first `same` of them with chosen = rejected."""
    words = [f"{a}{b}" for a in "abcdefgh" for b in "ijklmnop"][:n]
    return [
        {"prompt": f"order: {w}\n", "chosen": w, "rejected": w if i < same else w[::-1]} for i, w in enumerate(words)
    ]


@pytest.mark.parametrize("same, warned", [(2, False), (5, True)])
def test_identical_pairs_are_counted_and_a_large_share_warned_about(tmp_path, tok, caplog, same, warned):
    path = write_jsonl(tmp_path / "p.jsonl", pairs(40, same))
    evals = write_jsonl(tmp_path / "e.jsonl", pairs(4, 1))
    cfg = compose_cfg("objective=dpo", f"data.path={path}", f"data.eval_path={evals}")
    with caplog.at_level("WARNING"):
        train, _, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert len(train) == 40 and stats["identical_pairs"] == {"train": same, "eval": 1}  # kept, counted
    assert (f"{same} of 40 train pairs" in caplog.text) is warned
    assert "1 of 4 eval pairs" in caplog.text  # a quarter of the eval split
    json.dumps(stats)  # metrics.json takes it


def test_rows_other_than_pairs_count_no_identical_pairs(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "order: ba\n", "completion": "ab"}] * 4)
    cfg = compose_cfg(f"data.path={path}", "data.eval_fraction=0")
    assert load_splits(cfg.data, tok, 64, 0, cfg.objective)[2]["identical_pairs"] is None


def _long_prompts(tmp_path):
    rows = [{"prompt": "order: " + "ab" * 40, "answer": "a"}] * 2 + [{"prompt": "order: ab", "answer": "ab"}] * 2
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    return compose_cfg("objective=grpo", f"data.path={path}", "data.eval_fraction=0")


def test_prompts_past_a_seq_len_with_room_left_are_told_to_raise_it(tmp_path, tok, caplog):
    cfg = _long_prompts(tmp_path)
    with caplog.at_level("WARNING"):
        load_splits(cfg.data, tok, 64, 0, cfg.objective, positions=256)
    assert "raise trainer.seq_len to keep them" in caplog.text and "rope_scaling" not in caplog.text


def test_prompts_past_a_seq_len_that_fills_the_positions_are_told_of_rope_scaling(tmp_path, tok, caplog):
    cfg = _long_prompts(tmp_path)
    with caplog.at_level("WARNING"):
        load_splits(cfg.data, tok, 64, 0, cfg.objective, positions=72)  # 64 + 8 completion tokens: all of them
    assert "raise trainer.seq_len" not in caplog.text
    assert "model.rope_scaling={rope_type:linear,factor:F}" in caplog.text
    assert "trainer.seq_len=64 + objective.max_completion_length=8 already fill its 72" in caplog.text


def test_sft_rows_past_a_seq_len_at_the_positions_are_told_of_rope_scaling(tmp_path, tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "order: " + "ab" * 40, "completion": "ab"}] * 2)
    cfg = compose_cfg(f"data.path={path}", "data.eval_fraction=0")
    with pytest.raises(UserError, match=r"nothing to train on; set model.rope_scaling=.*trainer.seq_len=64 already"):
        load_splits(cfg.data, tok, 64, 0, cfg.objective, positions=64)
