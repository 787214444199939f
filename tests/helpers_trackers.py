"""What the tracker tests share: which tracker packages are installed, and `python train.py` in a new
process (optionally with a package made unimportable)."""

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO

from qlora_recipes.integrations import trackers

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def installed(name: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in trackers.PACKAGES[name][0])


def needs(*names: str):
    missing = [n for n in names if not installed(n)]
    return pytest.mark.skipif(
        bool(missing), reason=f"{', '.join(missing)} not installed: pip install -r requirements-extras.txt"
    )


def train_process(*args: str, env: dict | None = None, hide: str | None = None) -> subprocess.CompletedProcess:
    """`python train.py ARGS` in a new process; `hide`: a package made unimportable there."""
    prelude = f"import sys; sys.modules[{hide!r}] = None; " if hide else "import sys; "
    code = prelude + "import runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code, str(REPO / "train.py"), *args],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
