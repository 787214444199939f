"""How the user started this process (`python train.py`, `qlora train`) and the overrides of the
Hydra job running now: for messages that name a command the user can copy and paste."""

import re

_COMMAND = ["qlora train"]


def set_command(prog: str) -> None:
    """How the user started this command (`python train.py`, `qlora train`), for copy-pasteable hints."""
    _COMMAND[0] = f"python {prog}" if prog.endswith(".py") else prog


def command() -> str:
    return _COMMAND[0]


def task_overrides() -> list[str]:
    """The command-line overrides of the Hydra job running now (none outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def hydra_override(key: str, value: str) -> str:
    """`key=value` as Hydra's override grammar reads it back to `value` exactly: bare where it
    can be (`hydra.run.dir=runs/2026-01-31/12-00-00`), else single-quoted (non-ASCII, spaces,
    `;`, `()`, `,`, `=`, quotes). Shell-quote the result too where it goes on a command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        if parser.parse_override(f"{key}={value}").value() == value:
            return f"{key}={value}"
    except Exception:  # noqa: BLE001 - any rejection of the bare form: quote it
        pass
    # In a quoted value a backslash escapes only a quote or the end: double those runs, escape quotes.
    quoted = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"{key}='{quoted}'"


def resume_command(overrides: list[str], run_dir: str, *extra: str, trainer_command: str | None = None) -> str:
    """The command (`trainer_command`, else the one the user typed) that continues the run in `run_dir`, pasteable into
    a shell as printed: the user's overrides less those that pick or replace a run dir (resume,
    hydra.run.dir, overwrite) and the keys `extra` sets, then resume=auto, the dir and `extra`."""
    import shlex

    words = [*_without_run_dir(overrides, extra), "resume=auto", hydra_override("hydra.run.dir", run_dir), *extra]
    return " ".join([trainer_command or command(), *map(shlex.quote, words)])


def init_from_command(overrides: list[str], run_dir: str, trainer_command: str | None = None) -> str:
    """The command that trains on from the finished run in `run_dir` when it kept no checkpoint to
    resume: a new run (in a new run dir) whose adapter starts as that run's (init_from)."""
    import shlex

    words = [*_without_run_dir(overrides, ("init_from",)), hydra_override("init_from", run_dir)]
    return " ".join([trainer_command or command(), *map(shlex.quote, words)])


def _without_run_dir(overrides: list[str], extra) -> list[str]:
    """The overrides less those that pick or replace a run dir and the keys `extra` sets."""
    dropped = ("resume", "hydra.run.dir", "overwrite", *(e.split("=", 1)[0] for e in extra))
    return [o for o in overrides if not o.lstrip("+~").startswith(dropped)]
