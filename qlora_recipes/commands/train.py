"""`qlora train [overrides]` (also `python train.py`): compose a stack with Hydra and train it.

Hydra composes conf/train.yaml with the command-line overrides (`quant=nf4 peft.r=64`,
`recipe=NAME`, `-m` sweeps); `qlora_recipes.training.train` does the work. In a sweep one bad job
does not end the others: a stack the planner rejects is recorded as skipped, an error as error.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .. import cli
from ..errors import UserError
from ..resources import CONF_DIR
from ..schema import register_schemas
from .helptext import hydra_help

register_schemas()
log = logging.getLogger("train")
USAGE = """usage: qlora train [GROUP=OPTION ...] [GROUP.KEY=VALUE ...]    (also: python train.py ...)

Fine-tunes the composed stack: validate -> plan memory -> load (4-bit, device map) -> LoRA ->
TRL SFTTrainer -> eval -> adapter + metrics.json in the run dir (runs/DATE/TIME).
  qlora train                                  the embedded default (tiny model, runs on CPU)
  qlora train quant=nf4 optim=paged8bit peft.r=64
  qlora train recipe=tiny-cpu                  a full stack from recipes/
  qlora train -m peft.r=4,8 optim=paged8bit,adamw8bit    a sweep: one job per combination"""


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from ..lifecycle import Preempted
    from ..metrics import write_metrics
    from ..planner import DoesNotFit
    from ..training import train

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        result = train(cfg, run_dir, dict(hydra_cfg.runtime.choices))
    except UserError as err:
        if hydra_cfg.mode != RunMode.MULTIRUN:
            raise
        # One bad job must not end a sweep; a stack the planner rejects is skipped before loading.
        status = "skipped" if isinstance(err, DoesNotFit) else "error"
        write_metrics(run_dir, {"status": status, "error": str(err)})
        log.error("%s: %s", status, err)
        return None
    except Preempted as stop:
        keep = [o for o in hydra_cfg.overrides.task if not o.startswith(("resume", "hydra.run.dir"))]
        print(
            f"stopped by {stop.signame} at step {stop.step}; checkpoint {stop.checkpoint}; resume with: "
            f"{' '.join(['python train.py', *map(shlex.quote, keep)])} resume=auto hydra.run.dir={run_dir}",
            file=sys.stderr,
        )
        sys.exit(143 if stop.signame == "SIGTERM" else 130)
    return result.get("eval_loss")  # the objective an Optuna sweep minimises


def run(argv: list[str], prog: str = "qlora train") -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(hydra_help(USAGE))
        sys.exit(0)
    sys.argv = [prog, *argv]
    cli.run(main)
