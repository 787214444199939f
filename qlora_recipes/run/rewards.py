"""GRPO's reward functions (objective=grpo): the built-ins and the user's own `module:function`.

Every reward is what TRL 1.16's GRPOTrainer calls: `f(prompts, completions, completion_ids, **columns)`
with the batch's dataset columns (the prompt rows' other fields, `answer` for the built-ins) and
`trainer_state`, `log_extra`, `log_metric`; it returns one float (or None) per completion. The rewards
named in `objective.rewards` are summed with weight 1 each.

A `module:function` is imported by name from the Python path (and the directory the command runs in),
never from the data's or the model's directory (unless the command runs there): a file shipped beside a
downloaded dataset or model is not code to run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path

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


def reward_functions(cfg: TrainConfig, columns: tuple[str, ...]) -> list[Callable]:
    """objective.rewards as functions, each checked against the prompt rows' columns before training:
    a reward reading a column the rows lack is one line naming both."""
    funcs = [BUILTINS.get(name) or user_reward(name, cfg) for name in cfg.objective.rewards]
    for name, func in zip(cfg.objective.rewards, funcs, strict=True):
        missing = [c for c in columns_read(func) if c not in columns]
        if missing:
            have = ", ".join(columns) or "none but prompt"
            raise UserError(
                f"objective.rewards: {name} reads the column {missing[0]!r}, which the prompt rows of data.path lack "
                f"(their columns: {have}); add it to every row or pick another reward"
            )
    return funcs


def columns_read(func: Callable) -> list[str]:
    """The dataset columns a reward needs: its parameters without a default beyond TRL's own."""
    params = inspect.signature(func).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in TRL_ARGUMENTS]


def user_reward(name: str, cfg: TrainConfig) -> Callable:
    """`module:function` from the user's own code; a module that does not import, one found in the data's
    or the model's directory, or a missing function is one line."""
    module_name, func_name = name.split(":", 1)
    here = os.getcwd()
    added = here not in sys.path
    if added:  # the directory the command runs in, as `python -c` would have it
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure of the user's module is theirs to fix, in one line
        raise UserError(
            f"objective.rewards: {name}: module {module_name!r} does not import ({type(err).__name__}: {err}); "
            "put it on the Python path (PYTHONPATH, or run from its directory) and fix what it raises"
        ) from None
    finally:
        if added:
            sys.path.remove(here)
    _refuse_data_or_model_dir(name, module, cfg)
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


def _refuse_data_or_model_dir(name: str, module, cfg: TrainConfig) -> None:
    file = getattr(module, "__file__", None)
    if file is None:
        return
    where = Path(file).resolve()
    dirs = {"data.path": Path(str(cfg.data.path)).expanduser().resolve().parent}
    if Path(str(cfg.model.name_or_path)).expanduser().is_dir():
        dirs["model"] = Path(str(cfg.model.name_or_path)).expanduser().resolve()
    for key, folder in dirs.items():
        # the directory the command runs in is the user's own (their data may sit there too)
        if where.is_relative_to(folder) and folder != Path.cwd().resolve():
            raise UserError(
                f"objective.rewards: {name} resolves to {where}, inside the directory of {key} ({folder}); rewards "
                "are your code, never files beside the data or the model: move the module elsewhere on the Python path"
            )
