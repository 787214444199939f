"""`python -m qlora_recipes COMMAND ...`: the same as the `qlora` console script."""

from .cli import main

main()
