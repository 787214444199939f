"""QLoRA fine-tuning: one entry point for every stack (the same as `qlora train`).

    python train.py                                   # the embedded default (tiny model, CPU ok)
    python train.py quant=nf4 optim=paged8bit peft.r=64
    python train.py recipe=tiny-cpu                   # a full stack from recipes/
    python train.py -m peft.r=4,8 optim=paged8bit,adamw8bit   # Hydra multirun sweep
    python train.py --help                            # groups, options and flags

Hydra composes conf/train.yaml with the overrides (qlora_recipes/commands/train.py);
qlora_recipes/training.py's `train(cfg, run_dir)` does the work.
"""

import sys

from qlora_recipes.commands import train

if __name__ == "__main__":
    train.run(sys.argv[1:], prog="train.py")
