"""The same as `qlora generate` (see `python scripts/generate.py --help`), kept for existing commands and docs."""

import sys

from qlora_recipes.cli import generate

if __name__ == "__main__":
    generate.run(sys.argv[1:], prog="scripts/generate.py")
