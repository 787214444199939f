"""objective=grpo: its keys and sample, the prompt rows it reads (detected from the rows alone, a bad
row one line), its rewards (built-ins, the user's own module:function, each checked against the rows'
columns before training) and the memory it plans (the sampling phase, the fused head over the
completions, a reference forward only when beta > 0)."""

import importlib.util
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
from qlora_recipes.run import rewards, trainer_args
from qlora_recipes.units import GiB

PROMPTS = REPO / "assets/data/order/grpo"


def test_grpo_picks_its_sample_and_keys():
    cfg = compose_cfg("objective=grpo")
    o = cfg.objective
    assert (o.beta, o.num_generations, o.max_completion_length, o.temperature) == (0.0, 4, 8, 1.0)
    assert list(o.rewards) == ["char_match", "exact_match"]
    assert Path(cfg.data.path) == PROMPTS / "train.jsonl" and Path(cfg.data.eval_path) == PROMPTS / "eval.jsonl"
    assert cfg.data.metric == "exact_match"  # the answer column is the reference
    assert (cfg.trainer.micro_batch_size, cfg.trainer.max_steps) == (32, 40)
    check_stack(cfg)


def test_the_shipped_prompts_answer_with_the_sorted_string():
    for split in ("train", "eval"):
        rows = [json.loads(x) for x in (PROMPTS / f"{split}.jsonl").read_text().splitlines()]
        sft = [json.loads(x) for x in (REPO / f"assets/data/order/{split}.jsonl").read_text().splitlines()]
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in sft]
        for row in rows:
            assert row["answer"] == "".join(sorted(row["prompt"].removeprefix("order: ").rstrip("\n")))


def test_grpo_config_carries_the_generation_keys_and_the_shared_groups(tmp_path):
    cfg = compose_cfg("objective=grpo", "objective.beta=0.04", "objective.temperature=0.7", "trainer.seq_len=64")
    args = trainer_args.trainer_config(cfg, tmp_path, "prompt", on_gpu=False, has_eval=True)
    assert type(args).__name__ == OBJECTIVES["grpo"].args
    assert (args.beta, args.num_generations, args.max_completion_length, args.temperature) == (0.04, 4, 8, 0.7)
    assert args.generation_batch_size == 32 and args.learning_rate == cfg.optim.lr
    assert args.eval_strategy == "no"  # TRL would sample num_generations per eval prompt; exact match measures it


CHAT = [{"role": "user", "content": "order: cab"}]


@pytest.mark.parametrize("layout", ["text", "messages"])
def test_prompt_rows_are_detected_from_the_rows_alone(tmp_path, tok, layout):
    prompt = "order: cab\n" if layout == "text" else CHAT
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": prompt, "answer": "abc", "level": 1}] * 4)
    cfg = compose_cfg("objective=grpo", f"data.path={path}", "data.eval_fraction=0.25")
    train, _, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert stats["format"] == "prompt" and stats["conversational"] == (layout == "messages")
    assert set(train.column_names) == {"prompt", "answer", "level"}  # the columns rewards may read
    assert train[0]["prompt"] == prompt and train[0]["answer"] == "abc"


def test_prompt_rows_of_a_saved_or_hub_dataset_keep_their_text_and_number_columns(tmp_path, tok):
    """TRL's GRPO datasets (trl-lib/DeepMath-103K: `prompt` messages and a `solution` text) read from a
    saved copy as from the hub: the reference column comes with the rows, an image column does not."""
    from datasets import Dataset

    row = {"prompt": CHAT, "solution": "abc", "difficulty": 2.5, "image": {"bytes": b"\x89PNG", "path": None}}
    Dataset.from_list([row] * 4).save_to_disk(str(tmp_path / "saved"))
    cfg = compose_cfg("objective=grpo", f"data.path={tmp_path / 'saved'}", "data.eval_fraction=0")
    train, _, stats = load_splits(cfg.data, tok, 64, 0, cfg.objective)
    assert stats["format"] == "prompt" and set(train.column_names) == {"prompt", "solution", "difficulty"}


