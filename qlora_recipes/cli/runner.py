"""Entry-point glue: Hydra's composition errors and our UserErrors become one line, no traceback.

Hydra prints composition errors over several lines (search path, "set HYDRA_FULL_ERROR"); with
HYDRA_FULL_ERROR=1 it raises them instead, and `run` condenses them here. An exception escaping a
Hydra task function gets an "Error executing job with overrides" line first, so a task carries its
message out as a `Stop` (a BaseException, which Hydra lets pass). Ctrl-C anywhere is one line and
exit 130 (interrupts.py keeps it out of imports and finalizers); SIGTERM alike, exit 143. Anything else is a bug in this
repository and keeps its traceback.
"""

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable

from .. import interrupts
from ..config.loader import one_line
from ..errors import UserError


class Stop(BaseException):
    """A finished message and exit code carried out of a Hydra task function: Hydra catches
    Exception (and prints its own line first), never a BaseException."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.message, self.code = message, code


def exit_with(message: str, code: int):
    """The process's last line (if any) on stderr, and its exit code."""
    signame = interrupts.received()
    if code == 2 and signame:  # e.g. OmegaConf's error about a node Ctrl-C left half built
        message, code = interrupts.starting_line(signame), interrupts.exit_code(signame)
    if code in (130, 143) and threading.current_thread() is threading.main_thread():
        for sig in interrupts.STOP_SIGNALS:  # one signal, one line: the exit is not interrupted again
            signal.signal(sig, signal.SIG_IGN)
    sys.stdout.flush()
    if code == 2 and message.startswith("error: "):  # the same mistake in every rank: rank 0 says it
        from ..run.ranks import echoes_rank_zero

        message = "" if echoes_rank_zero(message) else message
    if message:  # none: another rank says it (a stop of several ranks is one line)
        print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def run(hydra_main: Callable[[], object]) -> None:
    """Run a Hydra command: a user's mistake is one `error:` line on stderr and exit 2, Ctrl-C one
    line and exit 130 (the imports of the command's heavy modules belong inside `hydra_main`); in a
    sweep, the line says what the sweep kept and how to go on."""
    interrupts.install()
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing; also when set to 0
    try:
        _hydra_errors_as_user_errors(hydra_main)
    except Stop as stop:
        exit_with(_sweep_stopped(stop.code) or stop.message, stop.code)
    except UserError as err:
        exit_with(f"error: {err}", 2)
    except KeyboardInterrupt as err:
        signame = interrupts.signal_name(err)
        code = interrupts.exit_code(signame)
        exit_with(_sweep_stopped(code, signame) or interrupts.starting_line(signame), code)


def _sweep_stopped(code: int, signame: str | None = None) -> str | None:
    """The line for a stop signal to a sweep this process runs (a job's own line names that job
    only; Ctrl-C outside a job is no "while starting"), else None."""
    if code not in (130, 143):
        return None
    from ..integrations.sweep import started_sweep_dir, stopped_line

    sweep_dir = started_sweep_dir()
    if sweep_dir is None:
        return None
    signame = signame or ("SIGTERM" if code == 143 else "SIGINT")
    return stopped_line(sweep_dir, f"stopped by {interrupts.described(signame)}")


def _hydra_errors_as_user_errors(hydra_main: Callable[[], object]) -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(one_line(err)) from None
    except YAMLError as err:  # a recipe or option file that is not YAML
        raise UserError(f"not valid YAML: {one_line(err)}") from None
    except RuntimeError as err:
        if type(err).__name__ == "UncompletedJobError":  # submitit: a job ended without a result
            raise Stop(_job_without_result(err), 1) from None
        if 'Could not detect "srun"' not in str(err):
            raise
        # submitit's SLURM executor, started by hydra/launcher=slurm before any job
        _remove_unlaunched_sweep_dir()
        raise UserError(
            "hydra/launcher=slurm submits jobs to a SLURM cluster, and there is none here (no `srun` on PATH): "
            "run the command on a SLURM login node, or use hydra/launcher=local to run the jobs on this machine"
        ) from None


def _job_without_result(err: Exception) -> str:
    """A sweep job whose submitit process ended without its result: most often a signal sent to the
    job id submitit shows (under hydra/launcher=local its controller, which passes on SIGTERM only
    and dies of USR2; its trainer then stops at a checkpoint, cluster.stop_with_local_controller)."""
    from ..integrations.sweep import started_sweep_dir

    job = re.search(r"Job (\S+)", str(err))
    sweep = started_sweep_dir()
    return (
        f"error: sweep job {job.group(1) if job else '?'} ended without a result (signalled? its submitit process "
        "passes on SIGTERM only); the jobs' checkpoints are kept"
        + (f" in {sweep}" if sweep else "")
        + ": continue with the same command plus resume=auto. To preempt a job by hand, send SIGTERM to the job id "
        "submitit shows, or USR2 to the trainer (the pid in its job dir's run.lock)"
    )


class ArgumentParser(argparse.ArgumentParser):
    """argparse with our error convention: one `error:` line (via UserError), exit 2, no usage dump."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # keep our paragraphs
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def run_plain(command: Callable[[], int | None]) -> None:
    """Run a non-Hydra command: its UserError becomes one line and exit 2; its return is the exit code."""
    interrupts.install()
    try:
        code = command()
    except UserError as err:
        exit_with(f"error: {err}", 2)
    except KeyboardInterrupt as err:
        signame = interrupts.signal_name(err)
        exit_with(f"stopped by {interrupts.described(signame)}", interrupts.exit_code(signame))
    sys.exit(code or 0)


_STARTED_AT = time.time()


def _remove_unlaunched_sweep_dir() -> None:
    """Hydra writes the sweep dir's multirun.yaml before its launcher starts: a launcher that refused
    to start leaves no sweep dir (and no date folder it alone was in)."""
    from pathlib import Path

    from ..integrations.sweep import started_sweep_dir

    sweep_dir = started_sweep_dir()
    if sweep_dir is None or not sweep_dir.is_dir() or {p.name for p in sweep_dir.iterdir()} != {"multirun.yaml"}:
        return
    (sweep_dir / "multirun.yaml").unlink()
    made_after = _STARTED_AT - 1  # a folder Hydra made for this sweep (runs/, runs/multirun/DATE, ...)
    for folder in (sweep_dir, *sweep_dir.parents):
        try:
            if folder == Path.cwd() or folder.stat().st_ctime < made_after:
                break
            folder.rmdir()  # only while empty
        except OSError:
            break
