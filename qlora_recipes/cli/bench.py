"""`qlora bench SUITE [options]`: the benchmark harness, which lives in a source checkout's bench/.

The library holds no benchmark code; bench/ is a package of its own beside it (run as
`python -m bench`), with committed results in bench/results/. From an installed wheel there is no
bench/ to run: clone the repository and run `qlora bench` (or `make bench-cpu`) there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..errors import UserError
from .helptext import docs_pointer, quiet_when_the_reader_goes
from .runner import run_plain


def _checkout() -> Path:
    """The source checkout holding bench/: this package's parent (editable install), else the cwd."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "bench" / "__main__.py").is_file():
            return root
    raise UserError(
        "qlora bench runs the harness of a source checkout (bench/ is not installed with the package); "
        "clone the repository and run it from there"
    )


@quiet_when_the_reader_goes()
def run(argv: list[str], prog: str = "qlora bench") -> None:
    def bench() -> int:
        root = _checkout()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        code = subprocess.call([sys.executable, "-m", "bench", *argv], cwd=root, env=env)
        if code == 0 and any(a in ("-h", "--help") for a in argv):
            print(docs_pointer("Benchmarks"))
        return code

    run_plain(bench)
