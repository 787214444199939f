"""objective=grpo's rewards as TRL calls them (run/rewards.py's CheckedReward): one finite number or None
per completion, within objective.reward_timeout_s, or one line naming the reward, the step, the completion
and what it returned; and a reward module's trust decided from where its files lie before any of its code
runs (a module inside the data's or the model's directory is refused unimported)."""

import asyncio
import json
import math
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, compose_cfg, write_jsonl

from qlora_recipes.errors import UserError
from qlora_recipes.run import metrics, rewards

PROMPTS = ["order: cab\n", "order: ba\n"]
COMPLETIONS = ["abc", "ab"]
STEP = {"trainer_state": SimpleNamespace(global_step=4)}  # TRL passes its state: this call is step 5


def _call(func, timeout_s: float = 30.0, name: str = "mine:r"):
    reward = rewards.checked_reward(name, func, timeout_s)
    return reward(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1], [2]], **STEP)


def test_numbers_tensors_and_none_pass_through_as_floats():
    out = _call(lambda completions, **_: [torch.tensor(1), None])
    assert out == [1.0, None] and isinstance(out[0], float)


@pytest.mark.parametrize(
    ("returned", "line"),
    [
        ([float("nan"), 1.0], r"mine:r returned nan \(not finite\) for completion 0 \(prompt 'order: cab\\n', "),
        ([1.0, float("inf")], r"mine:r returned inf \(not finite\) for completion 1 \(prompt 'order: ba\\n', "),
        ([1.0, "good"], r"mine:r returned 'good' \(a str, not a number\) for completion 1 .*completion 'ab'\)"),
        ([1.0], r"mine:r returned 1 rewards for the 2 completions of the batch at step 5"),
        ("11", r"mine:r returned '11', not a list of one reward per completion at step 5"),
        (0.5, r"mine:r returned 0.5, not a list of one reward per completion at step 5"),
    ],
    ids=["nan", "inf", "str", "wrong-length", "a-string", "a-float"],
)
def test_a_reward_returning_what_grpo_cannot_train_on_is_one_line(returned, line):
    with pytest.raises(rewards.RewardFault, match=line) as err:
        _call(lambda completions, **_: returned)
    assert "\n" not in str(err.value) and "fix the reward" in str(err.value)


def test_a_reward_that_raises_is_one_line_naming_the_reward_and_the_step():
    def broken(completions, **_):
        raise KeyError("answer")

    with pytest.raises(rewards.RewardFault, match=r"mine:r raised KeyError: 'answer' at step 5; fix the reward"):
        _call(broken)


def test_a_reward_past_its_time_limit_is_abandoned_in_one_line():
    started = time.monotonic()
    with pytest.raises(rewards.RewardFault, match=r"mine:r ran past objective.reward_timeout_s=0.3 s at step 5"):
        _call(lambda completions, **_: time.sleep(30), timeout_s=0.3)
    assert time.monotonic() - started < 10


def test_a_stop_signal_ends_the_wait_for_a_hanging_reward_after_the_grace(monkeypatch):
    monkeypatch.setattr(rewards, "STOP_GRACE_S", 0.2)
    reward = rewards.checked_reward("mine:r", lambda completions, **_: time.sleep(30), 300)
    reward.stop_requested = lambda: "SIGTERM"
    started = time.monotonic()
    with pytest.raises(rewards.RewardStopped, match=r"SIGTERM came while the reward mine:r ran .* step 5") as err:
        reward(prompts=PROMPTS, completions=COMPLETIONS, **STEP)
    assert err.value.signame == "SIGTERM" and time.monotonic() - started < 10


def test_a_reward_that_returns_within_the_grace_finishes_its_step(monkeypatch):
    reward = rewards.checked_reward("mine:r", lambda completions, **_: time.sleep(0.2) or [1.0, 0.0], 300)
    reward.stop_requested = lambda: "SIGTERM"
    assert reward(prompts=PROMPTS, completions=COMPLETIONS, **STEP) == [1.0, 0.0]


def test_the_reward_runs_in_the_callers_grad_mode():
    seen = []
    with torch.no_grad():
        _call(lambda completions, **_: seen.append(torch.is_grad_enabled()) or [1.0, 1.0])
    assert seen == [False]


def test_an_async_reward_stays_async_and_is_checked_alike():
    async def late(completions, **_):
        await asyncio.sleep(5)
        return [1.0, 1.0]

    async def nan(completions, **_):
        return [math.nan, 1.0]

    reward = rewards.checked_reward("mine:late", late, 0.2)
    with pytest.raises(rewards.RewardFault, match=r"mine:late ran past objective.reward_timeout_s=0.2 s"):
        asyncio.run(reward(prompts=PROMPTS, completions=COMPLETIONS, **STEP))
    with pytest.raises(rewards.RewardFault, match=r"mine:nan returned nan \(not finite\) for completion 0"):
        asyncio.run(rewards.checked_reward("mine:nan", nan, 5)(prompts=PROMPTS, completions=COMPLETIONS, **STEP))


