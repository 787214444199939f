"""The benchmark harness: each recipe stack measured in fresh processes, against the plain Hugging Face
way and against the planner, on this CPU or the one GPU that is here (`python -m bench`, bench/README.md).

Modules, one concern each: `machine` (device and host facts), `stats` (medians, line fits, the
bounded search), `models` (random-weight real-shape models and synthetic data), `runner` (child
processes, their wall time and peak RSS, what a run wrote, the baseline's command), `planning` (every
call into the planner), `suite` (suite files, composed configs, a run's settings), `measure` (one
stack, ours vs the baseline; timings), `stages` and `seq_search` (the GPU suite's stages), `goals`,
`report` (markdown, README table), `results` (the JSON file), `harness` (a suite end to end),
`baseline` (the plain QLoRA script, a child that imports nothing of ours) and `__main__` (the CLI).
This file imports nothing heavy: `python -m bench.baseline` runs it first.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
README = HERE / "README.md"
