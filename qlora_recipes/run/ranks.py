"""How a job of several ranks ends on a failure: one line, the rank's own exit code.

`start` runs the launcher `qlora launch` printed (torchrun or accelerate launch, both torch's
elastic agent) in this process instead of exec'ing it: when a rank fails, the agent raises
ChildFailedError and `python -m torch.distributed.run` would print it with its traceback (some 30
lines naming every rank) and exit 1; here the rank's own line (it printed it) is all, and the exit
code is the first failed rank's: 2 for a user's mistake, 143 for SIGTERM, 128+N for a rank killed
by signal N (said in one line: that rank could say nothing).

`echoes_rank_zero` is for the ranks themselves, also under a bare `torchrun train.py`: every rank
checks the same config and data and meets the same mistake; rank 0 says it, the others stay quiet
unless rank 0 said something else (or nothing within a few seconds), so nothing is dropped.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

# What the elastic agent logs on a failure that the rank's own line and this exit code say already
_AGENT_NOISE = ("failed (exitcode", "Sending process")
_ERROR_KEY = "qlora_recipes/user_error/0"  # in the launcher's store: rank 0's line, for the others to compare
_COUNT_KEY = "qlora_recipes/user_errors"  # how many other ranks met a user error
_WAIT_S = 30  # how long another rank waits for rank 0's line before printing its own: ranks reach
# their checks seconds apart on a loaded machine (imports, a config compose each), and a rank that exits
# first gets the others stopped by the launcher mid-check


class _QuietAgent(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_AGENT_NOISE)


def start(cmd: list[str]) -> int:
    """Run `cmd` (`python -m torch.distributed.run|accelerate.commands.launch ARGS`, as
    dist.launch_command builds it) in this process; the exit code of the job."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    module, args = cmd[2], cmd[3:]
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietAgent())
    try:
        if module == "torch.distributed.run":
            from torch.distributed.run import parse_args, run

            run(parse_args(args))
        else:
            from accelerate.commands.launch import launch_command, launch_command_parser

            launch_command(launch_command_parser().parse_args(args))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode
        name = signal.Signals(-failure.exitcode).name
        print(f"error: rank {rank} was ended by {name} (pid {failure.pid}); the other ranks were stopped", flush=True)
        return 128 - failure.exitcode
    except SignalException as err:  # this launcher was signalled: the ranks got it too and said what they kept
        return 128 + int(err.sigval)
    except subprocess.CalledProcessError as err:  # accelerate's multi-node DeepSpeed launcher (pdsh): its code
        return err.returncode
    return 0


def _launcher_store():
    """A client of the store of the launcher that started this rank (torchrun, accelerate launch),
    or None when there is none or it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not os.environ.get("MASTER_ADDR"):
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        return TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=_WAIT_S),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, KeyError):  # the launcher is going away: say it ourselves
        return None


def echoes_rank_zero(line: str) -> bool:
    """True when this rank need not print `line` (its user error): it is not rank 0 and rank 0 of
    this job printed the same line. Rank 0 records its line, then waits a moment for the others to
    meet theirs (the launcher stops every rank as the first one exits: a rank stopped mid-check
    would print a line of its own). One process: False."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return False
    store = _launcher_store() if world > 1 else None
    if store is None:
        return False
    try:
        if rank == 0:
            store.set(_ERROR_KEY, line)
            deadline = time.monotonic() + _WAIT_S
            while store.add(_COUNT_KEY, 0) < world - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            return False
        for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher stops the ranks as rank 0 exits: we exit anyway
            signal.signal(sig, signal.SIG_IGN)
        store.add(_COUNT_KEY, 1)
        return store.get(_ERROR_KEY).decode() == line  # waits up to _WAIT_S for rank 0's line
    except (RuntimeError, ValueError):  # no line from rank 0 in time, or the store went away
        return False
