"""Run dirs written before checkpoints recorded a data fingerprint resume with one line.

Such a run dir (made with the code of commit f4f13c7 and compared by hand) differs from a new one in
three ways: its checkpoints carry no qlora_state.json (no manifest, no data fingerprint), its
config.yaml lacks the keys added since (data.chat_template, data.too_long, optim.warmup_steps, the
logger and hub groups), and it saved the data format it detected (data.format: prompt_completion)
where a new config says auto. Resuming one used to need resume.allow_changes=true.
"""

import logging

import pytest
import yaml
from conftest import SMOKE, compose_cfg

from qlora_recipes.errors import UserError
from qlora_recipes.run.checkpoints import RECORD
from qlora_recipes.run.resume import resume_checkpoint
from qlora_recipes.run.training import train

BASE = [*SMOKE, "trainer.save_steps=1", "trainer.micro_batch_size=4"]
ADDED_SINCE = {"data": ("chat_template", "too_long"), "optim": ("warmup_steps",), None: ("logger", "hub")}


def age(run_dir) -> None:
    """Make a run dir look like one written before data fingerprints existed."""
    for record in (run_dir / "checkpoints").glob(f"checkpoint-*/{RECORD}"):
        record.unlink()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for group, keys in ADDED_SINCE.items():
        for key in keys:
            (config[group] if group else config).pop(key, None)
    config["data"]["format"] = "prompt_completion"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def test_a_run_dir_from_before_fingerprints_resumes_saying_the_data_was_not_checked(small_data, tmp_path, caplog):
    run_dir = tmp_path / "run"
    train(compose_cfg(*BASE, *small_data, "trainer.max_steps=2"), run_dir)
    age(run_dir)

    with pytest.raises(UserError, match=r"differs .* in peft\.r;"):  # a real change is still refused
        resume_checkpoint(compose_cfg(*BASE, *small_data, "trainer.max_steps=3", "resume=auto", "peft.r=4"), run_dir)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qlora_recipes.run.resume"):
        m = train(compose_cfg(*BASE, *small_data, "trainer.max_steps=3", "resume=auto"), run_dir)
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "qlora_recipes.run.resume"]
    assert len(lines) == 1, lines
    assert "checkpoint-2 has no data fingerprint" in lines[0] and "could not be checked" in lines[0]
    assert "train.jsonl" in lines[0]
