"""The same as `qlora summarize` (see `python scripts/summarize_sweep.py --help`), kept for existing commands and docs."""

import sys

from qlora_recipes.cli import summarize

if __name__ == "__main__":
    summarize.run(sys.argv[1:], prog="scripts/summarize_sweep.py")
