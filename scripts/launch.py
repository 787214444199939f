"""The same as `qlora launch` (see `python scripts/launch.py --help`); `make RECIPE` and
`make plan-RECIPE` call it."""

import sys

from qlora_recipes.cli import launch

if __name__ == "__main__":
    launch.run(sys.argv[1:], prog="scripts/launch.py")
