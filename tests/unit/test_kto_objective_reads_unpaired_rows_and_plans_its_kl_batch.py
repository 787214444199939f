"""objective=kto: its keys and sample, the rows it reads (unpaired prompt/completion/label rows detected
from the rows alone, preference pairs split into a desirable and an undesirable row, a bad row or the
wrong kind of rows one line), the KTOConfig it builds and the memory it plans (the reference's forward
and the KL batch's no_grad forward)."""

import json
from pathlib import Path

import pytest
from conftest import REPO, compose_cfg, write_jsonl

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.config.checks import check_stack
from qlora_recipes.config.objectives import OBJECTIVES
from qlora_recipes.data import load_splits
from qlora_recipes.data.formats import generation_pairs
from qlora_recipes.errors import UserError
from qlora_recipes.run import trainer_args

ROWS = REPO / "assets/data/order/kto"


def test_kto_picks_its_sample_and_keys():
    kto = compose_cfg("objective=kto")
    o = kto.objective
    assert (o.beta, o.desirable_weight, o.undesirable_weight, o.precompute_ref_log_probs) == (0.1, 1.0, 1.0, False)
    assert o.loss_type is None  # dpo's
    assert Path(kto.data.path) == ROWS / "train.jsonl" and Path(kto.data.eval_path) == ROWS / "eval.jsonl"
    assert kto.data.metric == "exact_match"  # the desirable completions are the references
    assert kto.trainer.micro_batch_size >= 2
    check_stack(kto)


def test_kto_keys_are_checked_against_the_objective():
    with pytest.raises(
        UserError, match=r"objective.desirable_weight=2.0 only applies to objective=kto, not objective=dpo"
    ):
        check_stack(compose_cfg("objective=dpo", "+objective.desirable_weight=2.0"))
    with pytest.raises(UserError, match=r"objective.loss_type=ipo only applies to objective=dpo, not objective=kto"):
        check_stack(compose_cfg("objective=kto", "objective.loss_type=ipo"))
    with pytest.raises(UserError, match=r"objective=kto needs objective.undesirable_weight"):
        check_stack(compose_cfg("objective=kto", "objective.undesirable_weight=null"))
    with pytest.raises(UserError, match=r"trainer.micro_batch_size=1 is too small for objective=kto: its KL estimate"):
        check_stack(compose_cfg("objective=kto", "trainer.micro_batch_size=1"))


def test_kto_config_carries_the_objective_and_the_shared_groups(tmp_path):
    cfg = compose_cfg("objective=kto", "objective.beta=0.3", "objective.desirable_weight=1.5", "trainer.seq_len=64")
    args = trainer_args.trainer_config(cfg, tmp_path, "unpaired", on_gpu=False, has_eval=True)
    assert type(args).__name__ == OBJECTIVES["kto"].args
    assert (args.beta, args.desirable_weight, args.undesirable_weight) == (0.3, 1.5, 1.0)
    assert (args.loss_type, args.max_length, args.learning_rate, args.optim) == (
        "kto",
        64,
        cfg.optim.lr,
        cfg.optim.name,
    )
    assert args.precompute_ref_log_probs is False and args.train_sampling_strategy == "sequential"


def test_the_shipped_rows_are_the_preference_pairs_unpaired_and_shuffled():
    for split in ("train", "eval"):
        pairs = [json.loads(x) for x in (REPO / f"assets/data/order/preference/{split}.jsonl").read_text().splitlines()]
        rows = [json.loads(x) for x in (ROWS / f"{split}.jsonl").read_text().splitlines()]
        unpaired = [(p["prompt"], p[k], k == "chosen") for p in pairs for k in ("chosen", "rejected")]
        assert sorted((r["prompt"], r["completion"], r["label"]) for r in rows) == sorted(unpaired)
        first = [r["label"] for r in rows[:16]]
        assert 4 <= sum(first) <= 12  # a micro-batch holds both labels


