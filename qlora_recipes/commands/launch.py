"""`qlora launch RECIPE [overrides]`: a recipe on the hardware it is sized for, or its plan there.

    qlora launch llama2-70b-a100                       # checks the GPUs here, then trains
    qlora launch llama2-70b-a100 trainer.max_steps=100 data.path=my.jsonl
    qlora launch --plan llama3.1-70b-2x24gb            # the plan for the recipe's hardware node
    qlora launch --dry-run llama3.1-405b-8xa100        # print the command it would run

`make RECIPE` and `make plan-RECIPE` call this. The recipe's `hardware` node (GPUs per node,
memory per GPU, nodes, host RAM) decides: with too few or too small GPUs it stops with one line
and starts nothing; one process runs `python -m qlora_recipes train recipe=NAME ...`; several run
`accelerate launch --config_file launch/accelerate/<strategy>.yaml` (or `torchrun` with
dist.launcher=torchrun), all ranks writing one run dir. Multi-node: run the same command on every
node with MASTER_ADDR and NODE_RANK set. Bad input exits 2 with `error: ...`; `--plan --check`
exits 1 when the plan does not fit.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..cli import ArgumentParser, run_plain
from ..schema import compose
from .helptext import recipes_help


def plan(recipe: str, overrides: list[str], check: bool) -> int:
    from .. import devices, planner

    cfg = compose([f"recipe={recipe}", *overrides])
    result = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    path = planner.write_plan(result, Path("runs") / "plans" / recipe)
    print(f"recipe {recipe}: planned for {devices.describe(cfg)}, {devices.ranks(cfg)} rank(s)")
    print(planner.render_table(result))
    print(f"plan: {path}")
    return 1 if check and not result["fits"] else 0


def launch(recipe: str, overrides: list[str], dry_run: bool) -> int:
    from .. import devices, dist, planner
    from ..validate import validate

    cfg = compose([f"recipe={recipe}", *overrides])
    gpus_here = devices.detect_gpus()
    if not dry_run:
        devices.check_hardware_here(cfg, recipe, gpus_here)
    ranks = devices.ranks(cfg)
    validate(cfg, gpu_available=bool(gpus_here) or (dry_run and cfg.hardware.gpus > 0), world_size=ranks)
    if not dry_run:  # refuse before any rank starts, as train would in every rank
        planner.refuse_unless_fits(planner.plan(cfg, gpus=gpus_here or None, world_size=ranks), force=cfg.force)
    cmd = dist.launch_command(cfg, recipe, overrides)
    print(" ".join(cmd), flush=True)
    if dry_run:
        return 0
    os.execv(cmd[0], cmd)
    return 0  # not reached


def run(argv: list[str], prog: str = "qlora launch") -> None:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1], epilog=recipes_help())
    parser.add_argument("--plan", action="store_true", help="print the plan for the recipe's hardware; train nothing")
    parser.add_argument("--check", action="store_true", help="with --plan: exit 1 when the plan does not fit")
    parser.add_argument("--dry-run", action="store_true", help="print the command it would run; start nothing")
    parser.add_argument("recipe", nargs="?", help="a recipe from recipes/ (its name, or recipes/NAME.yaml)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for qlora train")

    def launch_run() -> int:
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")
        args, unknown = parser.parse_known_args(argv)  # overrides such as +foo=1 pass through to Hydra
        if not args.recipe or "=" in args.recipe or args.recipe.startswith("-"):
            parser.error("name a recipe from recipes/ first")
        recipe = args.recipe.removesuffix(".yaml").split("/")[-1]
        overrides = [*args.overrides, *unknown]
        if args.plan:
            return plan(recipe, overrides, args.check)
        return launch(recipe, overrides, args.dry_run)

    run_plain(launch_run)
