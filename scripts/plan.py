"""The same as `qlora plan` (see `python scripts/plan.py --help`): a stack's memory plan, nothing loaded.

python scripts/plan.py recipe=llama2-70b-a100
python scripts/plan.py --gpus 80GB model=llama2-70b trainer=standard
"""

import sys

from qlora_recipes.cli import plan

if __name__ == "__main__":
    plan.run(sys.argv[1:], prog="scripts/plan.py")
