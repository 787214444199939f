"""Entry-point glue: Hydra's composition errors and our UserErrors become one line, no traceback.

Hydra prints composition errors over several lines (search path, "set HYDRA_FULL_ERROR"); with
HYDRA_FULL_ERROR=1 it raises them instead, and `run` condenses them here. Anything else is a bug in
this repository and keeps its traceback.
"""

import argparse
import os
import re
import sys
from collections.abc import Callable

from .errors import UserError


def one_line(err: Exception) -> str:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option; choose one of: {', '.join(err.options)}"
    text = str(err)
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause) not in text:
        text = f"{text}\n{cause}"
    lines = [ln.strip().rstrip(".") for ln in text.splitlines()]
    # Drop Hydra's hints that do not apply (append with +, search path, object types).
    keep = [
        ln
        for ln in lines
        if ln
        and not re.match(r"(To append|Config search path|provider=|reference_type|object_type|Set the environment)", ln)
    ]
    message = "; ".join(dict.fromkeys(keep))  # unique, in order
    if "not in '" in message or "Could not override" in message:
        message += " (check the spelling; `python train.py --cfg job` prints every key)"
    return message


def run(hydra_main: Callable[[], object]) -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        hydra_main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with our error convention: one `error:` line (via UserError), exit 2, no usage dump."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # keep our paragraphs
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def run_plain(command: Callable[[], int | None]) -> None:
    """Run a non-Hydra command: its UserError becomes one line and exit 2; its return is the exit code."""
    try:
        code = command()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)


def quiet_libraries(log_level: int) -> None:
    """transformers' info lines, progress bars and deprecation warnings are noise in merge/generate;
    our own log lines at `log_level` and above go to stderr."""
    import logging
    import warnings

    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
