"""How the user started this process (`python train.py`, `qlora train`) and the overrides of the
Hydra job running now: for messages that name a command the user can copy and paste."""

import os
import re

_COMMAND = ["qlora train"]
# Set by `qlora launch` for the ranks it starts: the command (and flags) that starts them again
LAUNCH_ENV = "QLORA_RECIPES_LAUNCH"


def set_command(prog: str, environ=os.environ) -> None:
    """How the user started this command (`python train.py`, `qlora train`), for copy-pasteable hints;
    for a rank of several, the launcher that starts the same job again (`launcher_command`)."""
    _COMMAND[0] = launcher_command(f"python {prog}" if prog.endswith(".py") else prog, environ)


def launcher_command(trainer: str, environ=os.environ) -> str:
    """The command that starts this process's job: `trainer` for one process; for the ranks of a
    `qlora launch`, that command (LAUNCH_ENV); for torchrun's ranks, torchrun with as many ranks
    per node (`--standalone` on one node) over the same script (`python train.py` -> `train.py`,
    `qlora train` -> `-m qlora_recipes train`). A resume on another number of ranks would change
    the global batch, so it is refused (run/resume.py): the printed command must keep it."""
    try:
        world = int(environ.get("WORLD_SIZE", "1") or 1)
        local = int(environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    except ValueError:  # validation names it
        return trainer
    if world <= 1:
        return trainer
    if environ.get(LAUNCH_ENV):
        return environ[LAUNCH_ENV]
    script = (
        trainer.removeprefix("python ") if trainer.startswith("python ") else f"-m qlora_recipes {trainer.split()[-1]}"
    )
    nodes = max(1, world // max(local, 1))
    where = f"--nnodes {nodes}" if nodes > 1 else "--standalone"  # several nodes: add the rendezvous flags used
    return f"torchrun {where} --nproc_per_node {local} {script}"


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

    words = [*_without_run_dir(overrides, extra), "resume=auto", hydra_override("hydra.run.dir", run_dir), *extra]
    return _joined(trainer_command or command(), words)


def init_from_command(overrides: list[str], run_dir: str, trainer_command: str | None = None) -> str:
    """The command that trains on from the finished run in `run_dir` when it kept no checkpoint to
    resume: a new run (in a new run dir) whose adapter starts as that run's (init_from)."""

    words = [*_without_run_dir(overrides, ("init_from",)), hydra_override("init_from", run_dir)]
    return _joined(trainer_command or command(), words)


def _joined(cmd: str, words: list[str]) -> str:
    """`cmd` and the shell-quoted overrides; `qlora launch` takes the recipe first, by name."""
    import shlex

    if cmd == os.environ.get(LAUNCH_ENV):
        recipes = [w.split("=", 1)[1] for w in words if w.startswith("recipe=")]
        words = recipes[-1:] + [w for w in words if not w.startswith("recipe=")]
    return " ".join([cmd, *map(shlex.quote, words)])


def _without_run_dir(overrides: list[str], extra) -> list[str]:
    """The overrides less those that pick or replace a run dir and the keys `extra` sets."""
    dropped = ("resume", "hydra.run.dir", "overwrite", *(e.split("=", 1)[0] for e in extra))
    return [o for o in overrides if not o.lstrip("+~").startswith(dropped)]
