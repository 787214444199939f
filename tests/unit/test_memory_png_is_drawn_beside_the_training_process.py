"""memory.png is drawn by a child process the run starts once its timed part is over and waits for
before listing its files: the training process never imports matplotlib (about a second of CPU at
the end of every run), the chart is still drawn, and a chart that cannot be drawn is one warning."""

import json
import logging
import subprocess
import sys

from conftest import REPO

from qlora_recipes.outputs import memory_chart

SCRIPT = """
import sys
from pathlib import Path
from qlora_recipes.run.callbacks import MemoryLogger
logger = MemoryLogger(Path(sys.argv[1]), 4, planned=(1.5, "process RSS"))
drawing = logger.draw_png()
print(drawing.wait(), "matplotlib" in sys.modules)
"""


def _timeline(run_dir):
    rows = [{"step": s, "t_s": s / 2, "rss_gib": 1 + s / 100, "peak_gib": 1.2} for s in (0, 4, 8)]
    (run_dir / "memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_training_process_draws_memory_png_without_importing_matplotlib(tmp_path):
    _timeline(tmp_path)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "False"], "memory.png not drawn, or matplotlib imported by the run"
    png = tmp_path / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_a_chart_that_cannot_be_drawn_is_one_warning_not_the_runs_failure(tmp_path, caplog):
    (tmp_path / "memory.jsonl").write_text("not json\n")
    with caplog.at_level(logging.WARNING, logger="train"):
        drawn = memory_chart.start(tmp_path / "memory.jsonl", tmp_path / "memory.png", (1.0, "process RSS")).wait()
    assert drawn is False and not (tmp_path / "memory.png").exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("memory.png: not drawn (") and "JSONDecodeError" in lines[0]


def test_memory_png_is_drawn_in_the_run_when_no_process_can_be_started(tmp_path, monkeypatch):
    _timeline(tmp_path)

    def no_process(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory_chart.subprocess, "Popen", no_process)
    drawing = memory_chart.start(tmp_path / "memory.jsonl", tmp_path / "memory.png", (1.5, "process RSS"))
    assert drawing.wait() is True
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
