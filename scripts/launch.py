"""Start a recipe on the hardware it is sized for, or show its memory plan for that hardware.

    python scripts/launch.py llama70b-a100                 # checks the GPUs here, then trains
    python scripts/launch.py llama70b-a100 trainer.max_steps=100 data.path=my.jsonl
    python scripts/launch.py --plan llama3-70b-2x24gb      # the plan for the recipe's hardware node
    python scripts/launch.py --dry-run llama3-405b-8xa100  # print the command it would run

`make <recipe>` and `make plan-<recipe>` call this. The recipe's `hardware` node (GPUs per node,
memory per GPU, nodes, host RAM) decides: with too few or too small GPUs it stops with one line and
starts nothing; one process runs `python train.py recipe=NAME ...`; several run
`accelerate launch --config_file launch/accelerate/<strategy>.yaml` (or `torchrun` with
dist.launcher=torchrun), all ranks writing one run dir. Multi-node: run the same command on every
node with MASTER_ADDR and NODE_RANK set. Bad input exits 2 with `error: ...`; `--plan --check`
exits 1 when the plan does not fit.
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qlora_recipes.errors import UserError  # noqa: E402

USAGE = "usage: scripts/launch.py [--plan [--check]] [--dry-run] RECIPE [overrides ...]"


def compose(recipe: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from qlora_recipes import cli
    from qlora_recipes.schema import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=[f"recipe={recipe}", *overrides])
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(cli.one_line(err)) from None


def plan(recipe: str, overrides: list[str], check: bool) -> int:
    from qlora_recipes import dist, memory

    cfg = compose(recipe, overrides)
    result = dist.plan_stack(cfg, gpus=dist.declared_gpus(cfg), host_ram=dist.declared_host_ram(cfg))
    path = memory.write_plan(result, REPO / "runs" / "plans" / recipe)
    print(f"recipe {recipe}: planned for {dist.describe(cfg)}, {dist.ranks(cfg)} rank(s)")
    print(memory.render_table(result))
    print(f"plan: {path}")
    return 1 if check and not result["fits"] else 0


def launch(recipe: str, overrides: list[str], dry_run: bool) -> int:
    from qlora_recipes import devices, dist, memory
    from qlora_recipes.validate import validate

    cfg = compose(recipe, overrides)
    gpus_here = devices.detect_gpus()
    if not dry_run:
        dist.check_hardware_here(cfg, recipe, gpus_here)
    ranks = dist.ranks(cfg)
    validate(cfg, gpu_available=bool(gpus_here) or (dry_run and cfg.hardware.gpus > 0), world_size=ranks)
    if not dry_run:  # refuse before any rank starts, as train.py would in every rank
        memory.refuse_unless_fits(dist.plan_stack(cfg, gpus=gpus_here or None, world_size=ranks), force=cfg.force)
    cmd = dist.launch_command(cfg, recipe, overrides)
    print(" ".join(cmd), flush=True)
    if dry_run:
        return 0
    os.chdir(REPO)  # accelerate configs name the DeepSpeed json relative to the repo root
    os.execv(cmd[0], cmd)
    return 0  # not reached


def main(argv: list[str]) -> int:
    flags = {a for a in argv if a in ("--plan", "--check", "--dry-run", "-h", "--help")}
    rest = [a for a in argv if a not in flags]
    if "-h" in flags or "--help" in flags:
        print(__doc__)
        return 0
    if not rest or rest[0].startswith("-") or "=" in rest[0]:
        raise UserError(f"name a recipe from recipes/ first; {USAGE}")
    recipe, overrides = rest[0].removesuffix(".yaml").split("/")[-1], rest[1:]
    if "--plan" in flags:
        return plan(recipe, overrides, "--check" in flags)
    return launch(recipe, overrides, "--dry-run" in flags)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
