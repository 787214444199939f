"""A context past the tiny model's 256 native positions trains with model.rope_scaling: rows of ~400
tokens at trainer.seq_len=512, linear scaling by 2."""

import math

from conftest import train_smoke
from helpers_data import words, write_jsonl


def test_rows_past_the_native_positions_train_with_rope_scaling(tmp_path):
    rows = [{"prompt": "sort: " + " ".join(words(80)) + "\n", "completion": "done"} for _ in range(8)]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    metrics, _ = train_smoke(
        tmp_path / "run",
        f"data.path={data}",
        "model.rope_scaling={rope_type:linear,factor:2.0}",
        "trainer.seq_len=512",
        "data.eval_fraction=0",
        "data.eval_path=null",
    )
    assert metrics["status"] == "ok" and math.isfinite(metrics["train_loss_last"])
    assert metrics["data"]["max_tokens"]["train"] > 256  # rows past the native positions, trained whole
    assert metrics["data"]["over_seq_len"]["train"] == 0