def test_prompts_longer_than_seq_len_are_dropped_never_cut(tmp_path, tok):
    """TRL's GRPOTrainer samples from a prompt whole: cut, it would ask something else; kept, it would
    outgrow the plan (seq_len is the prompt's bound). So such rows go, whatever data.too_long says."""
    rows = [{"prompt": "order: cab\n", "answer": "abc"}] * 3 + [{"prompt": "order: " + "z" * 200, "answer": "z"}]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = compose_cfg("objective=grpo", f"data.path={path}", "data.eval_fraction=0")
    train, _, stats = load_splits(cfg.data, tok, 32, 0, cfg.objective)
    assert len(train) == 3 and stats["dropped_too_long"]["train"] == 1 and stats["too_long"] == "drop"
    only_long = write_jsonl(tmp_path / "long.jsonl", rows[-1:] * 2)
    with pytest.raises(
        UserError, match=r"longer than 32 tokens .* raise trainer.seq_len \(prompts are never truncated\)"
    ):
        load_splits(
            compose_cfg("objective=grpo", f"data.path={only_long}", "data.eval_fraction=0").data,
            tok,
            32,
            0,
            cfg.objective,
        )


def test_prompt_rows_under_another_objective_and_other_rows_under_grpo_are_one_line(tok):
    grpo = compose_cfg("objective=grpo")
    with pytest.raises(UserError, match=r"objective=grpo trains on prompt rows .* holds prompt_completion rows"):
        load_splits(compose_cfg().data, tok, 64, 0, grpo.objective)
    with pytest.raises(UserError, match=r"prompt rows without an answer .* objective=sft does not train on"):
        load_splits(grpo.data, tok, 64, 0, compose_cfg().objective)


def test_built_in_rewards_score_against_the_answer_column():
    completions, answer = ["abc", " abc\n", "acb", "xyz", "ab\nc"], ["abc"] * 5
    assert rewards.exact_match(completions, answer) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert rewards.char_match(completions, answer) == pytest.approx([1.0, 1.0, 1 / 3, 0.0, 0.5])
    assert rewards.one_line(completions) == [1.0, 1.0, 1.0, 1.0, 0.0]
    chat = [[{"role": "assistant", "content": "abc"}]]
    assert rewards.exact_match(chat, ["abc"]) == [1.0]  # chat completions are message lists


def _reward_cfg(*names, data="assets/data/order/grpo/train.jsonl"):
    return compose_cfg("objective=grpo", f"objective.rewards=[{','.join(names)}]", f"data.path={REPO / data}")


def test_a_users_reward_is_imported_by_name_and_its_columns_checked(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_rewards.py").write_text(
        "def short(completions, **kw):\n    return [-len(c) for c in completions]\n\n"
        "def by_level(completions, level, **kw):\n    return [float(x) for x in level]\n"
    )
    monkeypatch.syspath_prepend(str(code))
    funcs = rewards.reward_functions(_reward_cfg("my_rewards:short", "exact_match"), ("answer",))
    assert funcs[0](prompts=["x", "y"], completions=["ab", "abc"]) == [-2, -3] and funcs[1].func is rewards.exact_match
    with pytest.raises(UserError, match=r"my_rewards:by_level reads the column 'level', which .* lack .*answer"):
        rewards.reward_functions(_reward_cfg("my_rewards:by_level"), ("answer",))
    with pytest.raises(UserError, match=r"my_rewards:missing: module 'my_rewards' .* has no function 'missing'"):
        rewards.reward_functions(_reward_cfg("my_rewards:missing"), ("answer",))
    with pytest.raises(UserError, match=r"exact_match reads the column 'answer', .* lack \(their columns: hint\)"):
        rewards.reward_functions(_reward_cfg("exact_match"), ("hint",))


