"""GRPO's reward functions (objective=grpo): the built-ins and the user's own `module:function`.

Every reward is what TRL 1.16's GRPOTrainer calls: `f(prompts, completions, completion_ids, **columns)`
with the batch's dataset columns (the prompt rows' other fields, `answer` for the built-ins) and
`trainer_state`, `log_extra`, `log_metric`; it returns one float (or None) per completion. The rewards
named in `objective.rewards` are summed with weight 1 each.

A `module:function` is imported by name from the Python path (and the directory the command runs in),
never from the data's or the model's directory (unless the command runs there): a file shipped beside a
downloaded dataset or model is not code to run. Where each file of the import lies (its packages' too) is
judged before any of them runs.

Each reward is handed to TRL wrapped (`CheckedReward`): a call that raises, outlasts
objective.reward_timeout_s, or returns anything but one finite number or None per completion stops the
run in one line naming the reward, the step and the completion; so does a completion no reward scores.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..config.objectives import BUILTIN_REWARDS
from ..config.schema import TrainConfig
from ..errors import UserError

# TRL's own rewards that compare answers with a package of their own (trl.rewards: accuracy_reward and
# the rewards built on it check LaTeX answers with math-verify), and how to install it
NEEDS_PACKAGE = {"trl.rewards.accuracy_rewards": ("math_verify", "math-verify[antlr4_9_3]")}
# what TRL passes every reward besides the dataset's columns
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def completion_text(completion) -> str:
    """A completion as text: chat completions are lists of {role, content} messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def exact_match(completions, answer, **_) -> list[float]:
    """1 where the completion, stripped, is the row's `answer`, else 0: the task's own measure."""
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def char_match(completions, answer, **_) -> list[float]:
    """Partial credit: the share of positions where the completion's character is the answer's, over the
    longer of the two. A base that is only near the task still scores above 0 and differs between the
    samples of one prompt, so GRPO's group advantages carry a signal from the first step (exact match
    alone is 0 for most groups of a base that has not learnt the task: no advantage, no gradient)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        got, want = completion_text(c).strip(), str(a).strip()
        hits = sum(x == y for x, y in zip(got, want, strict=False))
        out.append(hits / max(len(got), len(want), 1))
    return out


def one_line(completions, **_) -> list[float]:
    """A format check: 1 where the completion is one non-empty line, else 0."""
    return [float(bool(t.strip()) and "\n" not in t.strip()) for t in map(completion_text, completions)]


BUILTINS: dict[str, Callable] = {"exact_match": exact_match, "char_match": char_match, "one_line": one_line}
assert tuple(BUILTINS) == BUILTIN_REWARDS  # config/objectives.py names them for the config checks


def reward_functions(cfg: TrainConfig, columns: tuple[str, ...]) -> list[CheckedReward]:
    """objective.rewards as functions, each checked against the prompt rows' columns before training (a
    reward reading a column the rows lack is one line naming both), each call checked (CheckedReward)."""
    funcs = [BUILTINS.get(name) or user_reward(name, cfg) for name in cfg.objective.rewards]
    for name, func in zip(cfg.objective.rewards, funcs, strict=True):
        missing = [c for c in columns_read(func) if c not in columns]
        if missing:
            have = ", ".join(columns) or "none but prompt"
            raise UserError(
                f"objective.rewards: {name} reads the column {missing[0]!r}, which the prompt rows of data.path lack "
                f"(their columns: {have}); add it to every row or pick another reward"
            )
    limit = cfg.objective.reward_timeout_s or DEFAULT_TIMEOUT_S
    return [checked_reward(name, func, limit) for name, func in zip(cfg.objective.rewards, funcs, strict=True)]


def columns_read(func: Callable) -> list[str]:
    """The dataset columns a reward needs: its parameters without a default beyond TRL's own."""
    params = inspect.signature(func).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in TRL_ARGUMENTS]


def user_reward(name: str, cfg: TrainConfig) -> Callable:
    """`module:function` from the user's own code; a module found in the data's or the model's directory
    (refused before any of its code runs), one that does not import, or a missing function is one line."""
    module_name, func_name = name.split(":", 1)
    here = os.getcwd()
    added = here not in sys.path
    if added:  # the directory the command runs in, as `python -c` would have it
        sys.path.append(here)
    try:
        for file in module_files(module_name):  # trust is decided on where the code lies, before it runs
            _refuse_data_or_model_dir(name, file, cfg)
        module = importlib.import_module(module_name)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the user's module is theirs to fix, in one line
        raise UserError(
            f"objective.rewards: {name}: module {module_name!r} does not import ({type(err).__name__}: {err}); "
            "put it on the Python path (PYTHONPATH, or run from its directory) and fix what it raises"
        ) from None
    finally:
        if added:
            sys.path.remove(here)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(
            f"objective.rewards: {name}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no function "
            f"{func_name!r}; name one it defines"
        )
    package, install = NEEDS_PACKAGE.get(getattr(func, "__module__", ""), (None, None))
    if package is not None and importlib.util.find_spec(package) is None:  # TRL's reward would fail at its first call
        raise UserError(
            f"objective.rewards: {name} compares answers with {package}, which is not installed here: "
            f"pip install '{install}' (requirements.txt pins it)"
        )
    return func


