"""Console output: the composed stack as a tree, and one-line errors."""

import sys

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.tree import Tree

STACK_GROUPS = ("model", "data", "quant", "peft", "optim", "offload", "precision", "trainer")


def stack_tree(cfg: DictConfig, choices: dict | None = None) -> Tree:
    """One branch per group, labelled with the chosen option, leaves the resolved values."""
    choices = choices or {}
    root = Tree(f"[bold]stack[/] recipe={choices.get('recipe') or '-'}")
    for group in STACK_GROUPS:
        option = choices.get(group)
        branch = root.add(f"[bold cyan]{group}[/]" + (f" = [green]{option}[/]" if option else ""))
        for key, value in OmegaConf.to_container(cfg[group], resolve=True).items():
            if value not in (None, [], {}):
                branch.add(f"{key}: {value}")
    return root


def print_stack(cfg: DictConfig, choices: dict | None = None) -> None:
    Console(stderr=False).print(stack_tree(cfg, choices))


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)
