"""The `objective` group: sft (the default, unchanged) and dpo. What the name picks - its keys, its
sample, the rows it reads (preference pairs detected from the rows alone, a bad row or the wrong kind of
rows one line) and the memory it plans (chosen and rejected per example, the reference's forward)."""

import json
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg, write_jsonl

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.config.checks import check_stack
from qlora_recipes.config.objectives import OBJECTIVES
from qlora_recipes.data import load_splits
from qlora_recipes.errors import UserError
from qlora_recipes.run import trainer_args
from qlora_recipes.units import GiB

PAIRS = REPO / "assets/data/order/preference"


def test_sft_is_the_default_and_dpo_picks_its_sample_and_keys():
    sft = compose_cfg()
    assert sft.objective.name == "sft" and sft.objective.beta is None
    assert Path(sft.data.path) == REPO / "assets/data/order/train.jsonl"
    dpo = compose_cfg("objective=dpo")
    assert (dpo.objective.beta, dpo.objective.loss_type, dpo.objective.precompute_ref_log_probs) == (
        0.1,
        "sigmoid",
        False,
    )
    assert Path(dpo.data.path) == PAIRS / "train.jsonl" and Path(dpo.data.eval_path) == PAIRS / "eval.jsonl"
    assert dpo.data.metric == "exact_match"  # the chosen answer is the reference
    own = compose_cfg("objective=dpo", "data.path=/data/pairs.jsonl").data
    assert own.eval_path is None and own.metric is None


def test_a_key_of_another_objective_is_one_line():
    with pytest.raises(UserError, match=r"objective.beta=0.5 only applies to objective=dpo, not objective=sft"):
        check_stack(compose_cfg("objective.beta=0.5"))
    with pytest.raises(UserError, match=r"objective=dpo needs objective.beta"):
        check_stack(compose_cfg("objective=dpo", "objective.beta=null"))


def test_dpo_config_carries_the_objective_and_the_shared_groups(tmp_path):
    cfg = compose_cfg("objective=dpo", "objective.beta=0.3", "objective.loss_type=ipo", "trainer.seq_len=64")
    args = trainer_args.trainer_config(cfg, tmp_path, "preference", on_gpu=False, has_eval=True)
    assert type(args).__name__ == OBJECTIVES["dpo"].args
    assert (args.beta, args.loss_type, args.max_length, args.learning_rate) == (0.3, ["ipo"], 64, cfg.optim.lr)
    assert args.optim == cfg.optim.name and args.precompute_ref_log_probs is False


def test_an_sft_weight_adds_trls_sft_loss_on_the_chosen_answers(tmp_path):
    cfg = compose_cfg("objective=dpo", "objective.sft_weight=0.5", "trainer.seq_len=64")
    args = trainer_args.trainer_config(cfg, tmp_path, "preference", on_gpu=False, has_eval=True)
    assert (args.loss_type, args.loss_weights) == (["sigmoid", "sft"], [1.0, 0.5])
    plain = trainer_args.trainer_config(compose_cfg("objective=dpo"), tmp_path, "preference", False, True)
    assert (plain.loss_type, plain.loss_weights) == (["sigmoid"], None)


