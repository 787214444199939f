"""A run imports the TRL trainer its objective uses and no other: TRL's DPO, GRPO and KTO trainer modules
cost about 0.4 CPU-s together, paid by every SFT run while the run path imported them all. Checked in a
fresh process, which imports the run path as `qlora train` does and picks the objective's guarded trainer."""

import subprocess
import sys

import pytest
from conftest import REPO

TRAINERS = {"sft": "sft_trainer", "dpo": "dpo_trainer", "kto": "kto_trainer", "grpo": "grpo_trainer"}

CHILD = """
import sys
from qlora_recipes.run import lifecycle, training
cls = lifecycle.guarded(sys.argv[1])
assert issubclass(cls, lifecycle.Guarded), cls.__mro__
print(" ".join(sorted(m.rsplit(".", 1)[-1] for m in sys.modules if m.startswith("trl.trainer.") and m.endswith("_trainer"))))
"""


@pytest.mark.parametrize(
    "objective",
    ["sft", *(pytest.param(o, marks=pytest.mark.slow) for o in ("dpo", "kto", "grpo"))],  # a fresh torch import each
)
def test_the_run_path_imports_the_trl_trainer_of_its_objective_alone(objective):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, objective], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = set(proc.stdout.split())
    others = set(TRAINERS.values()) - {TRAINERS[objective]}
    assert TRAINERS[objective] in imported and not imported & others, imported


def test_the_guarded_trainers_are_still_importable_by_name():
    """Tests and callers name them on lifecycle (`from ...lifecycle import GuardedTrainer`); an unknown name
    is still an AttributeError."""
    from qlora_recipes.run import lifecycle

    assert lifecycle.GuardedTrainer is lifecycle.guarded("sft")
    assert issubclass(lifecycle.GuardedTrainer, lifecycle.Guarded)
    with pytest.raises(AttributeError):
        lifecycle.GuardedNoSuchTrainer  # noqa: B018