def module_files(module_name: str) -> list[Path]:
    """The files importing `module_name` would run: each package level's `__init__` and the module's own,
    located as the import system would find them, without running any (importlib.util.find_spec of a
    dotted name imports its parents; here each level is looked up in its parent's folders instead)."""
    files: list[Path] = []
    parts = module_name.split(".")
    path = None
    for depth in range(1, len(parts) + 1):
        dotted = ".".join(parts[:depth])
        loaded = sys.modules.get(dotted)
        spec = getattr(loaded, "__spec__", None) if loaded is not None else _find_spec(dotted, path)
        if spec is None:  # not there: the import fails, in its own line
            return files
        if spec.origin and spec.has_location:
            files.append(Path(spec.origin))
        if spec.submodule_search_locations is None:
            return files
        path = list(spec.submodule_search_locations)
    return files


def _find_spec(dotted: str, path: list[str] | None):
    """What the import system's finders return for one level: a finder locates a module, never runs it."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(dotted, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def untrusted_dirs(cfg: TrainConfig) -> dict[str, Path]:
    """The folders whose files are not code to run: the data's (data.path and data.eval_path: the folder a
    dataset dir is, the one a data file lies in) and the model dir, resolved."""
    dirs = {}
    for key in ("path", "eval_path"):
        value = getattr(cfg.data, key)
        where = Path(str(value)).expanduser() if value else None
        if where is not None and where.exists():
            dirs[f"data.{key}"] = (where if where.is_dir() else where.parent).resolve()
    model = Path(str(cfg.model.name_or_path)).expanduser()
    if model.is_dir():
        dirs["model"] = model.resolve()
    return dirs


def _refuse_data_or_model_dir(name: str, file: Path, cfg: TrainConfig) -> None:
    where, here = file.resolve(), Path.cwd().resolve()
    for key, folder in untrusted_dirs(cfg).items():
        # the directory the command runs in is the user's own, also where their data lies in it or above it
        if where.is_relative_to(folder) and not (here.is_relative_to(folder) and where.is_relative_to(here)):
            raise UserError(
                f"objective.rewards: {name} resolves to {where}, inside the directory of {key} ({folder}); rewards "
                "are your code, never files beside the data or the model: move the module elsewhere on the Python path"
            )


# ---------------------------------------------------------------- each call checked
DEFAULT_TIMEOUT_S = 300.0  # objective.reward_timeout_s of a config saved before the key existed
STOP_GRACE_S = 10.0  # after a stop signal, how long a running reward may still finish its step
_POLL_S = 0.05


class RewardFault(UserError):
    """A reward raised, ran past objective.reward_timeout_s, or returned what GRPO cannot train on."""


class RewardStopped(Exception):
    """A stop signal came while a reward ran and it did not return within STOP_GRACE_S: the step cannot
    finish (the guarded trainer stops the run at its last checkpoint)."""

    def __init__(self, signame: str, name: str, seconds: float, step: int):
        super().__init__(f"{signame} came while the reward {name} ran ({seconds:.0f} s into step {step})")
        self.signame, self.name, self.step = signame, name, step


def checked_reward(name: str, func: Callable, timeout_s: float) -> CheckedReward:
    """`func` wrapped for TRL: an async reward stays async (TRL awaits it on its own loop)."""
    inner = func.func if isinstance(func, functools.partial) else func
    is_async = inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(type(inner).__call__)
    return (CheckedAsyncReward if is_async else CheckedReward)(name, func, timeout_s)


class CheckedReward:
    """One reward as TRL calls it, each call checked. It runs in a thread of its own for at most `timeout_s`
    seconds (a stop signal, seen through `stop_requested`, leaves it STOP_GRACE_S more) and returns one finite
    number, or None, per completion; anything else stops the run in one line naming the reward, the step, the
    completion and what it returned. None is a completion this reward does not score (TRL's convention);
    one that no reward scores is refused by `refuse_unscored`."""

    def __init__(self, name: str, func: Callable, timeout_s: float):
        self.name, self.func, self.timeout_s = name, func, timeout_s
        self.__name__ = getattr(func, "__name__", name)  # TRL logs rewards/<__name__>/mean
        self.__wrapped__ = func  # inspect.signature reads the reward's own parameters
        self.stop_requested: Callable[[], str | None] = lambda: None
        self.last: list[float | None] = []  # what the last call returned, checked

    def __call__(self, prompts, completions, **kwargs):
        step = _step(kwargs)
        out = self._run(step, dict(prompts=prompts, completions=completions, **kwargs))
        self.last = self.checked_values(out, prompts, completions, step)
        return self.last

    def _run(self, step: int, kwargs: dict):
        grad, box = torch.is_grad_enabled(), {}  # a new thread does not inherit the caller's grad mode

        def call():
            try:
                with torch.set_grad_enabled(grad):
                    box["out"] = self.func(**kwargs)
            except BaseException as err:  # noqa: BLE001 - whatever the reward raises is reported in one line
                box["err"] = err

        worker = threading.Thread(target=call, name=f"reward {self.name}", daemon=True)  # abandoned if it hangs
        started, signame = time.monotonic(), None
        deadline = started + self.timeout_s
        worker.start()
        while worker.is_alive() and time.monotonic() < deadline:
            worker.join(_POLL_S)
            if signame is None and (signame := self.stop_requested()):
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
        if worker.is_alive():
            if signame:
                raise RewardStopped(signame, self.name, time.monotonic() - started, step)
            raise self.timed_out(step)
        if "err" in box:
            raise self.raised(box["err"], step)
        return box["out"]

    def timed_out(self, step: int) -> RewardFault:
        return RewardFault(
            f"objective.rewards: {self.name} ran past objective.reward_timeout_s={self.timeout_s:g} s at step {step} "
            "and was abandoned; make it return sooner, or raise objective.reward_timeout_s"
        )

    def raised(self, err: BaseException, step: int) -> RewardFault:
        return RewardFault(
            f"objective.rewards: {self.name} raised {type(err).__name__}: {_cut(str(err), 160)} at step {step}; "
            "fix the reward (it gets prompts, completions, completion_ids and the rows' columns by name)"
        )

    def checked_values(self, out, prompts, completions, step: int) -> list[float | None]:
        n = len(completions)
        if isinstance(out, str | bytes | dict) or not isinstance(out, Iterable):
            raise self._fault(f"returned {_shown(out)}, not a list of one reward per completion", step)
        values = list(out)
        if len(values) != n:
            raise self._fault(f"returned {len(values)} rewards for the {n} completions of the batch", step)
        return [self._value(v, i, prompts, completions, step) for i, v in enumerate(values)]

    def _value(self, value, i: int, prompts, completions, step: int) -> float | None:
        if value is None:
            return None
        if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
            try:  # a one-element tensor or array
                value = value.item()
            except (ValueError, RuntimeError):
                pass
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return float(value)
        what = "not finite" if isinstance(value, numbers.Real) else f"a {type(value).__name__}, not a number"
        row = f"completion {i} ({_row(prompts, completions, i)})"
        raise self._fault(f"returned {_shown(value)} ({what}) for {row}", step)

    def _fault(self, what: str, step: int) -> RewardFault:
        return RewardFault(
            f"objective.rewards: {self.name} {what} at step {step}; a reward returns one finite number per "
            "completion (or None where another reward scores it): fix the reward"
        )


class CheckedAsyncReward(CheckedReward):
    """An async reward, checked alike; its time limit is asyncio's (TRL awaits it on its own loop)."""

    async def __call__(self, prompts, completions, **kwargs):
        step = _step(kwargs)
        try:
            out = await asyncio.wait_for(self.func(prompts=prompts, completions=completions, **kwargs), self.timeout_s)
        except TimeoutError:
            raise self.timed_out(step) from None
        except Exception as err:  # noqa: BLE001 - whatever the reward raises is reported in one line
            raise self.raised(err, step) from None
        self.last = self.checked_values(out, prompts, completions, step)
        return self.last


def refuse_unscored(funcs: list, prompts, completions, step: int) -> None:
    """A completion every reward returned None for: nothing scores it, so GRPO has nothing to train on
    (TRL would only warn and give it no advantage)."""
    checked = [f for f in funcs if isinstance(f, CheckedReward)]
    if not checked or len(checked) != len(funcs):
        return
    for i in range(len(completions)):
        if all(i < len(f.last) and f.last[i] is None for f in checked):
            names = ", ".join(f.name for f in checked)
            raise RewardFault(
                f"objective.rewards: every reward ({names}) returned None for completion {i} "
                f"({_row(prompts, completions, i)}) at step {step}: nothing scores it; return a number for it from "
                "at least one reward"
            )


def _step(kwargs: dict) -> int:
    state = kwargs.get("trainer_state")
    return int(getattr(state, "global_step", 0)) + 1


def _row(prompts, completions, i: int) -> str:
    prompt = completion_text(prompts[i]) if i < len(prompts) else "?"
    return f"prompt {_shown(prompt)}, completion {_shown(completion_text(completions[i]))}"


def _shown(value) -> str:
    return _cut(repr(value), 60)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
