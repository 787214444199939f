"""The one way a config is made: Hydra composes conf/train.yaml with the overrides onto the typed
schema (config/schema.py), `to_typed` turns the composed DictConfig into a `TrainConfig`, and `load`
adds the config-only checks (config/checks.py). Every error is one UserError line.

    compose(overrides) -> DictConfig      what Hydra composes (the command line's own object)
    to_typed(cfg) -> TrainConfig          every `${...}` resolved, no unknown `+key`, plain lists/dicts, the
                                          model dir's own family and figures
    load(overrides) -> TrainConfig        compose + to_typed + check_stack
    with_overrides(cfg, ["k=v"])          a changed copy of a typed config (the OOM ladder's rungs)
    read_saved(path) -> TrainConfig       a run's config.yaml; keys it lacks take the schema's defaults
    read_saved(path, complete="keys")     ... refused (Incomplete) when it lacks any key (or the sections named)
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..errors import UserError
from ..invocation import command
from ..resources import shipped_path
from .attention import AUTO, pick_for
from .fields import is_section
from .model_dir import from_config_json
from .schema import MODEL_FIGURES, TrainConfig, padding_free_on

if TYPE_CHECKING:
    from omegaconf import DictConfig


def register_schemas() -> None:
    """Register the schema and the `${shipped:rel/path}` resolver (shipped files, from any cwd)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("shipped"):
        OmegaConf.register_new_resolver("shipped", shipped_path)
    if not OmegaConf.has_resolver("order_sample"):  # conf/data/order.yaml: the sample of the objective
        from .objectives import by_objective, sample_file

        OmegaConf.register_new_resolver("order_sample", sample_file)
        OmegaConf.register_new_resolver("by_objective", by_objective)
    if not OmegaConf.has_resolver("if_data_path"):
        OmegaConf.register_new_resolver("if_data_path", if_data_path)
    if not OmegaConf.has_resolver("whole_gib"):  # conf/hydra/launcher/slurm.yaml: SLURM takes whole GB
        OmegaConf.register_new_resolver("whole_gib", lambda gib: None if gib is None else math.ceil(float(gib)))
    if not OmegaConf.has_resolver("auto_attention"):  # the schema's model.attn_implementation default
        OmegaConf.register_new_resolver("auto_attention", auto_attention)
    if not OmegaConf.has_resolver("auto_precision"):  # conf/precision/auto.yaml: this machine's pick
        from .devices import auto_precision_value

        OmegaConf.register_new_resolver("auto_precision", auto_precision_value)


def auto_attention(architecture: str, packing: bool, strategy: str, padding_free: bool) -> str:
    """The `${auto_attention:...}` resolver of the schema's model.attn_implementation default."""
    data = {"packing": packing, "packing_strategy": strategy, "padding_free": padding_free}
    return pick_for(str(architecture), padding_free_on(data))


def if_data_path(path: str, value: Any, otherwise: Any = None, *, _parent_: Any) -> Any:
    """`${if_data_path:PATH,VALUE[,OTHERWISE]}` in a data option file: VALUE while the data node's `path` is
    PATH, OTHERWISE (default null) once `data.path=...` points elsewhere. conf/data/order.yaml ties the
    shipped sample's eval file, metric and generation length to the sample this way, so a user's own
    `data.path` starts from the generic defaults instead of inheriting them."""
    from pathlib import Path

    current = None if OmegaConf.is_missing(_parent_, "path") else _parent_.get("path")
    if current is None:
        return otherwise
    if str(current) == str(path):
        return value
    a, b = Path(str(current)).expanduser(), Path(str(path)).expanduser()
    same = a.exists() and b.exists() and a.resolve() == b.resolve()
    return value if same else otherwise


def compose(overrides: list[str]) -> DictConfig:
    """The config `qlora train` would compose for these overrides, outside a Hydra run (launch,
    bench, tests). Hydra's composition errors become one UserError line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ..resources import CONF_DIR

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(one_line(err)) from None


def to_typed(cfg: DictConfig) -> TrainConfig:
    """The composed config as a TrainConfig: every `${...}` resolves now (not when config.yaml is
    written), no `+key` was added that no field reads (it would be ignored silently), and the model's
    family and figures are those of the config.json model.name_or_path names (config/model_dir.py)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
        for key in MODEL_FIGURES:  # `???`: unset, as null; the planner reads a model dir's config.json for it
            if OmegaConf.is_missing(cfg.model, key):
                cfg.model[key] = None
        extra = unknown_keys(cfg)
        if extra:
            raise UserError(
                f"unknown key {extra[0]}: no stack reads it; check the spelling (`{command()} --cfg job` prints every key)"
            )
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise UserError(one_line(err)) from None
    typed.model = from_config_json(typed.model)  # a model dir's own family and figures, as config.yaml records
    if typed.quant.storage_dtype is None:  # null: the default, as conf/dist/*.yaml would set it
        sharded = typed.dist.strategy in ("fsdp", "zero3") and typed.quant.method in ("nf4", "fp4")
        typed.quant.storage_dtype = str(typed.precision.dtype) if sharded else "uint8"
    if typed.model.attn_implementation == AUTO:  # after the family is known: config/attention.py
        typed.model.attn_implementation = pick_for(typed.model.architecture, padding_free_on(typed.data))
    return typed


