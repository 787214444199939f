"""The same as `qlora merge` (see `python scripts/merge.py --help`), kept for existing commands and docs."""

import sys

from qlora_recipes.cli import merge

if __name__ == "__main__":
    merge.run(sys.argv[1:], prog="scripts/merge.py")
