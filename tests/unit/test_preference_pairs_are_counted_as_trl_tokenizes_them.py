"""Preference pairs: the token counts a run reports (and trainer.seq_len=auto reads) come from the ids
TRL 1.16's DPOTrainer makes of the same rows - prompt+chosen and prompt+rejected, EOS added to text
answers, the answers starting where both diverge from the tokenized prompt."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import REPO, compose_cfg

from qlora_recipes.data import load_splits
from qlora_recipes.data.tokens import token_figures, tokenization_for, tokenize_split


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-llama")


def test_pair_lengths_and_answer_starts_are_trls(tok, tmp_path):
    from trl import DPOConfig, DPOTrainer

    cfg = compose_cfg("objective=dpo")
    train, _, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    rows = train.select(range(50))
    ours = tokenize_split(rows, tok, tokenization_for(tok, "preference", False, cfg.data, "t"), "train", "t")
    lengths, starts, _ = token_figures(ours)
    args = DPOConfig(output_dir=str(tmp_path), max_length=None, use_cpu=True, report_to=[])
    theirs = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), rows, tok, args, "train")
    prompt = np.array([len(p) for p in theirs["prompt_ids"]])
    longer = prompt + np.array(
        [max(len(c), len(r)) for c, r in zip(theirs["chosen_ids"], theirs["rejected_ids"], strict=True)]
    )
    assert (starts == prompt).all() and (lengths == longer).all()
    assert stats["max_tokens"]["train"] >= lengths.max()  # the figure of all 2000 rows
