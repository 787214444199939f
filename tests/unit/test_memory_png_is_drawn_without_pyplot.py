"""memory.png is drawn at the end of every run (after the timed part, so not in its tokens/s): it is
drawn on a bare Agg canvas, not through pyplot (whose import and figure manager cost a third more)."""

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = """
import sys
from pathlib import Path
from qlora_recipes.outputs.memory_chart import plot_timeline
plot_timeline(Path(sys.argv[1]), Path(sys.argv[2]), (1.5, "process RSS"))
print("pyplot" in " ".join(sys.modules))
"""


def test_memory_png_is_drawn_without_importing_pyplot(tmp_path):
    jsonl, png = tmp_path / "memory.jsonl", tmp_path / "memory.png"
    rows = [{"step": s, "t_s": s / 2, "rss_gib": 1 + s / 100, "peak_gib": 1.2} for s in (0, 4, 8)]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(jsonl), str(png)], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", "pyplot was imported to draw memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
