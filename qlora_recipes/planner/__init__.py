"""The memory planner: does a QLoRA stack fit the devices it will run on, and what to change if not.

`plan(cfg)` turns a composed config into a plan (the content of `plan.json`) for one rank: bytes
per component and device, each device's budget, peak and headroom, the layer-to-device map the
loader will build, and a ladder of overrides, cheapest first, that make a stack fit. It needs no
GPU, no network and no model weights: architecture figures come from the model option file or a
local `config.json`. The one-device path is pure arithmetic and never imports torch; only a plan
with `offload.device_map` set builds a meta-device model to ask the loader's own device-map
inference where each layer goes. Rooms: figures (model figures, blocks), spec (the stack as
numbers), components (bytes per component), loss (TRL's fused LM head, eval, the generation
metric), placement (device map, max_memory), peaks (phases, pressure, the allocated peak), single
(one process), sharded (one rank under FSDP / ZeRO-3), ladder, report.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..config import devices as _dev
from ..config.adapters import settled
from ..config.loader import precision_for
from . import evalbatch, fastest
from .figures import model_figures
from .ladder import ladder_rungs, offload_params_rungs
from .loss import with_metric
from .peaks import ok
from .placement import loader_max_memory
from .process import measured_start
from .report import DoesNotFit, refuse_unless_fits, render_table, write_plan
from .search import longest_seq_len as _longest_seq_len
from .seqlen import (
    auto_cap,
    data_length,
    data_note,
    is_auto,
    plan_note,
    positions,
    refuse_completions_past_positions,
    refuse_past_positions,
    resolve_auto,
    upper_bound_note,
    with_seq_len,
)
from .sharded import CPU_RANKS, SHARDED, plan_cpu_rank, plan_sharded
from .single import plan_single
from .spec import spec_from_cfg
from .vision import settle_images

if TYPE_CHECKING:
    from ..config.schema import TrainConfig

log = logging.getLogger(__name__)

__all__ = [
    "DoesNotFit",
    "fastest_stack",
    "loader_max_memory",
    "longest_seq_len",
    "measured_start",
    "model_figures",
    "plan",
    "positions",
    "refuse_unless_fits",
    "render_table",
    "seq_len_for_data",
    "settle_batch",
    "settle_eval_batch",
    "settle_for_data",
    "upper_bound_note",
    "write_plan",
]


def plan(
    cfg: TrainConfig,
    gpus: list[int] | None = None,
    host_ram: int | None = None,
    world_size: int | None = None,
    ladder: bool = True,
) -> dict:
    """Plan a composed config for one rank of `dist.strategy` on the devices it will run on.

    `gpus`: total bytes of each GPU to plan for (default: this machine's GPUs, or its CPU when it
    has none); `host_ram`: bytes (default: this machine's); `world_size`: ranks (default:
    WORLD_SIZE, else the recipe's GPUs x nodes). A plan holds a full replica per GPU (one process,
    DDP, ZeRO-2); under FSDP / ZeRO-3 the parameters are sharded across `world_size` ranks. Without
    GPUs, several ranks of dist=ddp|fsdp|zero2|zero3 are CPU processes (gloo): the plan is one
    rank process's (sharded.plan_cpu_rank). precision=auto is planned as it picks on those devices
    (config/loader.precision_for). On a CPU, inside `measured_start` (a run), the process baseline
    is the run's own start RSS plus what follows it (planner/process.py), else the stated constant.
    trainer.seq_len=auto is planned at the most it resolves to (planner/seqlen.py).
    Returns the plan.json dict.
    """
    refuse_past_positions(cfg)
    refuse_completions_past_positions(cfg)
    if is_auto(cfg):  # no data read here: the upper bound, and a note saying so
        cap, why = auto_cap(cfg, _planner(gpus, host_ram, world_size), lambda: longest_seq_len(cfg, gpus, host_ram))
        result = plan(with_seq_len(cfg, cap), gpus, host_ram, world_size, ladder)
        result.setdefault("notes", []).append(plan_note(cap, why))
        result["seq_len_auto"] = {"cap": cap, "why": why}
        return result
    if fastest.is_auto(cfg):  # checkpointing / micro-batch auto: the fastest that fits (planner/fastest.py)
        auto = fastest.resolve(cfg, _planner(gpus, host_ram, world_size), model_figures(cfg.model).num_layers)
        result = plan(
            fastest.with_batch(cfg, auto.checkpointing, auto.micro, auto.accum), gpus, host_ram, world_size, ladder
        )
        result.setdefault("notes", []).extend(auto.lines)
        result["batch_auto"] = {**auto.overrides(), "why": auto.lines}
        return result
    if evalbatch.is_auto(cfg):  # the most eval rows whose evaluation needs no more than training
        rows, why = evalbatch.resolve(cfg, _planner(gpus, host_ram, world_size))
        result = plan(evalbatch.with_eval_batch(cfg, rows), gpus, host_ram, world_size, ladder)
        result.setdefault("notes", []).append(why)
        result["eval_batch_auto"] = {"rows": rows, "why": why}
        return result
    cfg = precision_for(cfg, gpus)  # precision=auto as it picks on the GPUs planned for
    strategy = cfg.dist.strategy
    if world_size is None:
        env_ws = int(os.environ.get("WORLD_SIZE", "0") or 0)
        world_size = env_ws or _dev.ranks(cfg)
    st = with_metric(spec_from_cfg(cfg, world_size), cfg.data)
    hw = _dev.hardware(gpus, host_ram)
    base = plan_single(st, hw)
    if not hw.has_gpu and strategy in CPU_RANKS and world_size > 1:  # rank processes on CPU (gloo)
        return plan_cpu_rank(base, st, cfg.dist, world_size, host_ram)
    if strategy not in SHARDED or world_size <= 1:
        if ladder:
            base["ladder"] = ladder_rungs(st, hw, base) if not ok(base) else []
        base["dist"] = {"strategy": strategy, "world_size": world_size}
        return base
    gpus_here = len(gpus) if gpus is not None else len(_dev.detect_gpus())
    per_node = max(1, min(world_size, gpus_here or world_size))  # ranks sharing one host's RAM
    offload = bool(cfg.dist.offload_params)
    result = plan_sharded(base, st, cfg.dist, world_size, per_node, offload=offload, host_ram=host_ram)
    if ladder and not result["fits"] and not offload and strategy == "fsdp":
        result["ladder"] = offload_params_rungs(base, st, cfg.dist, world_size, per_node, host_ram)
    return result


def longest_seq_len(
    cfg: TrainConfig, gpus: list[int] | None = None, host_ram: int | None = None, granularity: int = 64
):
    """The longest trainer.seq_len (a multiple of `granularity`) at which the stack fits, or None."""
    return _longest_seq_len(cfg, plan, gpus, host_ram, granularity)


def _planner(gpus: list[int] | None, host_ram: int | None, world_size: int | None):
    return lambda c: plan(c, gpus, host_ram, world_size, ladder=False)


def fastest_stack(cfg: TrainConfig, gpus: list[int] | None = None, host_ram: int | None = None):
    """(overrides, relative step time, plan) of the fastest stack that fits (planner/fastest.py), or None."""
    from ..config.checks import check_stack
    from ..errors import UserError

    def allowed(trial: TrainConfig) -> bool:
        try:
            check_stack(trial)
            return True
        except UserError:
            return False

    layers = model_figures(cfg.model).num_layers
    cfg = settled(precision_for(cfg, gpus))  # adapter_dtype=auto as planned: bf16 adapters are no step to add
    return fastest.fastest_stack(cfg, _planner(gpus, host_ram, None), layers, allowed)


def settle_batch(cfg: TrainConfig, first_plan: dict) -> TrainConfig:
    """cfg with trainer.gradient_checkpointing / micro_batch_size=auto resolved as `first_plan` resolved them
    (their lines logged); otherwise as it was."""
    if not fastest.is_auto(cfg):
        return cfg
    auto = first_plan["batch_auto"]
    for line in auto["why"]:
        log.info("%s", line)
    return fastest.with_batch(
        cfg, auto["trainer.gradient_checkpointing"], auto["trainer.micro_batch_size"], auto["trainer.grad_accum"]
    )


def seq_len_for_data(cfg: TrainConfig, first_plan: dict):
    """What data.load_splits takes as seq_len: the number, or with trainer.seq_len=auto a function of the
    train rows' token lengths (and their source) that resolves it, capped as `first_plan` was planned,
    and logs the one line saying why."""
    if not is_auto(cfg):
        return cfg.trainer.seq_len
    auto = first_plan["seq_len_auto"]

    def resolve(lengths, source: str) -> int:
        value, line = resolve_auto(lengths, cfg.trainer.seq_len_percentile, auto["cap"], auto["why"], source)
        log.info("%s", line)
        return value

    return resolve


def settle_eval_batch(cfg: TrainConfig, first_plan: dict) -> TrainConfig:
    """cfg with trainer.eval_batch_size=auto resolved as `first_plan` resolved it (the line saying
    why is logged); otherwise as it was."""
    if not evalbatch.is_auto(cfg):
        return cfg
    auto = first_plan["eval_batch_auto"]
    log.info("%s", auto["why"])
    return evalbatch.with_eval_batch(cfg, auto["rows"])


def settle_for_data(
    cfg: TrainConfig, first_plan: dict, data_stats: dict, gpus: list[int] | None = None, host_ram: int | None = None
) -> tuple:
    """(cfg, plan) once the data is tokenized, on the devices and host RAM the first plan had: trainer.seq_len=auto resolved to what the rows gave
    (data_stats["seq_len"]), data.images_per_row=auto to the most images a row holds (planner/vision.py),
    and the plan made for the batches the rows really make - their longest row when shorter than seq_len
    (planner/seqlen.py), an eval batch of the eval split's rows when it holds fewer than
    trainer.eval_batch_size (planner/evalbatch.py) - else as planned before the data: `first_plan` itself
    where no input differs (seq_len=auto resolved to the cap it was planned at), a plan made again where
    one does."""
    settled = with_seq_len(cfg, data_stats["seq_len"]) if is_auto(cfg) else cfg
    settled, images = settle_images(settled, data_stats)  # data.images_per_row=auto: the rows' most
    if images:
        log.info("%s", images)
    longest = data_length(settled, data_stats.get("max_tokens"))
    eval_rows = evalbatch.rows_for_data(settled, int((data_stats.get("rows") or {}).get("eval") or 0))
    if longest is None and eval_rows is None and images is None:
        return settled, (first_plan if _planned_alike(cfg, settled, first_plan) else plan(settled, gpus, host_ram))
    planned, notes = settled, [images] if images else []
    if longest is not None:
        planned = with_seq_len(planned, longest)
        notes.append(data_note(longest, int(settled.trainer.seq_len)))
    if eval_rows is not None:
        planned = evalbatch.with_eval_batch(planned, eval_rows)
        notes.append(evalbatch.data_note(eval_rows, int(settled.trainer.eval_batch_size)))
    result = plan(planned, gpus, host_ram)
    result.setdefault("notes", []).extend(notes)
    if longest is not None:
        result["data_longest_row"] = longest
    if eval_rows is not None:
        result["data_eval_rows"] = eval_rows
    return settled, result


def _planned_alike(cfg: TrainConfig, settled: TrainConfig, first_plan: dict) -> bool:
    """Whether `first_plan` is already the plan of `settled`: nothing settled, or only trainer.seq_len=auto,
    to exactly the cap the first plan was planned at."""
    if settled is cfg:
        return True
    cap = (first_plan.get("seq_len_auto") or {}).get("cap")
    return is_auto(cfg) and cap is not None and int(settled.trainer.seq_len) == int(cap)
