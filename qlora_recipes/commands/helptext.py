"""`--help` for the Hydra commands: the config groups and their options, read from conf/ on disk."""

from __future__ import annotations

from omegaconf import OmegaConf

from ..resources import CONF_DIR, RECIPES_DIR

# Groups a user picks with `+GROUP=...` (presets) or that are Hydra's own are listed apart.
_NOT_STACK_GROUPS = ("hydra", "recipe", "sweep")


def _defaults() -> dict[str, str]:
    chosen = {}
    for item in OmegaConf.load(CONF_DIR / "train.yaml").get("defaults", []):
        if isinstance(item, dict) or OmegaConf.is_dict(item):
            for group, option in dict(item).items():
                if not str(group).startswith("override"):
                    chosen[str(group)] = str(option)
    return chosen


def _options(folder) -> list[str]:
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def groups_help() -> str:
    """One line per group: its options, the default marked with *."""
    defaults = _defaults()
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in _NOT_STACK_GROUPS)
    width = max(map(len, groups + ["recipe", "+sweep"]))
    lines = ["config groups (GROUP=OPTION, * = default; any key: GROUP.KEY=VALUE):"]
    for group in groups:
        marked = [f"{o}*" if o == defaults.get(group) else o for o in _options(CONF_DIR / group)]
        lines.append(f"  {group:<{width}}  {', '.join(marked)}")
    lines.append(f"  {'recipe':<{width}}  {', '.join(_options(RECIPES_DIR))}")
    lines.append(f"  {'+sweep':<{width}}  {', '.join(_options(CONF_DIR / 'sweep'))}  (presets for -m)")
    lines.append("top-level keys: seed, force (start even when the plan says it does not fit), hardware.*")
    return "\n".join(lines)


def recipes_help() -> str:
    """The recipes, each with the first line of its header (what it is, the hardware it is sized for)."""
    lines = ["recipes:"]
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        about = next((ln[2:].strip() for ln in path.read_text().splitlines()[1:] if ln.startswith("# ")), "")
        lines.append(f"  {path.stem:<22}  {about}")
    return "\n".join(lines)


def hydra_help(usage: str, flags: str = "") -> str:
    parts = [usage.strip(), "", groups_help(), ""]
    if flags:
        parts += [flags.strip(), ""]
    parts += [
        "Hydra flags: -m/--multirun (sweeps: GROUP=a,b KEY=1,2), --cfg job (print the composed config),",
        "  hydra.run.dir=DIR (the run dir), --hydra-help (Hydra's own help).",
    ]
    return "\n".join(parts)
