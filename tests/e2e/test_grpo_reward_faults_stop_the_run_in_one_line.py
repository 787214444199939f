"""objective=grpo with a reward of the user's own that misbehaves, on the tiny model: NaN, inf, None for
every completion, a string, the wrong number of rewards, an exception or a call that hangs each stop the
run at the first step, before its update, in one line naming the reward, the step and the completion
(nothing trained, no adapter, no checkpoint); a stop signal while a reward hangs stops the run as a
preemption after a short grace, with a line naming the reward. None where another reward scores the
completion is TRL's convention and trains."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, SMOKE, compose_cfg

from qlora_recipes.run.rewards import STOP_GRACE_S, RewardFault
from qlora_recipes.run.training import train

FAULTY = """
import pathlib
import time

def nan(completions, **kw):
    return [float("nan")] * len(completions)

def inf(completions, **kw):
    return [float("inf")] * len(completions)

def none(completions, **kw):
    return [None] * len(completions)

def text(completions, **kw):
    return ["good"] * len(completions)

def one(completions, **kw):
    return [1.0]

def raises(completions, **kw):
    raise ValueError("no score for this one")

def hangs(completions, **kw):
    pathlib.Path("reward-started").touch()  # the test's cue to send its signal
    time.sleep(120)

def odd_none(completions, **kw):
    return [None if i % 2 else 1.0 for i in range(len(completions))]
"""


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    """The rewards module in the directory the command runs in, as a user keeps it."""
    (tmp_path / "faulty_rewards.py").write_text(FAULTY)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("faulty_rewards", None)


def _grpo(*rewards: str, more: tuple = ()) -> tuple:
    return (*SMOKE, "objective=grpo", f"objective.rewards=[{','.join(rewards)}]", *more)


@pytest.mark.parametrize(
    ("reward", "line"),
    [
        ("nan", r"faulty_rewards:nan returned nan \(not finite\) for completion 0 \(prompt 'order: "),
        ("inf", r"faulty_rewards:inf returned inf \(not finite\) for completion 0 \(prompt 'order: "),
        ("none", r"every reward \(faulty_rewards:none\) returned None for completion 0 \(prompt 'order: "),
        ("text", r"faulty_rewards:text returned 'good' \(a str, not a number\) for completion 0 \(prompt "),
        ("one", r"faulty_rewards:one returned 1 rewards for the \d+ completions of the batch"),
        ("raises", r"faulty_rewards:raises raised ValueError: no score for this one"),
    ],
)
def test_a_faulty_reward_stops_the_run_at_its_first_step_naming_it(faulty, reward, line):
    run_dir = faulty / "run"
    with pytest.raises(RewardFault, match=line + r".* at step 1.*no checkpoint was saved yet") as err:
        train(compose_cfg(*_grpo(f"faulty_rewards:{reward}")), run_dir)
    assert "\n" not in str(err.value)
    assert not (run_dir / "adapter").exists() and not list((run_dir / "checkpoints").glob("checkpoint-*"))
    assert not (run_dir / "metrics.json").exists()  # no run recorded as trained: a rerun starts afresh


def test_a_reward_that_hangs_stops_at_its_time_limit(faulty):
    started = time.monotonic()
    with pytest.raises(RewardFault, match=r"faulty_rewards:hangs ran past objective.reward_timeout_s=2 s at step 1"):
        train(compose_cfg(*_grpo("faulty_rewards:hangs", more=("objective.reward_timeout_s=2",))), faulty / "run")
    assert time.monotonic() - started < 100  # the reward sleeps 120 s: it was abandoned, not waited for


def test_none_where_another_reward_scores_the_completion_trains_and_is_recorded(faulty):
    metrics = train(compose_cfg(*_grpo("faulty_rewards:odd_none", "char_match")), faulty / "run")
    assert metrics["steps"] == 3 and metrics["reward_last"] is not None
    assert (faulty / "run" / "metrics.json").is_file() and (faulty / "run" / "manifest.json").is_file()


def _train_py(cwd, *overrides) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={cwd / 'run'}"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_train_py_prints_a_reward_fault_as_one_error_line(faulty):
    proc = _train_py(faulty, *_grpo("faulty_rewards:nan"))
    _, stderr = proc.communicate(timeout=600)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and "faulty_rewards:nan returned nan" in errors[0], stderr[-3000:]


def test_sigterm_while_a_reward_hangs_stops_the_run_naming_the_reward(faulty):
    proc = _train_py(faulty, *_grpo("faulty_rewards:hangs"))
    deadline = time.monotonic() + 300
    while not (faulty / "reward-started").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the reward never started (exit {proc.returncode}): {proc.communicate(timeout=60)[1][-3000:]}")
        time.sleep(0.2)
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - signalled < STOP_GRACE_S + 60  # not the reward's 120 s, nor the 300 s limit
    assert proc.returncode == 143, stderr[-3000:]
    assert "SIGTERM came while the reward faulty_rewards:hangs ran" in stdout, stdout[-3000:]  # the run's log
    assert "stopped by SIGTERM at step 0" in stderr and "Traceback" not in stderr, stderr[-3000:]
