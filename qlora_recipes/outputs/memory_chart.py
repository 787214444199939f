"""memory.png: a run's memory timeline (memory.jsonl) against its planned peak, drawn by matplotlib.

A run draws it in a process of its own (`start`), begun once the timed part is over and waited for
(`Drawing.wait`) before the run lists its files: matplotlib's import and layout (about a second of
CPU) overlap the adapter's save, the final evaluation and the model card instead of adding to them,
and the training process never imports matplotlib. This module imports nothing heavy at its top:
the child loads it and matplotlib only.

    python -m qlora_recipes.outputs.memory_chart MEMORY.jsonl MEMORY.png [PLANNED_GIB QUANTITY]
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("train")
_ROOT = Path(__file__).resolve().parents[2]  # the dir holding qlora_recipes/
WAIT_S = 120.0  # a chart of a few thousand points takes about a second; a wedged child is not waited on for ever


def plot_timeline(jsonl: Path, png: Path, planned: tuple[float, str] | None = None) -> None:
    """The measured series per step, the y axis from 0, and the planned peak (GiB, the quantity it
    predicts) as a horizontal line. Drawn on a bare Agg canvas: pyplot (its backend switching and
    figure manager) would add a third to the cost, paid at the end of every run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line]
    fig = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key in sorted({k for r in rows for k in r if k.endswith("_gib")}):
        ax.plot([r["step"] for r in rows], [r.get(key) for r in rows], label=key.removesuffix("_gib"), marker=".")
    planned = planned if planned is not None and planned[0] is not None else None
    if planned:
        gib, what = planned
        ax.axhline(gib, color="k", linestyle="--", label=f"planned peak ({what}): {gib:.3g} GiB")
    top = max([v for r in rows for k, v in r.items() if k.endswith("_gib")] + [planned[0] if planned else 0] + [0])
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.15 * top or 1)  # from 0, with room above the higher of measured and planned
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_title("memory over the run: measured vs planned")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


class Drawing:
    """memory.png being drawn by a child process; `wait()` once before the run's files are listed."""

    def __init__(self, proc: subprocess.Popen, png: Path):
        self.proc, self.png = proc, png

    def wait(self) -> bool:
        """Waits for the child (its own session: a Ctrl-C meant for the run does not cut it short);
        a failure is one warning line, not the run's failure. True if memory.png was drawn."""
        if self.proc is None:
            return self.png.is_file()
        proc, self.proc = self.proc, None
        try:
            _, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            log.warning("memory.png: not drawn within %.0f s; memory.jsonl holds its figures", WAIT_S)
            return False
        if proc.returncode != 0:
            last = (err or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            log.warning("memory.png: not drawn (%s); memory.jsonl holds its figures", last[0])
            return False
        return True


def start(jsonl: Path, png: Path, planned: tuple[float | None, str] | None = None) -> Drawing:
    """Begins drawing memory.png from memory.jsonl in a child process; returns at once."""
    # this package wherever it lies (a checkout run as `python train.py` from another dir, too)
    path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, "-m", __name__, str(jsonl), str(png)]
    if planned is not None and planned[0] is not None:
        argv += [repr(float(planned[0])), planned[1]]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,  # a terminal's Ctrl-C goes to the run, which waits for this short child
        )
    except OSError as err:  # no process to be had (ENOMEM, EAGAIN): drawn here, as before
        log.info("memory.png: drawn in the run's process (%s)", err)
        plot_timeline(jsonl, png, planned if planned is not None and planned[0] is not None else None)
        proc = None
    return Drawing(proc, png)


def main(argv: list[str]) -> None:
    jsonl, png, *rest = argv
    planned = (float(rest[0]), rest[1]) if len(rest) == 2 else None
    plot_timeline(Path(jsonl), Path(png), planned)


if __name__ == "__main__":
    main(sys.argv[1:])
