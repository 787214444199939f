"""The one way a config is made: Hydra composes conf/train.yaml with the overrides onto the typed
schema (config/schema.py); composition errors become one UserError line."""

import re
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..invocation import command
from ..resources import shipped_path
from ..units import cfg_get
from .schema import TrainConfig


def register_schemas() -> None:
    """Register the schema and the `${shipped:rel/path}` resolver (shipped files, from any cwd)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("shipped"):
        OmegaConf.register_new_resolver("shipped", shipped_path)
    if not OmegaConf.has_resolver("if_data_path"):
        OmegaConf.register_new_resolver("if_data_path", if_data_path)


def if_data_path(path: str, value: Any, otherwise: Any = None, *, _parent_: Any) -> Any:
    """`${if_data_path:PATH,VALUE[,OTHERWISE]}` in a data option file: VALUE while the data node's `path` is
    PATH, OTHERWISE (default null) once `data.path=...` points elsewhere. conf/data/order.yaml ties the
    shipped sample's eval file, metric and generation length to the sample this way, so a user's own
    `data.path` starts from the generic defaults instead of inheriting them."""
    from pathlib import Path

    current = cfg_get(_parent_, "path")
    if current is None:
        return otherwise
    if str(current) == str(path):
        return value
    a, b = Path(str(current)).expanduser(), Path(str(path)).expanduser()
    same = a.exists() and b.exists() and a.resolve() == b.resolve()
    return value if same else otherwise


def compose(overrides: list[str]):
    """The config `qlora train` would compose for these overrides, outside a Hydra run (launch,
    bench, tests). Hydra's composition errors become one UserError line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..errors import UserError
    from ..resources import CONF_DIR
    from .loader import one_line

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(one_line(err)) from None


def one_line(err: Exception) -> str:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option; choose one of: {', '.join(err.options)}"
    text = str(err)
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause) not in text:
        text = f"{text}\n{cause}"
    lines = [ln.strip().rstrip(".") for ln in text.splitlines()]
    # Drop Hydra's hints that do not apply (append with +, search path, object types).
    keep = [
        ln
        for ln in lines
        if ln
        and not re.match(r"(To append|Config search path|provider=|reference_type|object_type|Set the environment)", ln)
    ]
    message = "; ".join(dict.fromkeys(keep))  # unique, in order
    if "not in '" in message or "Could not override" in message:
        message += f" (check the spelling; `{command()} --cfg job` prints every key)"
    return message