def load(overrides: list[str]) -> TrainConfig:
    """The typed config `qlora train` would run for these overrides, through the config-only checks."""
    from .checks import check_stack

    cfg = to_typed(compose(overrides))
    check_stack(cfg)
    return cfg


def precision_for(cfg: TrainConfig, gpus: list[int] | None) -> TrainConfig:
    """`cfg` with precision=auto picked again for `gpus` (the GPUs a plan is made for; None: this
    machine's, as the loader picked): name, dtype, and quant.compute_dtype where it follows the dtype.
    A precision the user named is kept."""
    from ..units import PRECISION_DTYPE, dtype_name
    from .devices import auto_precision

    name = auto_precision(gpus, bool(cfg.hardware.bf16))[0]
    if not cfg.precision.auto or name == cfg.precision.name:
        return cfg
    dtype = PRECISION_DTYPE[name]
    follows = dtype_name(cfg.quant.compute_dtype) == dtype_name(cfg.precision.dtype)
    extra = [f"quant.compute_dtype={dtype}"] if follows else []
    return with_overrides(cfg, [f"precision.name={name}", f"precision.dtype={dtype}", *extra])


def with_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """A copy of `cfg` with `key=value` overrides applied (the values parsed as on the command line,
    typed by the schema); `cfg` itself is left as it was."""
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.structured(cfg)
    try:
        node.merge_with_dotlist(list(overrides))
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        raise UserError(one_line(err)) from None


class Incomplete(ValueError):
    """A saved config.yaml lacks sections or keys that the run wrote: cut short or edited, not older."""


def read_saved(
    path: Path, dropped: list[str] | None = None, complete: str | tuple[str, ...] | None = None
) -> TrainConfig:
    """A saved run's config.yaml as a TrainConfig; a key it lacks (added to the schema after that run)
    takes the schema's default, unless `complete` requires every key ("keys": a run that recorded its
    files' hashes wrote them all) or these sections (a file cut short loses its last ones; an older run
    lacks only sections added since, e.g. logger, hub).
    A key the schema no longer reads is an error, or, given a `dropped` list, left out and named there.
    Raises OmegaConf's error or ValueError (yaml; Incomplete) when it does not fit."""
    saved = OmegaConf.load(path)
    if dropped is not None:
        for key in unknown_keys(saved):
            parent, _, last = key.rpartition(".")
            node = OmegaConf.select(saved, parent) if parent else saved
            node.pop(last)
            dropped.append(key)
    missing: list[str] = []
    if complete == "keys":
        missing = missing_keys(saved, TrainConfig, "")
    elif complete is not None:
        missing = [name for name in complete if not (OmegaConf.is_dict(saved) and name in saved)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise Incomplete(f"it lacks {', '.join(missing[:3])}{more}")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), saved))


def missing_keys(saved, schema: type, prefix: str) -> list[str]:
    """The schema's keys that a saved config does not have."""
    found = []
    for f in dataclasses.fields(schema):
        if not (OmegaConf.is_dict(saved) and f.name in saved):
            found.append(prefix + f.name)
        elif is_section(f):
            found += missing_keys(saved[f.name], f.type, f"{prefix}{f.name}.")
    return found


def to_yaml(cfg: TrainConfig) -> str:
    """config.yaml's text for a typed config: the same keys, order and values as the composed one."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)


def unknown_keys(cfg: DictConfig, schema: type = TrainConfig, prefix: str = "") -> list[str]:
    """Keys added with `+key=value` that no schema field reads."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    found = []
    for key in cfg:
        if key not in fields:
            found.append(prefix + str(key))
        elif is_section(fields[key]):
            found += unknown_keys(cfg[key], fields[key].type, f"{prefix}{key}.")
    return found


def one_line(err: Exception) -> str:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        from .objectives import NOT_OFFERED

        group, _, option = err.missing_cfg_file.rpartition("/")
        why = f"; {NOT_OFFERED[option]}" if group == "objective" and option in NOT_OFFERED else ""
        return f"{group}={option} is not an option; choose one of: {', '.join(err.options)}{why}"
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
