"""`qlora launch RECIPE [overrides]`: a recipe on the hardware it is sized for, or its plan there.

    qlora launch llama2-70b-a100                       # checks the GPUs here, then trains
    qlora launch llama2-70b-a100 trainer.max_steps=100 data.path=my.jsonl
    qlora launch --plan llama3.1-70b-2x24gb            # the plan for the recipe's hardware node
    qlora launch --dry-run llama3.1-405b-8xa100        # print the command it would run
    qlora launch --cpu llama3.1-70b-2x24gb model=tiny data=order trainer=smoke   # its ranks on CPU

`make RECIPE` and `make plan-RECIPE` call this. The recipe's `hardware` node (GPUs per node,
memory per GPU, nodes, host RAM) decides: with too few or too small GPUs it stops with one line
and starts nothing; one process runs `python -m qlora_recipes train recipe=NAME ...`; several run
`accelerate launch --config_file launch/accelerate/<strategy>.yaml` (or `torchrun` with
dist.launcher=torchrun), all ranks writing one run dir. Multi-node: run the same command on every
node with MASTER_ADDR and NODE_RANK set. `--cpu` starts the same ranks on this machine's CPU
(gloo): the recipe's stack with a small model, end to end, without GPUs. Bad input exits 2 with
`error: ...`; `--plan --check` exits 1 when the plan does not fit.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config.loader import load
from ..invocation import LAUNCH_ENV
from .helptext import docs_pointer, groups_help, quiet_when_the_reader_goes, recipes_help
from .runner import ArgumentParser, run_plain

USAGE = """usage: qlora launch [--plan [--check] | --dry-run | --cpu] RECIPE [GROUP=OPTION ...] [GROUP.KEY=VALUE ...]
       (also: make RECIPE ARGS='...', make plan-RECIPE)

  qlora launch llama2-70b-a100 trainer.max_steps=100  checks the GPUs here, then trains
  qlora launch --plan llama3.1-70b-2x24gb             the plan for the recipe's hardware node
  qlora launch --cpu llama3.1-70b-2x24gb model=tiny data=order trainer=smoke    its ranks on this CPU
