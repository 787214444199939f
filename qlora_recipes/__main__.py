"""`python -m qlora_recipes COMMAND ...`: the same as the `qlora` console script."""

from qlora_recipes.commands import main

main()
