"""Several ranks of one job resume the same run dir: the rank that writes the run's files sets the
old config.yaml aside (run/reuse.py) for a moment before writing its own, and a rank checking its resume
in that moment reads the set-aside copy instead of refusing the run dir as "not a run dir"."""

import os

import pytest
from conftest import SMOKE, compose_cfg

from qlora_recipes.errors import UserError
from qlora_recipes.run.resume import resume_checkpoint
from qlora_recipes.run.reuse import ASIDE
from qlora_recipes.run.training import train

BASE = [*SMOKE, "trainer.save_steps=1"]


def test_a_resume_check_reads_the_config_another_rank_has_set_aside(tmp_path):
    run_dir = tmp_path / "run"
    train(compose_cfg(*BASE, "trainer.max_steps=2"), run_dir)
    (run_dir / ASIDE).mkdir()
    os.replace(run_dir / "config.yaml", run_dir / ASIDE / "config.yaml")  # as RunDirChanges.begin() does

    found = resume_checkpoint(compose_cfg(*BASE, "trainer.max_steps=3", "resume=auto"), run_dir)
    assert found is not None and found.endswith("checkpoint-2")
    with pytest.raises(UserError, match=r"peft\.r"):  # compared with the set-aside config, as before
        resume_checkpoint(compose_cfg(*BASE, "trainer.max_steps=3", "resume=auto", "peft.r=4"), run_dir)

    os.replace(run_dir / ASIDE / "config.yaml", tmp_path / "elsewhere.yaml")  # a dir with none at all
    with pytest.raises(UserError, match="has no config.yaml"):
        resume_checkpoint(compose_cfg(*BASE, "trainer.max_steps=3", "resume=auto"), run_dir)