def test_a_completion_no_reward_scores_is_refused_and_one_another_scores_is_kept():
    some = rewards.checked_reward("mine:some", lambda completions, **_: [None, 1.0], 5)
    none = rewards.checked_reward("mine:none", lambda completions, **_: [None, None], 5)
    for func in (some, none):
        func(prompts=PROMPTS, completions=COMPLETIONS, **STEP)
    with pytest.raises(
        rewards.RewardFault, match=r"every reward \(mine:some, mine:none\) returned None for completion 0"
    ):
        rewards.refuse_unscored([some, none], PROMPTS, COMPLETIONS, 5)
    other = rewards.checked_reward("mine:other", lambda completions, **_: [0.5, None], 5)
    other(prompts=PROMPTS, completions=COMPLETIONS, **STEP)
    rewards.refuse_unscored([some, none, other], PROMPTS, COMPLETIONS, 5)  # each completion has a score


def test_reward_figures_stay_json_whatever_trl_logged():
    history = [{"reward": None}, {"reward": 0.25}, {"reward": math.nan}, {"reward": math.inf}, {"loss": 1.0}]
    figures = metrics.reward_figures(history)
    assert figures == {"reward_first": 0.25, "reward_last": 0.25, "rewards": [None, 0.25, None, None]}
    json.dumps(figures, allow_nan=False)  # no NaN or Infinity: metrics.json is JSON


def test_the_reward_time_limit_is_a_grpo_key_with_a_range():
    from qlora_recipes.config.checks import check_stack

    assert compose_cfg("objective=grpo").objective.reward_timeout_s == 300
    with pytest.raises(UserError, match=r"objective.reward_timeout_s=0.0 must be > 0"):
        check_stack(compose_cfg("objective=grpo", "objective.reward_timeout_s=0"))
    with pytest.raises(UserError, match=r"objective.reward_timeout_s=5.0 only applies to objective=grpo"):
        check_stack(compose_cfg("objective.reward_timeout_s=5"))


# ---------------------------------------------------------------- trust before import
MARKS = "import pathlib\npathlib.Path({mark!r}).write_text('ran')\n"


def _evil_package(folder, mark):
    """A package whose __init__ and module both write `mark` when imported."""
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(MARKS.format(mark=str(mark)))
    (folder / "rw2.py").write_text(MARKS.format(mark=str(mark)) + "def f(completions, **kw):\n    return [1.0]\n")


def _forget(*names):
    for name in names:
        sys.modules.pop(name, None)


def test_a_reward_package_beside_a_data_file_is_refused_before_any_of_it_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mark = tmp_path / "ran"
    _evil_package(tmp_path / "evil", mark)
    write_jsonl(tmp_path / "evil" / "train.jsonl", [{"prompt": "order: ba\n", "answer": "ab"}])
    cfg = compose_cfg("objective=grpo", "objective.rewards=[evil.rw2:f]", "data.path=evil/train.jsonl")
    with pytest.raises(UserError, match=r"evil.rw2:f resolves to .*evil/__init__.py, inside the directory"):
        rewards.reward_functions(cfg, ("answer",))
    assert not mark.exists() and "evil" not in sys.modules
    _forget("evil", "evil.rw2")


def test_a_reward_module_inside_a_dataset_dir_in_the_working_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mark = tmp_path / "ran"
    (tmp_path / "evil2").mkdir()
    (tmp_path / "evil2" / "rw2.py").write_text(MARKS.format(mark=str(mark)) + "def f(completions, **kw): pass\n")
    cfg = compose_cfg("objective=grpo", "objective.rewards=[evil2.rw2:f]", "data.path=evil2")
    with pytest.raises(UserError, match=r"evil2.rw2:f resolves to .*evil2/rw2.py, inside the directory of data"):
        rewards.reward_functions(cfg, ("answer",))
    assert not mark.exists() and "evil2" not in sys.modules
    _forget("evil2", "evil2.rw2")


def test_a_reward_module_in_the_model_dir_is_refused_unimported(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    mark = tmp_path / "ran"
    (model / "model_rewards.py").write_text(MARKS.format(mark=str(mark)) + "def f(completions, **kw): pass\n")
    monkeypatch.syspath_prepend(str(model))
    cfg = compose_cfg(
        "objective=grpo",
        "objective.rewards=[model_rewards:f]",
        f"model.name_or_path={model}",
        f"data.path={REPO / 'assets/data/order/grpo/train.jsonl'}",
    )
    with pytest.raises(UserError, match=r"model_rewards:f resolves to .* inside the directory of model"):
        rewards.reward_functions(cfg, ("answer",))
    assert not mark.exists()
    _forget("model_rewards")


def test_a_reward_module_beside_data_in_the_working_directory_is_the_users_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "order: ba\n", "answer": "ab"}])
    (tmp_path / "own_rewards.py").write_text(
        "def short(completions, **kw):\n    return [-len(c) for c in completions]\n"
    )
    cfg = compose_cfg("objective=grpo", "objective.rewards=[own_rewards:short]", "data.path=train.jsonl")
    (reward,) = rewards.reward_functions(cfg, ("answer",))
    assert reward(prompts=PROMPTS, completions=COMPLETIONS, **STEP) == [-3.0, -2.0]
    _forget("own_rewards")


def test_the_files_an_import_would_run_are_found_without_running_them(tmp_path, monkeypatch):
    mark = tmp_path / "ran"
    _evil_package(tmp_path / "code" / "located", mark)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    files = rewards.module_files("located.rw2")
    assert [f.name for f in files] == ["__init__.py", "rw2.py"] and not mark.exists()
    assert "located" not in sys.modules
    assert rewards.module_files("no_such_module_here.x") == []