def test_the_shipped_pairs_prefer_the_sorted_string():
    for split in ("train", "eval"):
        for line in (PAIRS / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            s = row["prompt"].removeprefix("order: ").rstrip("\n")
            assert row["chosen"] == "".join(sorted(s)) != row["rejected"]
            assert sorted(row["rejected"]) == sorted(s)  # a plausible wrong answer: the same letters
    sft = [json.loads(x)["prompt"] for x in (REPO / "assets/data/order/eval.jsonl").read_text().splitlines()]
    assert sft == [json.loads(x)["prompt"] for x in (PAIRS / "eval.jsonl").read_text().splitlines()]


CHAT = [{"role": "user", "content": "order: cab"}]
LAYOUTS = {
    "text": {"prompt": "order: cab\n", "chosen": "abc", "rejected": "cab"},
    "messages": {
        "prompt": CHAT,
        "chosen": [{"role": "assistant", "content": "abc"}],
        "rejected": [{"role": "assistant", "content": "cab"}],
    },
    "implicit prompt": {
        "chosen": [*CHAT, {"role": "assistant", "content": "abc"}],
        "rejected": [*CHAT, {"role": "assistant", "content": "cab"}],
    },
    "ultrafeedback-binarized": {
        "prompt": "order: cab",
        "prompt_id": "0",
        "chosen": [*CHAT, {"role": "assistant", "content": "abc"}],
        "rejected": [*CHAT, {"role": "assistant", "content": "cab"}],
        "messages": [*CHAT, {"role": "assistant", "content": "abc"}],
        "score_chosen": 9.0,
        "score_rejected": 2.0,
    },
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preference_rows_are_detected_from_the_rows_alone(tmp_path, tok, layout):
    path = write_jsonl(tmp_path / "pairs.jsonl", [LAYOUTS[layout]] * 4)
    cfg = compose_cfg("objective=dpo", f"data.path={path}", "data.eval_fraction=0.25")
    train, _, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert stats["format"] == "preference" and stats["conversational"] == (layout != "text")
    row = train[0]
    assert set(train.column_names) == {"prompt", "chosen", "rejected"}
    if layout == "text":
        assert row == LAYOUTS["text"]
    else:  # TRL's conversational pairs: the prompt's turns, then each answer's
        assert row["prompt"] == CHAT and row["chosen"][0]["content"] == "abc" and row["rejected"][0]["content"] == "cab"
    assert stats["max_tokens"]["train"] > 0


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_pairs_in_a_saved_or_hub_dataset_keep_their_answers_and_leave_other_columns(tmp_path, tok, objective):
    """A hub dataset is read as a saved one is (readers._rows_from_dataset): the pair's fields come with
    the rows, the columns no format reads (here an image's bytes) stay unread."""
    from datasets import Dataset

    row = {**LAYOUTS["ultrafeedback-binarized"], "image": {"bytes": b"\x89PNG", "path": None}}
    Dataset.from_list([row] * 4).save_to_disk(str(tmp_path / "saved"))
    cfg = compose_cfg(f"objective={objective}", f"data.path={tmp_path / 'saved'}", "data.eval_fraction=0.25")
    train, _, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert stats["detected"] == "preference" and stats["rows"]["train"] == (3 if objective == "dpo" else 6)
    assert "image" not in train.column_names


def test_a_bad_pair_names_file_row_and_field(tmp_path, tok):
    path = write_jsonl(tmp_path / "pairs.jsonl", [LAYOUTS["text"], {"prompt": "order: ba\n", "chosen": "ab"}])
    cfg = compose_cfg("objective=dpo", f"data.path={path}", "data.eval_fraction=0")
    with pytest.raises(UserError, match=r"pairs.jsonl.*line 2: missing field 'rejected'"):
        load_splits(cfg.data, tok, 64, 0, cfg.objective)
    same = [{"chosen": LAYOUTS["implicit prompt"]["chosen"], "rejected": LAYOUTS["implicit prompt"]["chosen"]}]
    path = write_jsonl(tmp_path / "same.jsonl", same)
    with pytest.raises(UserError, match=r"same.jsonl.*line 1: fields 'chosen' and 'rejected' are the same answer"):
        load_splits(
            compose_cfg("objective=dpo", f"data.path={path}", "data.eval_fraction=0").data, tok, 64, 0, cfg.objective
        )


def test_rows_of_the_other_objective_are_one_line(tok):
    dpo = compose_cfg("objective=dpo")
    sft_rows = compose_cfg().data
    with pytest.raises(UserError, match=r"objective=dpo trains on preference pairs .* holds prompt_completion rows"):
        load_splits(sft_rows, tok, 64, 0, dpo.objective)
    with pytest.raises(UserError, match=r"holds preference pairs .* which objective=sft does not train on"):
        load_splits(dpo.data, tok, 64, 0, compose_cfg().objective)


def _plan(*overrides):
    cfg = compose_cfg("recipe=llama3.1-8b-24gb", *overrides)
    return planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))


def test_dpo_plans_both_answers_and_the_reference_forward():
    sft, dpo, pre = _plan(), _plan("objective=dpo"), _plan("objective=dpo", "objective.precompute_ref_log_probs=true")
    assert dpo["peak_gib"] > sft["peak_gib"] + 1  # twice the sequences per micro-batch
    gpu = "cuda:0"
    assert dpo["components"]["activations"][gpu] >= 1.9 * sft["components"]["activations"][gpu]
    assert dpo["components"]["reference_forward"][gpu] > 0 and "reference_forward" not in sft["components"]
    assert "reference_forward" not in pre["components"]  # scored once before training, an eval-sized pass
    assert pre["devices"][0]["peak"] <= dpo["devices"][0]["peak"]
    assert sft["devices"][0]["peak"] / GiB == pytest.approx(13.22, abs=0.05)  # the recipe's header, unchanged