def test_trls_accuracy_reward_is_named_like_a_users_and_reads_the_solution_column(monkeypatch):
    """The GRPO recipe's reward: TRL's own, math-verify comparing LaTeX answers (a boxed 1/3 is \\frac{1}{3})."""
    (accuracy,) = rewards.reward_functions(_reward_cfg("trl.rewards:accuracy_reward"), ("solution",))
    said = [
        [{"role": "assistant", "content": "so it is \\boxed{\\frac{1}{3}}"}],
        [{"role": "assistant", "content": "\\boxed{2}"}],
    ]
    assert accuracy(prompts=["q", "q"], completions=said, solution=["1/3", "3"]) == [1.0, 0.0]
    with pytest.raises(UserError, match=r"trl.rewards:accuracy_reward reads the column 'solution'"):
        rewards.reward_functions(_reward_cfg("trl.rewards:accuracy_reward"), ("answer",))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real_find_spec(name, *a)
    )
    with pytest.raises(
        UserError, match=r"accuracy_reward compares answers with math_verify, which is not installed here: pip install"
    ):
        rewards.reward_functions(_reward_cfg("trl.rewards:accuracy_reward"), ("solution",))


def test_a_reward_module_beside_the_data_is_refused(tmp_path, monkeypatch):
    data = tmp_path / "downloaded"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"prompt": "order: ba\n", "answer": "ab"}])
    (data / "sneaky_rewards.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(data))
    cfg = compose_cfg("objective=grpo", "objective.rewards=[sneaky_rewards:r]", f"data.path={data / 'train.jsonl'}")
    with pytest.raises(UserError, match=r"sneaky_rewards:r resolves to .* inside the directory of data.path"):
        rewards.reward_functions(cfg, ("answer",))


def test_a_reward_module_that_raises_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no API key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"module 'broken_rewards' does not import \(RuntimeError: no API key\)"):
        rewards.reward_functions(_reward_cfg("broken_rewards:r"), ("answer",))


def _plan(*overrides):
    cfg = compose_cfg("recipe=llama3.1-8b-24gb", *overrides)
    return planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))


def test_grpo_plans_its_sampling_and_a_reference_only_when_beta_is_above_zero():
    n = "objective.num_generations=4"  # the recipe's micro-batch x grad_accum holds whole groups of 4
    sft, grpo, kl = _plan(), _plan("objective=grpo", n), _plan("objective=grpo", n, "objective.beta=0.04")
    gpu = "cuda:0"
    assert grpo["components"]["sampling"][gpu] > 0 and "sampling" not in sft["components"]
    assert "reference_forward" not in grpo["components"] and kl["components"]["reference_forward"][gpu] > 0
    assert kl["devices"][0]["peak"] >= grpo["devices"][0]["peak"]
    # the fused head scores the completions alone (TRL's logits_to_keep), not every position
    assert grpo["components"]["lm_head_loss"][gpu] < sft["components"]["lm_head_loss"][gpu]
    assert grpo["peak_gib"] != sft["peak_gib"]
    assert sft["devices"][0]["peak"] / GiB == pytest.approx(13.22, abs=0.05)  # the recipe's header, unchanged


def test_grpo_sequences_are_the_prompt_bound_plus_the_completion():
    from qlora_recipes.planner.spec import spec_from_cfg

    st = spec_from_cfg(compose_cfg("objective=grpo", "trainer.seq_len=64", "objective.max_completion_length=16"), 1)
    assert (st.seq_len, st.completion_len, st.sample_rows, st.reference) == (80, 16, 32, "none")


def test_the_8b_grpo_recipe_is_the_24gb_stack_sampling_math_prompts_and_fits():
    cfg, sft = compose_cfg("recipe=llama3.1-8b-24gb-grpo"), compose_cfg("recipe=llama3.1-8b-24gb")
    assert cfg.objective.name == "grpo" and cfg.data.path == "trl-lib/DeepMath-103K" and cfg.data.format == "prompt"
    for group in ("model", "quant", "peft", "optim", "offload", "precision", "hardware"):
        assert getattr(cfg, group) == getattr(sft, group), group
    batch = cfg.trainer.micro_batch_size * cfg.trainer.grad_accum
    assert batch % cfg.objective.num_generations == 0  # whole groups per generation batch, as TRL requires
    check_stack(cfg)
    planned = _plan("recipe=llama3.1-8b-24gb-grpo")
    assert planned["fits"] and planned["devices"][0]["peak_phase"] == "train: sampling"
    assert planned["components"]["sampling"]["cuda:0"] > 0 and "reference_forward" not in planned["components"]
    funcs = rewards.reward_functions(cfg, ("prompt", "solution"))  # DeepMath's columns
    assert [f.__name__ for f in funcs] == ["accuracy_reward"]
