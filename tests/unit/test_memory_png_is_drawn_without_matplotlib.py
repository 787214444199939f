"""memory.png is drawn inside train(), at its end, so it counts in every run's training time: it is drawn
with Pillow (a few hundredths of a second), not matplotlib (whose import and layout took most of a second,
more than the first steps of a small model), and it shows every series, from 0, and the planned peak."""

import json
import subprocess
import sys

from conftest import REPO
from PIL import Image

from qlora_recipes.run.timeline_png import nice_ticks

SCRIPT = """
import sys
from pathlib import Path
from qlora_recipes.run.callbacks import plot_timeline
plot_timeline(Path(sys.argv[1]), Path(sys.argv[2]), (1.5, "process RSS"))
print(sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"))
"""


def test_memory_png_is_drawn_without_importing_matplotlib(tmp_path):
    jsonl, png = tmp_path / "memory.jsonl", tmp_path / "memory.png"
    rows = [{"step": s, "t_s": s / 2, "rss_gib": 1 + s / 100, "peak_gib": 1.2} for s in (0, 4, 8)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(jsonl), str(png)], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", f"matplotlib was imported to draw memory.png: {out.stdout}"
    image = Image.open(png)
    assert image.format == "PNG" and image.size == (700, 350) and png.stat().st_size > 1000
    colours = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 16)}
    assert {(31, 119, 180), (255, 127, 14)} <= colours  # both series drawn, in their colours


def test_the_y_axis_reaches_past_the_highest_value_in_round_steps():
    assert nice_ticks(1.725) == [0, 0.5, 1, 1.5, 2]
    assert nice_ticks(50.5) == [0, 10, 20, 30, 40, 50, 60]
    assert nice_ticks(8, 8) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
