"""Console output: the composed stack as a tree, the run's summary table and next commands, one-line errors."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from .resources import CONF_DIR

if TYPE_CHECKING:
    from .config.schema import TrainConfig

STACK_GROUPS = ("model", "data", "quant", "peft", "optim", "offload", "precision", "trainer")


def _option_data_path(option: str) -> str | None:
    """The data.path an option of the data group sets (its file in conf/data/, resolved), or None."""
    try:
        node = OmegaConf.load(CONF_DIR / "data" / f"{option}.yaml")
        return str(node.path) if "path" in node else None
    except Exception:  # not a plain option file, or a resolver not registered here: no comparison
        return None


def group_label(cfg: TrainConfig, group: str, option: str | None) -> str | None:
    """What a branch is labelled with: the chosen option, except that `data` names the user's own
    file when data.path no longer is the option's (`data.path=my.jsonl` keeps option `order`)."""
    if group == "data" and option:
        path = str(cfg.data.path)
        if _option_data_path(option) not in (None, path):
            return path
    return option


def stack_tree(cfg: TrainConfig, choices: dict | None = None) -> Tree:
    """One branch per group, labelled with the chosen option, leaves the resolved values."""
    choices = choices or {}
    root = Tree(f"[bold]stack[/] recipe={choices.get('recipe') or '-'}")
    for group in STACK_GROUPS:
        label = group_label(cfg, group, choices.get(group))
        branch = root.add(
            f"[bold cyan]{group}[/]" + (f" = [green]{escape(label)}[/]" if label else ""), highlight=False
        )
        for key, value in dataclasses.asdict(getattr(cfg, group)).items():
            if value not in (None, [], {}):
                branch.add(f"{key}: {value}", highlight=False)
    return root


def print_stack(cfg: TrainConfig, choices: dict | None = None) -> None:
    Console(stderr=False).print(stack_tree(cfg, choices))


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------- the run's summary
def shown_path(path: Path) -> str:
    """A path as the user would type it: relative to the current dir when under it."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _num(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def summary_rows(out: dict) -> list[tuple[str, str]]:
    """The few figures a user reads after a run (metrics.json keeps every figure at full precision)."""
    loss = f"{_num(out.get('train_loss_first'))} -> {_num(out.get('train_loss_last'))}  ({out.get('steps')} steps)"
    rows = [("objective", out["objective"])] if out.get("objective", "sft") != "sft" else []
    rows.append(("train loss", loss))
    if out.get("eval_loss") is not None:
        rows.append(("eval loss", f"{_num(out['eval_loss'])}  (perplexity {_num(out.get('eval_perplexity'))})"))
    if out.get("eval_reward_accuracy") is not None:  # dpo: TRL's eval rewards/accuracies and margins
        before, after = out.get("eval_reward_accuracy_before"), out["eval_reward_accuracy"]
        margin = f"  (margin {_num(out.get('eval_reward_margin'), 3)})"
        rows.append(("reward accuracy", f"{_num(before, 3)} -> {_num(after, 3)}{margin}"))
    if out.get("reward_last") is not None:  # grpo: the mean reward of the first and last logged steps
        rows.append(("reward", f"{_num(out.get('reward_first'), 3)} -> {_num(out['reward_last'], 3)}"))
    if out.get("eval_exact_match") is not None:
        before, after = out.get("eval_exact_match_before"), out["eval_exact_match"]
        rows.append(("exact match", f"{_num(before, 3)} -> {_num(after, 3)}"))
    efficiency = out.get("token_efficiency")  # real / computed tokens: padded slots are computed too
    shown = f"  (token efficiency {efficiency:.2f}: real / computed tokens)" if efficiency is not None else ""
    rows.append(("tokens/s", _num(out.get("tokens_per_s"), 3) + shown))
    ratio = f", measured/planned {out['plan_ratio']:.2f}" if out.get("plan_ratio") else ""
    peak = f"{_num(out.get('planned_peak_gib'), 3)} GiB planned, {_num(out.get('peak_mem_gib'), 3)} GiB measured"
    rows.append(("peak memory", f"{peak}  ({out.get('peak_quantity', 'peak')}{ratio})"))
    rows.append(("wall", f"{_duration(out.get('wall_s'))}  (training {_duration(out.get('train_s'))})"))
    return rows


def next_commands(
    command: str, run_dir: Path, overrides: list[str], steps: int | None, checkpoint: bool = True
) -> list[tuple[str, str]]:
    """merge, generate and how to train on, for this run dir, quoted for the shell (and the dir for
    Hydra too). `command` starts the trainer (`python train.py`, `qlora train`). The run is finished:
    with a `checkpoint` kept, resuming it means a larger total; without one (trainer.save_steps=0) there
    is nothing to resume, and a new run starts from its adapter (init_from)."""
    from .invocation import init_from_command, resume_command

    where = shown_path(run_dir)
    if command.startswith("qlora"):
        merge, generate = "qlora merge", "qlora generate"
    else:
        merge, generate = "python scripts/merge.py", "python scripts/generate.py"
    more = f"trainer.max_steps={2 * steps}" if steps else "trainer.epochs=2"
    argument = shlex.quote(where if not where.startswith("-") else f"./{where}")  # not an option
    go_on = (
        ("resume", resume_command(overrides, where, more, trainer_command=command))
        if checkpoint
        else ("train on", init_from_command(overrides, where, trainer_command=command))
    )
    return [("merge", f"{merge} {argument}"), ("generate", f"{generate} {argument} 'YOUR PROMPT'"), go_on]


def _aligned(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {text}" for name, text in rows]


def print_summary(out: dict, run_dir: Path, commands: list[tuple[str, str]]) -> None:
    """The run's table, then what to run next (stdout; every figure in full is in metrics.json)."""
    lines = [f"done: {shlex.quote(shown_path(run_dir))}  (adapter/, metrics.json)", *_aligned(summary_rows(out))]
    resumes = any(name == "resume" for name, _ in commands)
    how = (
        "resume trains on to twice the steps"
        if resumes
        else "no checkpoint kept: train on starts a new run from this adapter"
    )
    lines += [f"next ({how}):", *_aligned(commands)]
    print("\n".join(lines), flush=True)


@contextlib.contextmanager
def library_bars_on(
    env_decides: bool, are_disabled: Callable[[], bool], enable: Callable[[], None], disable: Callable[[], None]
) -> Iterator[None]:
    """A library's progress bars (datasets', huggingface_hub's) on for the block, off again after it;
    untouched when the user's environment variable decides or they are on already."""
    if env_decides or not are_disabled():
        yield
        return
    enable()
    try:
        yield
    finally:
        disable()


def quiet_libraries(log_level: int) -> None:
    """transformers' info lines, progress bars and deprecation warnings are noise in merge/generate;
    our own log lines at `log_level` and above go to stderr."""
    import logging
    import warnings

    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
