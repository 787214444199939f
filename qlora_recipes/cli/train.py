"""`qlora train [overrides]` (also `python train.py`): compose a stack with Hydra and train it.

Hydra composes conf/train.yaml with the command-line overrides (`quant=nf4 peft.r=64`,
`recipe=NAME`, `-m` sweeps); `qlora_recipes.run.training.train` does the work. In a sweep one bad job
does not end the others: a stack the planner rejects is recorded as skipped, an error as error.

A single run writes nothing before its input is checked: the config checks and the data files'
presence run before torch is imported, the data and the model dir before config.yaml and plan.json,
and Hydra's own `.hydra/` files are written with them (`hydra.output_subdir=null`, then
`_save_hydra_files`). Bad input, or Ctrl-C before anything is written, removes the (empty) run dir
Hydra created for this run again.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import interrupts
from ..config.loader import one_line, to_typed
from ..errors import UserError
from ..invocation import resume_command, set_command
from . import runner
from .helptext import quiet_when_the_reader_goes

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("train")
USAGE = """usage: qlora train [GROUP=OPTION ...] [GROUP.KEY=VALUE ...]    (also: python train.py ...)

Fine-tunes the composed stack: validate -> plan memory -> load (4-bit, device map) -> LoRA ->
TRL SFTTrainer -> eval -> adapter + metrics.json in the run dir (runs/DATE/TIME).
  qlora train                                  the embedded default (tiny model, runs on CPU)
  qlora train quant=nf4 optim=paged8bit peft.r=64
  qlora train recipe=tiny-cpu                  a full stack from recipes/
  qlora train -m peft.r=4,8 optim=paged8bit,adamw8bit    a sweep: one job per combination
It trains on the GPUs it finds (none: the CPU). To plan a stack for GPUs you name, before renting
them: qlora plan --gpus 24GB [the same overrides]; a recipe on its hardware: qlora launch RECIPE."""
DOC_SECTIONS = ("Running", "Your own data", "The groups and their options")
# Flags with which Hydra prints something and runs no job: their output stays Hydra's own.
_NO_JOB_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc")


class _Launch:
    """What `run` knows before Hydra starts: when, and whether `.hydra/` waits for the checks."""

    started = 0.0
    deferred_hydra_files = False
    own_process = False  # this process runs this one command and exits (train.py, `qlora train`)


def main(cfg: DictConfig) -> float | None:
    """The Hydra task: check, then train; a user's mistake leaves as one line (runner.Stop)."""
    try:
        return _task(cfg)
    except runner.Stop as stop:
        if "SUBMITIT_FOLDER" not in os.environ:
            raise
        # a sweep job in a process of its own (hydra/launcher=local or slurm): no runner.run above it
        # here, and a Stop raised on would reach the job's log as a traceback. Its line and exit code,
        # as a single run's
        runner.exit_with(stop.message, stop.code)