flags:
  --plan     the plan for the recipe's hardware node, training nothing (--check: exit 1 if it does not
             fit; for GPUs you name: qlora plan --gpus SIZES recipe=NAME)
  --dry-run  print the command it would run (accelerate or torchrun for several GPUs); start nothing
  --cpu      the recipe's ranks on this machine's CPU over gloo: its launcher and trainer path, no GPU"""
DOC_SECTIONS = ("Recipes", "Multi-GPU")


def help_text() -> str:
    """Short: the flags, the recipes, the groups the overrides after RECIPE pick from."""
    overrides = "overrides after RECIPE: as for qlora train (its --help lists the common ones); " + groups_help()
    return "\n".join([USAGE, "", recipes_help(), "", overrides, docs_pointer(*DOC_SECTIONS)])


def plan(recipe: str, overrides: list[str], check: bool) -> int:
    from .. import planner
    from ..config import devices

    cfg = load([f"recipe={recipe}", *overrides])
    chosen = devices.precision_line(cfg, devices.declared_gpus(cfg))  # precision=auto on the recipe's GPUs
    result = planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))
    path = planner.write_plan(result, Path("runs") / "plans" / recipe)
    print(f"recipe {recipe}: planned for {devices.describe(cfg)}, {devices.ranks(cfg)} rank(s)")
    if chosen:
        print(chosen)
    print(planner.render_table(result))
    print(f"plan: {path}")
    return 1 if check and not result["fits"] else 0


def launch(recipe: str, overrides: list[str], dry_run: bool, cpu: bool = False, prog: str = "qlora launch") -> int:
    """`cpu`: the recipe's ranks (one per GPU it declares) as CPU processes over gloo, through the
    same launcher, launch/ configs and trainer path; the GPUs are hidden from them. The ranks learn
    this command (invocation.LAUNCH_ENV): the resume line they print starts the same ranks again."""
    from .. import planner
    from ..config import devices
    from ..run import dist
    from ..run.validate import validate

    cfg = load([f"recipe={recipe}", *overrides])  # precision=auto: each rank picks on its own device
    gpus_here = [] if cpu else devices.detect_gpus()
    if not dry_run and not cpu:
        devices.check_hardware_here(cfg, recipe, gpus_here)
    ranks = devices.ranks(cfg)
    gpu = not cpu and (bool(gpus_here) or (dry_run and cfg.hardware.gpus > 0))
    validate(cfg, gpu_available=gpu, world_size=ranks)
    if not dry_run:  # refuse before any rank starts, as train would in every rank
        # CPU ranks of FSDP / ZeRO-3 are planned as one whole replica each (as training.py does)
        ws = 1 if cpu and cfg.dist.strategy in planner.SHARDED else ranks
        plan = planner.plan(cfg, gpus=[] if cpu else (gpus_here or None), world_size=ws)
        planner.refuse_unless_fits(plan, force=cfg.force)
    cmd = dist.launch_command(cfg, recipe, overrides)
    if not dry_run and ranks > 1:
        _check_before_ranks(cfg, cmd, ranks)
    print(("CUDA_VISIBLE_DEVICES= " if cpu else "") + " ".join(cmd), flush=True)
    if dry_run:
        return 0
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    launcher = f"python {prog}" if prog.endswith(".py") else prog
    os.environ[LAUNCH_ENV] = f"{launcher} --cpu" if cpu else launcher
    if ranks <= 1:
        os.execv(cmd[0], cmd)
    from ..run.ranks import start

    return start(cmd)  # a failed rank: its own line and exit code, not the launcher's report


def _run_dir(cmd: list[str]) -> Path | None:
    """The run dir the command gives its ranks (hydra.run.dir), when it is a plain path."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given = [a for a in cmd if a.lstrip("+").startswith("hydra.run.dir=")]
    value = OverridesParser.create().parse_override(given[-1].lstrip("+")).value() if given else None
    return Path(value) if isinstance(value, str) and "${" not in value else None


def _check_before_ranks(cfg, cmd: list[str], ranks: int) -> None:
    """What every rank checks before it loads anything, checked once here, before any rank starts
    (one line, exit 2): the data files, the model dir, a run already in the run dir, and the
    checkpoint a resume continues (trained on as many ranks). The ranks check it all again."""
    from ..data.readers import check_data_sources
    from ..model.check import check_hub_model, validate_model
    from ..run.resume import AlreadyComplete, resume_checkpoint
    from ..run.reuse import ASIDE, refuse_silent_reuse

    check_data_sources(cfg.data)
    check_hub_model(cfg.model)
    validate_model(cfg)
    run_dir = _run_dir(cmd)
    if run_dir is None or not run_dir.is_dir() or (run_dir / ASIDE).exists():  # an interrupted overwrite: rank 0's
        return
    refuse_silent_reuse(cfg, run_dir)
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ranks)  # the ranks' own, which a resume checks its checkpoint against
    notes = logging.getLogger(resume_checkpoint.__module__)
    level = notes.level
    notes.setLevel(logging.ERROR)  # its notes (a checkpoint skipped): rank 0 says them
    try:
        resume_checkpoint(cfg, run_dir)
    except AlreadyComplete:
        pass  # the ranks say so and end at once
    finally:
        notes.setLevel(level)
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before


@quiet_when_the_reader_goes()
def run(argv: list[str], prog: str = "qlora launch") -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1], epilog=recipes_help())
    parser.add_argument("--plan", action="store_true", help="print the plan for the recipe's hardware; train nothing")
    parser.add_argument("--check", action="store_true", help="with --plan: exit 1 when the plan does not fit")
    parser.add_argument("--dry-run", action="store_true", help="print the command it would run; start nothing")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="start the recipe's ranks on this machine's CPU (gloo, no GPU needed; one rank per GPU it declares): "
        "the same launcher and trainer path, to check a stack end to end with a small model, e.g. "
        "model=tiny data=order trainer=smoke",
    )
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
        return launch(recipe, overrides, args.dry_run, args.cpu, prog)

    run_plain(launch_run)
