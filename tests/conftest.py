"""Shared test helpers: compose the real config, the smoke stack and a smoke run, find every config
file on disk, a GPU skip. Both tests/unit and tests/e2e see this file: `from conftest import ...`."""

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


def compose_hydra_cfg(*overrides: str):
    """The raw DictConfig with Hydra's own node (`cfg.hydra.sweeper`, `.launcher`): for tests of what
    Hydra does with a preset, which the typed config does not carry."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


# The stack a training test starts from: 3 steps of the tiny model, no generation metric (the
# exact-match pass would double a 3-step run's time and no test of training needs it).
SMOKE = ("trainer=smoke", "data.metric=null")


def train_smoke(run_dir: Path, *overrides: str) -> tuple[dict, Path]:
    """Train SMOKE plus these overrides in this process: (metrics, run_dir). For module-scoped runs
    that several tests share; a single test takes the `smoke_run` fixture."""
    from qlora_recipes.run.training import train

    return train(compose_cfg(*SMOKE, *overrides), run_dir), run_dir


@pytest.fixture
def smoke_run(tmp_path: Path):
    """`smoke_run(*overrides)`: train SMOKE plus overrides in this process into tmp_path/run."""
    return lambda *overrides: train_smoke(tmp_path / "run", *overrides)


def options(group: str) -> list[str]:
    folder = REPO / ("recipes" if group == "recipe" else f"conf/{group}")
    return sorted(p.stem for p in folder.rglob("*.yaml"))


def requires_gpu(reason: str = "needs a CUDA GPU"):
    return pytest.mark.skipif(not torch.cuda.is_available(), reason=reason)


@pytest.fixture
def small_data(tmp_path: Path) -> list[str]:
    """Overrides for 64 training rows and 8 eval rows of the shipped sample: loading and the final
    eval stay short where a test trains and resumes several times."""
    for name, keep in (("train", 64), ("eval", 8)):
        rows = (REPO / f"assets/data/order/{name}.jsonl").read_text().splitlines()[:keep]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    return [f"data.path={tmp_path / 'train.jsonl'}", f"data.eval_path={tmp_path / 'eval.jsonl'}"]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def hub_out_of_reach(monkeypatch):
    """A token in the environment, the hub switched on, and its endpoint a closed local port."""
    import huggingface_hub
    from helpers_hub import SECRET, closed_port

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", closed_port())
