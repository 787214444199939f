"""init_from reads the earlier run as merge and generate do: a finished run written before keys were
added to the schema (init_from, objective.ref_adapter, objective.sft_weight) reads back with their
defaults, since its manifest proves config.yaml is what that run wrote; the stage records it."""

import json
from pathlib import Path

import yaml
from conftest import SMOKE, compose_cfg

from qlora_recipes.config.loader import to_yaml
from qlora_recipes.outputs.rundir import load_run_config
from qlora_recipes.outputs.runfiles import run_file_names, write_manifest
from qlora_recipes.run.stages import check_init_from


def _earlier_run(folder: Path) -> Path:
    """A finished SFT run whose config.yaml lacks the keys added since (not trained: files only)."""
    config = yaml.safe_load(to_yaml(compose_cfg(*SMOKE)))
    config.pop("init_from")
    for key in ("ref_adapter", "sft_weight"):
        config["objective"].pop(key)
    (folder / "adapter").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    (folder / "metrics.json").write_text(json.dumps({"status": "ok"}))
    write_manifest(folder, run_file_names(folder))
    return folder


def test_a_finished_run_from_before_the_stage_keys_reads_back_with_their_defaults(tmp_path):
    earlier = _earlier_run(tmp_path / "sft")
    cfg = load_run_config(earlier)
    assert cfg.init_from is None and cfg.objective.ref_adapter is None and cfg.objective.name == "sft"


def test_a_stage_from_it_records_the_earlier_run(tmp_path):
    earlier = _earlier_run(tmp_path / "sft")
    stage = compose_cfg(*SMOKE, "objective=dpo", f"init_from={earlier}")
    assert check_init_from(stage) == {"path": str(earlier.resolve()), "objective": "sft"}
    assert check_init_from(compose_cfg(*SMOKE)) is None