def _task(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    fresh = _created_by_this_run(run_dir)
    if fresh and not multirun:  # a stop signal while starting leaves no empty run dir behind
        interrupts.before_exit_at_once(lambda: _discard(run_dir, fresh))
    if multirun and _Launch.deferred_hydra_files:
        _save_hydra_files(run_dir, cfg)  # a sweep summary reads every job's overrides, failed ones too
    if multirun:
        from ..integrations.sweep import clear_job_status

        clear_job_status(run_dir)
    try:
        return _checked_train(cfg, run_dir, hydra_cfg, multirun)
    except UserError as err:
        if multirun:
            return _record_failed_job(run_dir, err)
        _discard(run_dir, fresh)
        raise runner.Stop(f"error: {err}", 2) from None
    except KeyboardInterrupt as err:
        signame = interrupts.signal_name(err)
        raise runner.Stop(_interrupted(run_dir, fresh, hydra_cfg, signame), interrupts.exit_code(signame)) from None


def _checked_train(composed: DictConfig, run_dir: Path, hydra_cfg, multirun: bool) -> float | None:
    from omegaconf.errors import OmegaConfBaseException

    from ..data.readers import check_data_sources
    from ..planner.report import vllm_note
    from ..run.validate import check_config

    cfg = to_typed(composed)  # below here the typed config only
    check_config(cfg)  # the config alone, before torch and the rest are imported (about a second)
    check_data_sources(cfg.data)  # a data file missing: also one line before those imports
    vllm = vllm_note(cfg.peft.modules_to_save)  # what vLLM will not serve, said before training
    if vllm:
        log.warning(vllm)
    if cfg.dist.strategy in ("fsdp", "zero2", "zero3") and "LOCAL_RANK" not in os.environ:
        # transformers refuses later, after loading: "Using fsdp only works in distributed training"
        raise UserError(
            f"dist={cfg.dist.strategy} runs one process per rank and this is a single process: start it with "
            "`qlora launch RECIPE` or `torchrun --nproc_per_node N train.py ...`, or use dist=none"
        )
    if in_a_process_of_its_own(hydra_cfg, multirun):  # before TRL is imported: it imports every tracker installed
        from ..integrations import cluster, trackers

        trackers.leave_unused_unimported(cfg.logger)
        cluster.stop_with_local_controller()  # a signal that ends the job's controller stops this run too
    from ..run.preemption import Preempted, RankLost
    from ..run.training import train

    on_write = None if multirun or not _Launch.deferred_hydra_files else (lambda: _save_hydra_files(run_dir, composed))
    try:
        result = train(cfg, run_dir, dict(hydra_cfg.runtime.choices), on_write=on_write)
    except Preempted as stop:  # every rank stopped at that step: rank 0 says so, once
        line = _preempted_line(stop, hydra_cfg, run_dir) if int(os.environ.get("RANK", 0)) == 0 else ""
        raise runner.Stop(line, interrupts.exit_code(stop.signame)) from None
    except RankLost as lost:  # each surviving rank: one line, not the collective's traceback
        raise runner.Stop(_rank_lost_line(lost, hydra_cfg, run_dir), 1) from None
    except OmegaConfBaseException as err:
        raise UserError(one_line(err)) from None
    return result.get("eval_loss")  # the objective an Optuna sweep minimises


def in_a_process_of_its_own(hydra_cfg, multirun: bool) -> bool:
    """This process runs this one run and exits: train.py or `qlora train` without -m, or a sweep
    job that a submitit launcher (hydra/launcher=local or slurm) started in a process of its own
    (Hydra's basic launcher runs every job in one process)."""
    if not multirun:
        return _Launch.own_process
    return "submitit" in str(hydra_cfg.launcher.get("_target_", ""))


def _preempted_line(stop, hydra_cfg, run_dir: Path) -> str:
    """What a stop signal kept and how to go on: during training, the checkpoint at that step and
    the resume command; after it, the saved adapter and the command that evaluates and finishes."""
    resume = _resume_command(hydra_cfg, run_dir)
    if stop.adapter is None:
        return f"stopped by {stop.signame} at step {stop.step}; checkpoint {stop.checkpoint}; resume with: {resume}"
    line = f"stopped by {stop.signame} {stop.phase}, after step {stop.step}; kept the adapter ({stop.adapter})"
    if stop.checkpoint is None:  # trainer.save_steps=0: nothing a resume could evaluate from
        return (
            f"{line}, not evaluated (trainer.save_steps=0 kept no checkpoint to finish from); merge or generate from it"
        )
    return f"{line} and checkpoint {stop.checkpoint}; to evaluate and finish: {resume}"


def _rank_lost_line(lost, hydra_cfg, run_dir: Path) -> str:
    """Another rank ended without the others (kill -9, a crash): what is kept, how to go on."""
    rank = int(os.environ.get("RANK", 0))
    if lost.checkpoint is None:
        return f"error: rank {rank}: {lost}; the job stopped before a checkpoint was saved: run it again"
    return (
        f"error: rank {rank}: {lost}; the job stopped, its last checkpoint is {lost.checkpoint}; resume with: "
        + _resume_command(hydra_cfg, run_dir)
    )


def _record_failed_job(run_dir: Path, err: UserError) -> None:
    """One bad job must not end a sweep; a stack the planner rejects is skipped before loading."""
    from ..planner import DoesNotFit
    from ..run.metrics import write_metrics
    from ..run.reuse import HoldsARun, held_run

    status = "skipped" if isinstance(err, DoesNotFit) else "error"
    run_dir.mkdir(parents=True, exist_ok=True)
    # a job dir holding an earlier run (refused, or a refused overwrite=true put back) keeps its metrics.json
    if isinstance(err, HoldsARun):
        from ..integrations.sweep import record_refused

        record_refused(run_dir, str(err))  # the summary says so, not the earlier run's status
    elif held_run(run_dir) is None:
        write_metrics(run_dir, {"status": status, "error": str(err)})
    log.error("%s: %s", status, err)
    return None


def _resume_command(hydra_cfg, run_dir: Path) -> str:
    return resume_command(list(hydra_cfg.overrides.task), str(run_dir))


def _save_hydra_files(run_dir: Path, cfg: DictConfig) -> None:
    """What Hydra writes into `.hydra/` before a job (config, hydra, overrides), written once the
    run's input is checked."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra_node = HydraConfig.instance().cfg  # {"hydra": ...}, the job's
    out = run_dir / ".hydra"
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(hydra_node, out / "hydra.yaml")
    OmegaConf.save(hydra_node.hydra.overrides.task, out / "overrides.yaml")


def _created_by_this_run(run_dir: Path) -> bool:
    """Hydra made the run dir for this run (it is empty and younger than this command)."""
    try:
        return not any(run_dir.iterdir()) and run_dir.stat().st_ctime >= _Launch.started
    except OSError:
        return False


def _discard(run_dir: Path, fresh: bool) -> bool:
    """Remove the run dir Hydra made for this run while nothing has been written into it (a run
    refused after its checks passed, e.g. by the planner, keeps its plan.json). True if removed."""
    try:
        if fresh and not any(run_dir.iterdir()):
            run_dir.rmdir()
            return True
    except OSError:
        pass
    return False


def _interrupted(run_dir: Path, fresh: bool, hydra_cfg, signame: str = "SIGINT") -> str:
    """The line for Ctrl-C or SIGTERM outside the training loop (which saves a checkpoint and says so
    itself): while loading, or before anything was written."""
    stopped = f"stopped by {interrupts.described(signame)}"
    if _discard(run_dir, fresh) or not run_dir.is_dir() or not any(run_dir.iterdir()):
        return f"{stopped} before anything was written"
    if _finished(run_dir):  # the signal came after metrics.json was written: nothing is missing
        return f"{stopped} after the run finished; {run_dir} holds its adapter/ and metrics.json"
    if any((run_dir / "checkpoints").glob("checkpoint-*")):
        return f"{stopped}; the checkpoints in {run_dir / 'checkpoints'} are kept; resume with: " + _resume_command(
            hydra_cfg, run_dir
        )
    return f"{stopped} before a checkpoint was saved; nothing in {run_dir} to resume from (run it again)"


def _finished(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "metrics.json").read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def _hydra_main() -> None:
    import hydra

    from ..config.loader import register_schemas
    from ..resources import CONF_DIR

    register_schemas()
    hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(main)()


@quiet_when_the_reader_goes()  # `train.py --help | head`, `--cfg job | head`
def run(argv: list[str], prog: str = "qlora train", own_process: bool = False) -> None:
    """The train command; `own_process`: this process runs it and exits (its entry points say so)."""
    if any(a in ("-h", "--help") for a in argv):
        from .helptext import hydra_help

        print(hydra_help(USAGE, sections=DOC_SECTIONS))
        sys.exit(0)
    if any(a == "--gpus" or a.startswith("--gpus=") for a in argv):  # Hydra would dump its whole usage
        print(
            f"error: {prog} has no --gpus: it trains on the GPUs it finds (CUDA_VISIBLE_DEVICES picks them); to plan "
            "for GPUs you name: qlora plan --gpus 24GB [the same overrides]",
            file=sys.stderr,
        )
        sys.exit(2)
    _Launch.started = time.time()
    _Launch.own_process = own_process
    set_command(prog)
    multirun = any(a in ("-m", "--multirun") for a in argv)
    own_subdir = any(a.lstrip("+").startswith("hydra.output_subdir=") for a in argv)
    _Launch.deferred_hydra_files = not (multirun or own_subdir or any(a in _NO_JOB_FLAGS for a in argv))
    extra = ["hydra.output_subdir=null"] if _Launch.deferred_hydra_files else []

    def hydra_main() -> None:
        if not (multirun or any(a in _NO_JOB_FLAGS for a in argv)):  # ranks of one launch: one run dir
            from ..run import dist

            extra.extend(dist.shared_run_dir(argv))
        sys.argv = [prog, *argv, *extra]
        _hydra_main()

    runner.run(hydra_main)
