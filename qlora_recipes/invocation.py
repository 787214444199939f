"""How the user started this process (`python train.py`, `qlora train`) and the overrides of the
Hydra job running now: for messages that name a command the user can copy and paste."""

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
