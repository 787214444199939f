"""Memory plan of a stack, before loading anything: does it fit, and what to change if not.

    python scripts/plan.py recipe=llama70b-a100
    python scripts/plan.py model=llama3.1-8b quant=nf4 trainer.seq_len=4096
    python scripts/plan.py --gpus 80GB model=llama2-70b trainer=standard     # plan for declared GPUs
    python scripts/plan.py --gpus 2x40GiB --host-ram 256GiB offload=cpu model=llama2-70b

Takes the same overrides as train.py (Hydra, conf/train.yaml), prints the plan as a table and
writes plan.json into the run dir. `--gpus` (or QLORA_PLAN_GPUS) describes the GPUs to plan for
(sizes like 80GB, 80GiB, 2x80GB, comma-separated; `none` for CPU only); by default the GPUs this
machine has; on a machine without GPU the recipe's `hardware` node when it names GPUs, else the CPU. `--host-ram` (or QLORA_PLAN_HOST_RAM) sets host RAM
(default: this machine's). Exit status: 0 with a plan (fits or not; `--check` makes a plan that
does not fit exit 1), 2 on bad input. Needs no GPU and no network.
"""

import os
import sys
import time
from pathlib import Path

_STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from qlora_recipes.errors import UserError  # noqa: E402
from qlora_recipes.schema import register_schemas  # noqa: E402

register_schemas()
_HARDWARE: dict = {}
_RESULT: dict = {}


def _take_flag(argv: list[str], name: str) -> str | None:
    """Remove `--name VALUE` / `--name=VALUE` from argv (before Hydra sees it); return VALUE."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise UserError(f"{name} needs a value, e.g. {name} 80GB")
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return None


def parse_hardware_flags(argv: list[str]) -> dict:
    from qlora_recipes.devices import parse_gpus
    from qlora_recipes.units import parse_size

    gpus = _take_flag(argv, "--gpus") or os.environ.get("QLORA_PLAN_GPUS")
    ram = _take_flag(argv, "--host-ram") or os.environ.get("QLORA_PLAN_HOST_RAM")
    out: dict = {"check": False}
    if "--check" in argv:
        argv.remove("--check")
        out["check"] = True
    if gpus is not None:
        out["gpus"] = parse_gpus(gpus)
    if ram is not None:
        out["host_ram"] = parse_size(ram, "--host-ram")
        if out["host_ram"] <= 0:
            raise UserError(f"--host-ram {ram}: must be positive, e.g. 256GiB")
    return out


def hardware_to_plan(cfg: DictConfig) -> tuple[list[int] | None, int | None, str]:
    """--gpus / --host-ram when given; else this machine's GPUs; else, on a machine without GPU,
    the recipe's hardware node when it names GPUs (what the recipe is sized for); else the CPU."""
    from qlora_recipes import devices
    from qlora_recipes.units import GiB

    gpus, host_ram = _HARDWARE.get("gpus"), _HARDWARE.get("host_ram")
    if gpus is not None:
        return gpus, host_ram, "--gpus " + (", ".join(f"{g / GiB:.1f} GiB" for g in gpus) or "none")
    here = devices.detect_gpus()
    if here:
        return None, host_ram, f"this machine's {len(here)} GPU(s)"  # None: the planner detects them
    hw = cfg.get("hardware")
    if hw is not None and int(hw.get("gpus", 0) or 0) > 0:
        from qlora_recipes import dist

        return dist.declared_gpus(cfg), host_ram or dist.declared_host_ram(cfg), f"hardware node, {dist.describe(cfg)}"
    return None, host_ram, "this machine's CPU (no GPU here; declare GPUs with --gpus)"


def planner():
    """dist.plan_stack (one rank's share under FSDP / ZeRO-3) where the package has it."""
    try:
        from qlora_recipes import dist

        return dist.plan_stack
    except ImportError:  # pragma: no cover
        from qlora_recipes import memory

        return memory.plan_stack


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from qlora_recipes import memory

    started = time.perf_counter()
    try:
        gpus, host_ram, planned_for = hardware_to_plan(cfg)
        plan = planner()(cfg, gpus=gpus, host_ram=host_ram)
    except UserError as err:  # here, not in cli.run: Hydra would add its own "Error executing job" line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    plan_s = time.perf_counter() - started
    path = memory.write_plan(plan, HydraConfig.get().runtime.output_dir)
    print(f"planned for: {planned_for}")
    print(memory.render_table(plan))
    print(f"plan: {path}  (planned in {plan_s:.2f} s, {time.perf_counter() - _STARTED:.2f} s since start)")
    _RESULT["fits"] = plan["fits"]


def run() -> None:
    try:
        _HARDWARE.update(parse_hardware_flags(sys.argv))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from qlora_recipes import cli

    cli.run(main)
    sys.exit(1 if _HARDWARE["check"] and _RESULT.get("fits") is False else 0)


if __name__ == "__main__":
    run()
