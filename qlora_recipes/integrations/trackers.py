"""Experiment trackers (the `logger` group): which backends a run reports to, the run's name, and the
tracker runs opened around training.

    check(logger)              a backend's package missing, a bad option, W&B online without a login:
                               one UserError line, before anything is written (imports wandb only for that)
    report_to(logger)          the trainer's report_to: wandb, mlflow, trackio (transformers' own callbacks)
    run_name(logger, run_dir)  logger.run_name, or the run dir and its overrides: "2026-01-31/12-00-00 peft.r=8"
    start(logger, run_dir)     W&B and MLflow runs opened in the run dir; `.close()` ends every open run

TensorBoard stays ours (training writes tb/ with one SummaryWriter, shared with the memory timeline).
The W&B and MLflow runs are opened here rather than by their callbacks so that they land in the run
dir (RUN/wandb, RUN/mlflow.db) and the final evaluation, logged after the trainer's train_end (where
the callbacks would end their runs), goes into the same run. trackio keeps its runs in its own store
(TRACKIO_DIR, else HF_HOME/trackio), which it reads once when imported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config.schema import LoggerConfig
from ..errors import UserError

log = logging.getLogger("train")

BACKENDS = ("tensorboard", "wandb", "mlflow", "trackio")
# backend -> (modules it imports, what to pip install); MLflow's sqlite store needs SQLAlchemy + alembic,
# which mlflow-skinny does not pull in (the Optuna sweeper in requirements.txt does)
PACKAGES = {
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow-skinny sqlalchemy alembic"),
    "trackio": (("trackio",), "trackio"),
}
# The trackers TRL 1.16 imports when installed, used or not (trl.extras.profiling, trl's base trainer):
# about 1.5 s of every run's start with all three
IMPORTED_BY_TRL = ("wandb", "mlflow", "trackio")
EXTRA = "pip install 'qlora-recipes[trackers]' (or pip install -r requirements-extras.txt in a checkout)"
WANDB_MODES = ("online", "offline", "disabled")
# Overrides that do not change what is trained: left out of the run's name (and the reproduce command's group)
NOT_THE_STACK = ("hydra.", "hydra/", "logger", "hub.", "resume")
NAME_LIMIT = 128  # W&B's longest display name
IDS_FILE = (
    "trackers.json"  # the W&B / MLflow run ids of this run dir (ids only: never a URI, which may hold credentials)
)


def enabled(logger: LoggerConfig) -> list[str]:
    """The backends switched on, in BACKENDS order."""
    return [name for name in BACKENDS if getattr(logger, name).enabled]


def leave_unused_unimported(logger: LoggerConfig) -> list[str]:
    """For a process that runs this one run and exits: the installed trackers it does not report to
    are marked absent (`sys.modules[name] = None`, Python's own "no such module"), so TRL's imports skip
    them and transformers' availability checks say no, for the rest of the process. Returns them."""
    used = set(enabled(logger))
    skipped = [m for m in IMPORTED_BY_TRL if m not in used and m not in sys.modules and importlib.util.find_spec(m)]
    for module in skipped:
        sys.modules[module] = None
    return skipped


def report_to(logger: LoggerConfig) -> list[str]:
    """The trainer's report_to: every enabled backend but TensorBoard, which training attaches itself."""
    return [name for name in enabled(logger) if name != "tensorboard"]


def check(logger: LoggerConfig) -> None:
    """Before anything is written: each enabled backend's package is importable, its options valid,
    W&B online logged in."""
    missing = [
        (name, pip)
        for name in report_to(logger)
        for modules, pip in [PACKAGES[name]]
        if any(importlib.util.find_spec(m) is None for m in modules)
    ]
    if missing:
        names = ", ".join(name for name, _ in missing)
        pips = " ".join(pip for _, pip in missing)
        raise UserError(
            f"logger={names} needs {names}, which is not installed: pip install {pips}; all trackers: {EXTRA}"
        )
    mode = logger.wandb.mode
    if mode not in (None, *WANDB_MODES):
        raise UserError(f"logger.wandb.mode={mode} is not an option; choose one of: {', '.join(WANDB_MODES)}, null")
    if report_to(logger) and not str(logger.project or "").strip():
        raise UserError("logger.project is empty: name the project the trackers file this run under")
    if "wandb" in report_to(logger):
        _check_wandb_login(mode)


def _check_wandb_login(mode: str | None) -> None:
    """W&B online needs credentials, and wandb.init finds none only after config.yaml is written: look
    where wandb looks (WANDB_API_KEY, an identity token, its settings files, the netrc entry of its
    host), by its own readers, up front; nothing prompted, nothing written. Another wandb: no check."""
    online = ("online", "run", "shared")  # not offline, dryrun, disabled
    if mode is not None and mode not in online:
        return
    try:
        settings = _wandb_settings()  # WANDB_MODE, `wandb offline`, WANDB_BASE_URL, as wandb.init reads them
        if (mode or settings.mode) not in online:
            return
        from wandb.sdk.lib.wbauth import read_netrc_auth

        env_login = os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
        found = env_login or settings.api_key or read_netrc_auth(host=settings.base_url)
    except (ImportError, AttributeError, TypeError):  # a wandb without these readers: wandb.init will say it
        return
    except Exception as err:  # e.g. a malformed key in the netrc: wandb's own words
        raise UserError(f"logger=wandb: {_first_line(err).rstrip('.')}{_HINTS['wandb']}") from None
    if not found:
        raise UserError(
            f"logger=wandb logs online to {settings.base_url}, and there is no W&B login here (no WANDB_API_KEY, "
            "no netrc entry): run `wandb login` (or set WANDB_API_KEY), or log offline with "
            "logger.wandb.mode=offline (or WANDB_MODE=offline) and `wandb sync` later"
        )


def _wandb_settings():
    """wandb's settings as a new process would load them (its settings files, then WANDB_* variables),
    without its process-wide singleton, which would keep them (and start a thread) from now on."""
    from wandb import Settings

    settings = Settings()
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    settings.settings_system = str(Path(config_dir or "~/.config/wandb").expanduser() / "settings")
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    return settings


def run_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides of this run: Hydra's (inside its job), else the run dir's
    .hydra/overrides.yaml; None when neither is there (train() called as a library)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            if Path(hydra_cfg.runtime.output_dir).resolve() == Path(run_dir).resolve():
                return [str(o) for o in hydra_cfg.overrides.task]
    except (ImportError, ValueError):
        pass
    saved = Path(run_dir) / ".hydra" / "overrides.yaml"
    if saved.is_file():
        from omegaconf import OmegaConf

        return [str(o) for o in OmegaConf.load(saved)]
    return None


def stack_overrides(overrides: list[str] | None) -> list[str]:
    """The overrides that change what is trained (not where it is logged, pushed or resumed from)."""
    return [o for o in overrides or [] if not o.lstrip("+~").startswith(NOT_THE_STACK)]


def run_name(logger: LoggerConfig, run_dir: Path) -> str:
    """logger.run_name, or the run dir's last two parts and the overrides that shape the stack."""
    chosen = logger.run_name
    if chosen:
        return str(chosen)
    run_dir = Path(run_dir).resolve()
    name = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name else run_dir.name
    overrides = stack_overrides(run_overrides(run_dir))
    if overrides:
        name += " " + ",".join(overrides)
    return name if len(name) <= NAME_LIMIT else name[: NAME_LIMIT - 3] + "..."


@dataclass
class Tracking:
    """The tracker runs this process opened for one training run; `close` ends them (and trackio's,
    which its callback opens) once training and the final evaluation have been logged."""

    backends: list[str]
    opened: list[str] = field(default_factory=list)

    def close(self, failed: bool = False) -> None:
        for name in self.backends:
            try:
                _CLOSE[name](failed)
            except Exception as err:  # a tracker's own shutdown error must not hide the run's outcome
                log.warning("logger=%s: could not close its run: %s", name, err)


def start(logger: LoggerConfig, run_dir: Path) -> Tracking:
    """Open the W&B and MLflow runs in the run dir (main rank only; the callbacks on other ranks do
    nothing). A backend that cannot start (no W&B login, an unreachable server) is one UserError line.
    Their run ids are kept in RUN/trackers.json, so a resumed run goes on in the same tracker runs."""
    tracking = Tracking(report_to(logger))
    name = run_name(logger, run_dir)
    ids = _saved_ids(Path(run_dir))
    for backend in tracking.backends:
        opener = _OPEN.get(backend)
        if opener is None:
            continue
        try:
            where, ids[backend] = opener(logger, Path(run_dir), name, ids.get(backend))
        except UserError:
            raise
        except Exception as err:  # each library raises its own types; the first line says what failed
            tracking.close(failed=True)
            raise UserError(f"logger={backend}: could not start its run: {_first_line(err)}{_HINTS[backend]}") from None
        tracking.opened.append(backend)
        log.info("logger=%s: run %r, %s", backend, name, where)
    if tracking.opened:
        (Path(run_dir) / IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n")
    if "trackio" in tracking.backends:
        log.info("logger=trackio: run %r in project %s (trackio show)", name, logger.project)
    return tracking


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return re.sub(r"\s+", " ", text.splitlines()[0]) if text else type(err).__name__


def _saved_ids(run_dir: Path) -> dict:
    """The tracker run ids an earlier start of this run dir kept (none on a fresh run)."""
    try:
        saved = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: str(v) for k, v in saved.items() if isinstance(v, str)} if isinstance(saved, dict) else {}


def _open_wandb(logger: LoggerConfig, run_dir: Path, name: str, run_id: str | None) -> tuple[str, str]:
    import wandb

    w = logger.wandb
    run = wandb.init(
        project=logger.project,
        entity=w.entity,
        name=name,
        dir=str(run_dir),
        mode=w.mode,
        id=run_id,
        resume="allow" if run_id else None,
        reinit="finish_previous",
    )
    return f"{run.settings.mode} in {Path(run.dir).parent}", run.id


def _open_mlflow(logger: LoggerConfig, run_dir: Path, name: str, run_id: str | None) -> tuple[str, str]:
    import os

    import mlflow

    uri = logger.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:  # MLflow 3 keeps a file store only on request; its sqlite store is one file in the run dir
        run_dir.mkdir(parents=True, exist_ok=True)
        uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    mlflow.set_tracking_uri(uri)
    if mlflow.active_run() is not None:
        mlflow.end_run()  # an earlier job of this process left one open
    experiment = mlflow.set_experiment(logger.project)
    earlier = _mlflow_run(mlflow, run_id) if run_id else None
    if earlier is not None and earlier.info.experiment_id == experiment.experiment_id:
        run = mlflow.start_run(run_id=run_id)  # a resumed run goes on in its MLflow run
    else:
        run = mlflow.start_run(run_name=name)
    return f"experiment {logger.project} at {uri}", run.info.run_id


def _mlflow_run(mlflow, run_id: str):
    try:
        return mlflow.get_run(run_id)
    except mlflow.exceptions.MlflowException:  # not in this store (another tracking URI, deleted)
        return None


def _close_wandb(failed: bool) -> None:
    import sys

    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].finish(exit_code=1 if failed else 0)


def _close_mlflow(failed: bool) -> None:
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and mlflow.active_run() is not None:
        mlflow.end_run(status="FAILED" if failed else "FINISHED")


def _close_trackio(failed: bool) -> None:
    import sys

    trackio = sys.modules.get("trackio")
    if trackio is not None and trackio.context_vars.current_run.get() is not None:
        trackio.finish()


_OPEN = {"wandb": _open_wandb, "mlflow": _open_mlflow}
_CLOSE = {"wandb": _close_wandb, "mlflow": _close_mlflow, "trackio": _close_trackio}
_HINTS = {
    "wandb": "; log in with `wandb login` (or WANDB_API_KEY), or log offline with logger.wandb.mode=offline",
    "mlflow": "; check logger.mlflow.tracking_uri / MLFLOW_TRACKING_URI, or unset them for a store in the run dir",
    "trackio": "",
}
