"""The `logger` group: trackers chosen on the command line, the run name, and what is refused before
anything is written (a missing package, a bad W&B mode, W&B online without a login)."""

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import REPO, SMOKE, compose_cfg, compose_hydra_cfg
from helpers_trackers import ENV, needs
from helpers_trackers import train_process as _train

from qlora_recipes.errors import UserError
from qlora_recipes.integrations import trackers


@pytest.mark.parametrize(
    "overrides,wanted",
    [
        ([], ["tensorboard"]),
        (["logger=none"], []),
        (["logger=wandb"], ["wandb"]),
        (["logger=[tensorboard,wandb,mlflow,trackio]"], ["tensorboard", "wandb", "mlflow", "trackio"]),
        (["logger=[mlflow,trackio]"], ["mlflow", "trackio"]),
    ],
)
def test_logger_options_choose_the_backends_and_report_to(overrides, wanted):
    cfg = compose_cfg(*overrides)
    assert trackers.enabled(cfg.logger) == wanted
    assert trackers.report_to(cfg.logger) == [b for b in wanted if b != "tensorboard"]  # TensorBoard is attached by us


def test_run_name_is_the_run_dir_and_the_overrides_that_shape_the_stack(tmp_path):
    run_dir = tmp_path / "2026-01-31" / "12-00-00"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "- peft.r=8\n- logger=[tensorboard,wandb]\n- hydra.run.dir=/somewhere\n- optim=adamw8bit\n- resume=auto\n"
    )
    cfg = compose_cfg()
    assert trackers.run_name(cfg.logger, run_dir) == "2026-01-31/12-00-00 peft.r=8,optim=adamw8bit"
    assert trackers.run_name(compose_cfg("logger.run_name=mine").logger, run_dir) == "mine"
    assert trackers.run_name(cfg.logger, tmp_path / "plain") == f"{tmp_path.name}/plain"  # no overrides recorded


def test_a_missing_tracker_package_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec reports for a package that is not there
    with pytest.raises(UserError, match=r"logger=wandb needs wandb, which is not installed: pip install wandb"):
        trackers.check(compose_cfg("logger=[tensorboard,wandb]").logger)
    trackers.check(compose_cfg("logger=tensorboard").logger)  # TensorBoard ships with requirements.txt


def test_a_bad_wandb_mode_is_refused():
    with pytest.raises(UserError, match="logger.wandb.mode=sometimes is not an option"):
        trackers.check(compose_cfg("logger.wandb.mode=sometimes").logger)


def test_missing_package_stops_the_command_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    proc = _train(*SMOKE, "logger=[tensorboard,mlflow]", f"hydra.run.dir={out}", hide="mlflow")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "logger=mlflow needs mlflow" in errors[0] and "pip install mlflow-skinny" in errors[0]
    assert not out.exists()


@pytest.fixture
def no_wandb_login(monkeypatch, tmp_path):
    """No W&B credentials anywhere wandb looks: no key or token in the environment, an empty netrc,
    no settings files; its server a name nothing answers to (nothing is contacted anyway)."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.test")
    monkeypatch.chdir(tmp_path)  # no workspace settings (./wandb/settings) either
    return tmp_path / "netrc"


@needs("wandb")
def test_wandb_online_without_a_login_is_refused_up_front(no_wandb_login, monkeypatch):
    cfg = compose_cfg("logger=[tensorboard,wandb]")
    with pytest.raises(UserError, match=r"no W&B login here .*`wandb login`.*WANDB_MODE=offline") as err:
        trackers.check(cfg.logger)
    assert "\n" not in str(err.value) and "https://wandb.example.test" in str(err.value)
    trackers.check(compose_cfg("logger=[tensorboard,wandb]", "logger.wandb.mode=offline").logger)
    trackers.check(compose_cfg("logger=[tensorboard,wandb]", "logger.wandb.mode=disabled").logger)
    trackers.check(compose_cfg("logger=tensorboard").logger)  # no W&B, no question
    monkeypatch.setenv("WANDB_MODE", "offline")
    trackers.check(cfg.logger)
    monkeypatch.delenv("WANDB_MODE")
    no_wandb_login.write_text(f"machine wandb.example.test\n  login user\n  password {'k' * 40}\n")  # `wandb login`
    trackers.check(cfg.logger)
    no_wandb_login.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    trackers.check(cfg.logger)
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(UserError, match="no W&B login here"):  # logger.wandb.mode=online wins over WANDB_MODE
        trackers.check(compose_cfg("logger=[tensorboard,wandb]", "logger.wandb.mode=online").logger)


@needs("wandb")
def test_wandb_online_without_a_login_leaves_the_run_dir_untouched(no_wandb_login, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_") and k != "NETRC"}  # a login of this shell
    env.update({k: os.environ[k] for k in ("NETRC", "WANDB_CONFIG_DIR", "WANDB_BASE_URL")})  # goes too
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *SMOKE, "logger=[tensorboard,wandb]", f"hydra.run.dir={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "`wandb login`" in errors[0] and "logger.wandb.mode=offline" in errors[0]
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before  # no config.yaml


SKIPPED_IN_A_CHILD = """
import sys
from conftest import compose_cfg
from qlora_recipes.integrations import trackers
skipped = trackers.leave_unused_unimported(compose_cfg(*sys.argv[1:]).logger)
import trl.extras.profiling
from transformers.integrations import is_wandb_available
print(sorted(skipped), is_wandb_available(), sorted(m for m in trackers.IMPORTED_BY_TRL if sys.modules.get(m)))
"""


@pytest.mark.parametrize(
    "overrides, said",
    [
        ((), "['mlflow', 'trackio', 'wandb'] False []"),  # TensorBoard alone: TRL imports none of them
        (("logger=wandb", "logger.wandb.mode=offline"), "['mlflow', 'trackio'] True ['wandb']"),
    ],
)
def test_a_run_in_its_own_process_leaves_the_trackers_it_does_not_use_unimported(overrides, said):
    """TRL imports every tracker installed (about 1.5 s of each start); a run that reports to none of
    them imports none. Checked where all three are installed (CI installs requirements-extras.txt)."""
    if not all(importlib.util.find_spec(m) for m in trackers.IMPORTED_BY_TRL):
        pytest.skip("needs wandb, mlflow and trackio installed (requirements-extras.txt)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}  # conftest's compose
    out = subprocess.run(
        [sys.executable, "-c", SKIPPED_IN_A_CHILD, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == said, out.stderr[-2000:]


@pytest.mark.parametrize(
    "launcher, multirun, own",
    [("basic", True, False), ("local", True, True), ("slurm", True, True), ("basic", False, True)],
)
def test_unused_trackers_stay_unimported_only_where_the_run_has_its_process_to_itself(launcher, multirun, own):
    """A single run from train.py, or a sweep job a submitit launcher started alone; not Hydra's basic
    launcher, whose jobs share one process (a later job may report to a tracker an earlier one skipped)."""
    from qlora_recipes.cli import train as train_command

    hydra_cfg = compose_hydra_cfg(f"hydra/launcher={launcher}").hydra
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_command._Launch, "own_process", True)  # what train.py says of its process
        assert train_command.in_a_process_of_its_own(hydra_cfg, multirun) is own
