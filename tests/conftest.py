"""Shared test helpers: compose the real config, find every config file on disk, a GPU skip."""

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from qlora_recipes.config.loader import register_schemas, to_typed  # noqa: E402

register_schemas()
# Every folder of conf/ is a group in train.yaml's defaults, except the presets chosen with `+`
# (sweep), Hydra's own (hydra/...) and the link to recipes/.
GROUPS = tuple(
    sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name not in ("recipe", "sweep", "hydra"))
)


def compose_cfg(*overrides: str):
    """The typed config (TrainConfig) train.py would run for these command-line overrides; Hydra's
    composition errors propagate as Hydra raises them, the typing's (unknown `+key`) as UserError."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_typed(compose(config_name="train", overrides=list(overrides)))


def options(group: str) -> list[str]:
    folder = REPO / ("recipes" if group == "recipe" else f"conf/{group}")
    return sorted(p.stem for p in folder.rglob("*.yaml"))


def requires_gpu(reason: str = "needs a CUDA GPU"):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
