"""`qlora plan [--gpus ...] [overrides]`: the memory plan of a stack, before loading anything.

Does it fit, and what to change if not. Takes the same overrides as `qlora train`, prints the plan
as a table and writes plan.json into the run dir. Needs no GPU and no network.
"""

from __future__ import annotations

import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..config.loader import register_schemas, to_typed
from ..config.schema import TrainConfig
from ..errors import UserError
from ..resources import CONF_DIR
from . import runner
from .helptext import hydra_help, quiet_when_the_reader_goes

register_schemas()
_STARTED = time.perf_counter()
_HARDWARE: dict = {}
_RESULT: dict = {}
USAGE = """usage: qlora plan [--gpus SIZES] [--host-ram SIZE] [--check] [--longest-seq|--fastest] [KEY=VALUE ...]
       (also: python scripts/plan.py ..., make plan ARGS='...', make plan-RECIPE)

  qlora plan recipe=llama2-70b-a100
  qlora plan model=llama3.1-8b quant=nf4 trainer.seq_len=4096
  qlora plan --gpus 2x40GiB --host-ram 256GiB offload=cpu model=llama2-70b     plan for hardware you name"""
FLAGS = """flags:
  --gpus SIZES     the GPUs to plan for (env QLORA_PLAN_GPUS): 80GB, 2x80GiB, 24GB,24GB, none, or cards (H100,
                   2xA100-40GB: plus a step's time); default: this machine's, else the recipe's hardware node
  --host-ram SIZE  host RAM to plan with, e.g. 256GiB (env QLORA_PLAN_HOST_RAM); default: this machine's
  --check          exit 1 when the plan does not fit (0 otherwise; 2 on bad input)
  --longest-seq    also print the longest trainer.seq_len that fits; --fastest: the fastest stack that fits"""
DOC_SECTIONS = ("Planning a stack", "The groups and their options")  # pages: helptext.DOCS_PAGES


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
    from ..config.devices import parse_gpu_cards
    from ..units import GiB, parse_bounded_size

    gpus = _take_flag(argv, "--gpus") or os.environ.get("QLORA_PLAN_GPUS")
    ram = _take_flag(argv, "--host-ram") or os.environ.get("QLORA_PLAN_HOST_RAM")
    out: dict = {}
    for flag in ("--check", "--longest-seq", "--fastest"):
        out[flag.strip("-").split("-")[0]] = flag in argv
        if flag in argv:
            argv.remove(flag)
    if gpus is not None:
        cards = parse_gpu_cards(gpus)  # a named card (--gpus H100) also gives the plan its time
        out["gpus"], out["cards"] = [size for size, _ in cards], [card for _, card in cards]
    if ram is not None:
        out["host_ram"] = parse_bounded_size(ram, "--host-ram", GiB, 2**46)  # 1 GiB to 64 TiB
    return out


def hardware_to_plan(cfg: TrainConfig) -> tuple[list[int] | None, int | None, str]:
    """--gpus / --host-ram when given; else this machine's GPUs; else, on a machine without GPU,
    the recipe's hardware node when it names GPUs (what the recipe is sized for); else the CPU."""
    from ..config import devices
    from ..units import GiB

    gpus, host_ram = _HARDWARE.get("gpus"), _HARDWARE.get("host_ram")
    if gpus is not None:
        cards = _HARDWARE.get("cards") or [None] * len(gpus)  # a named card says its name (--gpus H100)
        each = [f"{c.name if c else ''} {g / GiB:.1f} GiB".strip() for c, g in zip(cards, gpus, strict=True)]
        return gpus, host_ram, "--gpus " + (", ".join(each) or "none")
    here = devices.detect_gpus()
    if here:
        return None, host_ram, f"this machine's {len(here)} GPU(s)"  # None: the planner detects them
    if cfg.hardware.gpus > 0:
        return (
            devices.declared_gpus(cfg),
            host_ram or devices.declared_host_ram(cfg),
            f"hardware node, {devices.describe(cfg)}",
        )
    return None, host_ram, "this machine's CPU (no GPU here; declare GPUs with --gpus)"


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with quiet_when_the_reader_goes():  # `qlora plan | head -3`: Hydra would add its own error line
        plan_and_print(cfg)


def plan_and_print(composed: DictConfig) -> None:
    """Check the stack as `qlora train` does (config/checks.py), then plan it and print the plan."""
    from .. import planner
    from ..config import devices
    from ..config.checks import check_stack
    from ..planner import timeplan

    started = time.perf_counter()
    try:
        cfg = to_typed(composed)
        check_stack(cfg)
        cards = _HARDWARE.get("cards") or []
        if cards and all(c is not None and not c.bf16 for c in cards):
            cfg.hardware.bf16 = False  # --gpus T4 / V100: precision=auto plans fp16, as it runs there
        gpus, host_ram, planned_for = hardware_to_plan(cfg)
        chosen = devices.precision_line(cfg, gpus)  # precision=auto as it picks on the hardware planned for
        plan = planner.plan(cfg, gpus=gpus, host_ram=host_ram)  # one rank's share under FSDP / ZeRO-3
        vllm = planner.report.vllm_note(cfg.peft.modules_to_save)  # said now, not when serving
        plan["notes"] += [vllm] if vllm else []
        plan["time"] = timeplan.time_section(cfg, plan, cards, gpus or [])
    except UserError as err:  # here, not in cli.run: Hydra would add its own "Error executing job" line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    plan_s = time.perf_counter() - started
    path = planner.write_plan(plan, HydraConfig.get().runtime.output_dir)
    print(f"planned for: {planned_for}")
    if chosen:
        print(chosen)
    print(planner.render_table(plan))
    if not (cfg.data.packing or "seq_len_auto" in plan):  # no data read: rows planned at their longest
        print(planner.upper_bound_note(int(cfg.trainer.seq_len)))
    for line in timeplan.time_lines(plan["time"]):
        print(line)
    print(f"plan: {path}  (planned in {plan_s:.2f} s, {time.perf_counter() - _STARTED:.2f} s since start)")
    _RESULT["fits"] = plan["fits"]
    if _HARDWARE["longest"]:
        longest = planner.longest_seq_len(cfg, gpus=gpus, host_ram=host_ram)
        fit = f"trainer.seq_len={longest}" if longest else "none (not even 64 tokens fit)"
        grpo = cfg.objective.name == "grpo" and longest  # its seq_len bounds the prompt
        sampled = f"; prompts, each completion up to {cfg.objective.max_completion_length} tokens more" if grpo else ""
        print(f"longest sequence that fits {planned_for}: {fit} (micro-batch {cfg.trainer.micro_batch_size}{sampled})")
    if _HARDWARE["fastest"]:
        found = planner.fastest_stack(cfg, gpus=gpus, host_ram=host_ram)
        for line in planner.fastest.fastest_lines(found, planned_for, planner.model_figures(cfg.model).num_layers):
            print(line)


@quiet_when_the_reader_goes()
def run(argv: list[str], prog: str = "qlora plan") -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(hydra_help(USAGE, FLAGS, sections=DOC_SECTIONS))
        sys.exit(0)
    argv = list(argv)
    try:
        _HARDWARE.update(parse_hardware_flags(argv))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [prog, *argv]
    runner.run(main)
    sys.exit(1 if _HARDWARE["check"] and _RESULT.get("fits") is False else 0)
