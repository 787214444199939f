"""`--help` text shared by the commands: the config groups and their options (read from conf/ on disk, so
a new option file shows up by itself), the common overrides, and where docs/ explains more.

Help stays short (under 50 lines): no composed-config dump; `--cfg job` prints that, and
`--hydra-help` Hydra's own page. `--help | head -3` ends quietly (`quiet_when_the_reader_goes`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

from ..resources import CONF_DIR, RECIPES_DIR

# Groups a user picks with `+GROUP=...` (presets) or that are Hydra's own are listed apart.
_NOT_STACK_GROUPS = ("hydra", "recipe", "sweep")
COMMON_OVERRIDES = """common overrides:
  data.path=FILE          your own data (.jsonl/.json/.csv/.parquet, a dir or a hub name; format detected)
  model.name_or_path=DIR  a local HF model dir or hub id (with model=FAMILY for its architecture figures)
  trainer.max_steps=N trainer.seq_len=N trainer.micro_batch_size=N trainer.grad_accum=N peft.r=N optim.lr=X
  quant=nf4|int8|none offload=cpu precision=bf16|fp16|fp32 (default auto)  resume=auto hydra.run.dir=RUN (go on)"""
HYDRA_FLAGS = (
    "Hydra flags: -m (sweeps: GROUP=a,b KEY=1,2), --cfg job (the composed config), hydra.run.dir=DIR, --hydra-help"
)


# The page of docs/ that holds each section a command's --help points at (tests/unit/test_help.py checks
# that each page a command names has that section, under that exact heading).
DOCS_PAGES = {
    "Running": "docs/running-and-outputs.md",
    "After training": "docs/running-and-outputs.md",
    "Your own data": "docs/data.md",
    "The groups and their options": "docs/configuration.md",
    "Planning a stack": "docs/memory-and-planner.md",
    "Recipes": "docs/recipes.md",
    "Multi-GPU": "docs/multi-gpu.md",
    "Sweeps": "docs/sweeps-and-clusters.md",
    "Benchmarks": "docs/benchmarks.md",
}


def docs_pointer(*sections: str) -> str:
    """The docs sections that explain a command, each with its page: `more: docs/data.md ('Your own data')`."""
    return "more: " + ", ".join(f"{DOCS_PAGES[s]} ('{s}')" for s in sections)


def stack_groups() -> list[str]:
    """The config groups a stack is composed of (conf/'s folders, Hydra's own and presets aside)."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in _NOT_STACK_GROUPS)


def _defaults() -> dict[str, set[str]]:
    """Each group's default option(s) in train.yaml (a list for groups that take several, like logger)."""
    from omegaconf import OmegaConf  # here: `qlora` imports this module before any command runs

    chosen = {}
    for item in OmegaConf.load(CONF_DIR / "train.yaml").get("defaults", []):
        if isinstance(item, dict) or OmegaConf.is_dict(item):
            for group, option in dict(item).items():
                if not str(group).startswith("override"):
                    several = OmegaConf.is_list(option) or isinstance(option, list)
                    chosen[str(group)] = {str(o) for o in option} if several else {str(option)}
    return chosen


def _options(folder) -> list[str]:
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def groups_help() -> str:
    """One line per group: its options, the default marked with *."""
    defaults = _defaults()
    groups = stack_groups()
    width = max(map(len, groups + ["recipe", "+sweep"]))
    lines = ["config groups (GROUP=OPTION, * = default; any key: GROUP.KEY=VALUE):"]
    for group in groups:
        marked = [f"{o}*" if o in defaults.get(group, ()) else o for o in _options(CONF_DIR / group)]
        lines.append(f"  {group:<{width}}  {', '.join(marked)}")
    lines.append(f"  {'recipe':<{width}}  {', '.join(_options(RECIPES_DIR))}")
    lines.append(f"  {'+sweep':<{width}}  {', '.join(_options(CONF_DIR / 'sweep'))}  (presets for -m)")
    lines.append(
        "top-level keys: seed, force (start even when the plan says it does not fit), init_from (a finished "
        "run's adapter to start from), hardware.*"
    )
    return "\n".join(lines)


def recipes_help() -> str:
    """The recipes, each with the first line of its header (what it is, the hardware it is sized for)."""
    lines = ["recipes:"]
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        about = next((ln[2:].strip() for ln in path.read_text().splitlines()[1:] if ln.startswith("# ")), "")
        lines.append(f"  {path.stem:<22}  {about}")
    return "\n".join(lines)


def hydra_help(usage: str, flags: str = "", sections: tuple[str, ...] = ()) -> str:
    """The --help of a command that takes Hydra overrides: usage, groups, common overrides, its own
    flags, Hydra's flags, and the docs sections."""
    parts = [usage.strip(), "", groups_help(), "", COMMON_OVERRIDES, ""]
    if flags:
        parts += [flags.strip(), ""]
    parts.append(HYDRA_FLAGS)
    if sections:
        parts.append(docs_pointer(*sections))
    return "\n".join(parts)


CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE  # 141: what the shell reports for a tool that SIGPIPE ended


@contextlib.contextmanager
def quiet_when_the_reader_goes() -> Iterator[None]:
    """Around a command's `run` (`@quiet_when_the_reader_goes()`) or a Hydra task's body (`with`):
    once the reader of stdout has gone (`qlora plan --help | head -3`), the rest of the output is
    dropped and the command exits 141, as a tool ended by SIGPIPE does, instead of a BrokenPipeError
    traceback (Python ignores SIGPIPE, so the next write raises). The exit is a SystemExit, which a
    Hydra task lets through without its "Error executing job" line. The last flush happens here
    too: buffered output would otherwise fail at interpreter exit ("Exception ignored ... Broken
    pipe"). A broken pipe that is not stdout's (a socket) still raises."""
    try:
        try:
            yield
        except SystemExit:
            sys.stdout.flush()
            raise
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere, silently, at exit
        sys.exit(CLOSED_PIPE_EXIT)


def _stdout_reader_gone() -> bool:
    """A pipe or socket whose reader has closed polls as an error for its writer."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (OSError, ValueError):  # stdout replaced or closed: no fd to ask
        return False