CHAT = [{"role": "user", "content": "order: cab"}]
LAYOUTS = {
    "text": [
        {"prompt": "order: cab\n", "completion": "abc", "label": True},
        {"prompt": "order: cab\n", "completion": "cab", "label": False},
    ],
    "messages": [
        {"prompt": CHAT, "completion": [{"role": "assistant", "content": "abc"}], "label": True},
        {"prompt": CHAT, "completion": [{"role": "assistant", "content": "cab"}], "label": False},
    ],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpaired_rows_are_detected_from_the_rows_alone(tmp_path, tok, layout):
    path = write_jsonl(tmp_path / "rows.jsonl", LAYOUTS[layout] * 4)
    cfg = compose_cfg("objective=kto", f"data.path={path}", "data.eval_fraction=0.25")
    train, eval_ds, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert stats["format"] == stats["detected"] == "unpaired" and stats["conversational"] == (layout == "messages")
    assert set(train.column_names) == {"prompt", "completion", "label"}  # KTOTrainer tokenizes the text
    assert sorted([*train["label"], *eval_ds["label"]]) == [False] * 4 + [True] * 4
    assert stats["max_tokens"]["train"] > 0
    references = [answer for _, answer in generation_pairs(eval_ds, "unpaired", None)]
    assert references and set(references) == {"abc"}  # only desirable rows are references


def test_preference_pairs_train_kto_as_two_rows_each(tok):
    cfg = compose_cfg("objective=kto", "data.path=" + str(REPO / "assets/data/order/preference/train.jsonl"))
    train, eval_ds, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert stats["detected"] == "preference" and stats["format"] == "unpaired"
    assert set(train.column_names) == {"prompt", "completion", "label"}
    assert len(train) + len(eval_ds) == 2 * 2000 and sum(list(train["label"])) * 2 == len(train)
    assert 4 <= sum(list(train["label"])[:16]) <= 12  # shuffled: not all desirable rows first


@pytest.mark.parametrize(
    "row, match",
    [
        ({"prompt": "order: ba\n", "completion": "ab"}, r"cannot detect|missing field 'label'"),
        ({"prompt": "order: ba\n", "completion": "ab", "label": "yes"}, r"field 'label' must be true .* got str 'yes'"),
        ({"prompt": "order: ba\n", "completion": "ab", "label": 1}, r"field 'label' must be true .* got int 1"),
        ({"prompt": "order: ba\n", "label": True}, r"missing field 'completion'"),
    ],
)
def test_a_bad_unpaired_row_names_file_row_and_field(tmp_path, tok, row, match):
    path = write_jsonl(tmp_path / "rows.jsonl", [LAYOUTS["text"][0], row])
    cfg = compose_cfg("objective=kto", f"data.path={path}", "data.eval_fraction=0")
    with pytest.raises(UserError, match=r"rows.jsonl.*line 2: " + match):
        load_splits(cfg.data, tok, 64, 0, cfg.objective)


def test_rows_of_another_objective_are_one_line(tok):
    kto = compose_cfg("objective=kto")
    with pytest.raises(UserError, match=r"objective=kto trains on unpaired rows .* holds prompt_completion rows"):
        load_splits(compose_cfg().data, tok, 64, 0, kto.objective)
    for other in ("sft", "dpo"):
        with pytest.raises(UserError, match=rf"holds unpaired rows .* objective={other} does not train on; .*kto"):
            load_splits(kto.data, tok, 64, 0, compose_cfg(f"objective={other}").objective)


def _plan(*overrides):
    cfg = compose_cfg("recipe=llama3.1-8b-24gb", *overrides)
    return planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))


def test_kto_plans_the_reference_forward_and_the_kl_batch():
    sft, kto = _plan("peft.dropout=0"), _plan("objective=kto")  # TRL's KTOConfig turns dropout off
    pre = _plan("objective=kto", "objective.precompute_ref_log_probs=true")
    gpu = "cuda:0"
    assert kto["components"]["reference_forward"][gpu] > 0 and "reference_forward" not in sft["components"]
    assert kto["components"]["kl_forward"][gpu] > 0 and "kl_forward" not in sft["components"]
    # one sequence per row, as SFT: the same activations; at 8B on 24 GB the backward still sets the peak
    assert kto["components"]["activations"][gpu] == sft["components"]["activations"][gpu]
    assert kto["devices"][0]["peak_phase"] == "train: layer backward" and kto["peak_gib"] == sft["peak_gib"]
    assert "reference_forward" not in pre["components"] and pre["components"]["kl_forward"][gpu] > 0


def test_no_ladder_rung_leaves_kto_a_micro_batch_of_one():
    from qlora_recipes.run.lifecycle import next_in_process_rung

    def micro_batches(*overrides):
        rungs = _plan("trainer.micro_batch_size=4", "trainer.seq_len=16384", *overrides)["ladder"]
        return [int(w.split("=")[1]) for r in rungs for w in r["overrides"].split() if "micro_batch" in w]

    assert set(micro_batches()) == {1} and set(micro_batches("objective=kto")) == {
        2
    }  # SFT's rung goes to 1, KTO's to 2
    cfg = compose_cfg("objective=kto", "trainer.micro_batch_size=2", "trainer.gradient_checkpointing=false")
    assert next_in_process_rung(cfg)[1] == "trainer.gradient_checkpointing=true"
    assert next_in_process_rung(compose_cfg("objective=kto", "trainer.micro_batch_size=4"))[1].startswith(
        "trainer.micro_batch_size=2 "
    )
    assert next_in_process_rung(compose_cfg("trainer.micro_batch_size=2"))[1].startswith("trainer.micro_batch_size=1 ")
