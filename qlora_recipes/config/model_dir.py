"""A model dir's own config.json decides `model.architecture` and the figures a run records.

`model.name_or_path=DIR` alone composes the default conf/model entry (the shipped tiny Llama), whose
family and figures describe that model, not DIR's. `from_config_json` replaces them with DIR's
config.json (or a hub id's config.json already in the HF cache: nothing is fetched here), so the
checks (trainer.lean_rmsnorm's norm form), the loader and config.yaml all see the model that loads.
A value stated otherwise, by a conf/model entry (model=<entry>) or on the command line, that
contradicts the config.json is refused in one line naming both; a value equal to the default entry's
or the schema's default is not a statement about DIR and gives way. No torch, no network.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from ..errors import UserError
from ..families import traits
from .schema import ModelConfig

# ModelConfig field -> the config.json keys that hold it (the first found)
CONFIG_KEYS = {
    "architecture": ("model_type",),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_layers": ("num_hidden_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads",),
    "intermediate_size": ("intermediate_size", "n_inner"),
    "vocab_size": ("vocab_size",),
    "head_dim": ("head_dim",),
    "max_position_embeddings": ("max_position_embeddings",),
    "tie_embeddings": ("tie_word_embeddings",),
}


def config_json_path(model: ModelConfig) -> Path | None:
    """The config.json model.name_or_path names: a local dir's, or a hub id's from the HF cache."""
    name = str(model.name_or_path or "")
    local = Path(name).expanduser()
    if local.is_dir():
        return local / "config.json" if (local / "config.json").is_file() else None
    if not name or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", revision=model.revision)
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def own_values(cj: dict[str, Any]) -> dict[str, Any]:
    """The family and figures a config.json gives, as ModelConfig values (a multimodal checkpoint's from
    its text_config; the family stays the checkpoint's own model_type, which transformers loads)."""
    text = cj["text_config"] if isinstance(cj.get("text_config"), dict) and "hidden_size" not in cj else cj
    found: dict[str, Any] = {"architecture": str(cj["model_type"]).lower()}
    for field, keys in CONFIG_KEYS.items():
        value = next((text[k] for k in keys if text.get(k) is not None), None)
        if field != "architecture" and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found[field] = value
    heads, hidden = found.get("num_heads"), found.get("hidden_size")
    if heads and "num_kv_heads" not in found:
        found["num_kv_heads"] = heads  # transformers' default: no grouped-query attention
    if heads and hidden and "head_dim" not in found:
        found["head_dim"] = hidden // heads
    tied = text.get("tie_word_embeddings", cj.get("tie_word_embeddings"))
    found["tie_embeddings"] = tied if isinstance(tied, bool) else traits(found["architecture"]).tie_embeddings
    return found


def from_config_json(model: ModelConfig) -> ModelConfig:
    """`model` with its family and figures from the config.json it names; refused in one line where a
    stated value contradicts it. As given when there is no config.json to read here."""
    path = config_json_path(model)
    cj = _read(path) if path is not None else None
    if not isinstance(cj, dict) or not cj.get("model_type"):
        return model  # none, or one check_model_dir refuses in its own line
    own = own_values(cj)
    text_type = str((cj.get("text_config") or {}).get("model_type", "")).lower()
    wrong = {
        k: getattr(model, k)
        for k, v in own.items()
        if _comparable(getattr(model, k))
        and getattr(model, k) != v
        and not (k == "architecture" and str(getattr(model, k)).lower() == text_type)
    }
    stated = {k: v for k, v in wrong.items() if v not in _unstated(k)}
    if stated:
        raise UserError(_contradiction(model, stated, own, path))
    kept = {k for k in own if getattr(model, k) is not None and not _comparable(getattr(model, k))}
    if "architecture" not in wrong:
        kept.add("architecture")  # the same family (a multimodal checkpoint's text model named)
    return dataclasses.replace(model, **{k: v for k, v in own.items() if k not in kept})


def _comparable(value: Any) -> bool:
    """Set and in range: a figure below 1 is check_stack's to refuse (`model.num_layers=0 must be >= 1`)."""
    return value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value < 1)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _unstated(field: str) -> tuple:
    """The values of `field` that say nothing about a user's dir: the default entry's and the schema's."""
    schema = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    return (default_entry().get(field), schema.get(field))


@functools.lru_cache(maxsize=1)
def default_entry() -> dict[str, Any]:
    """The conf/model entry train.yaml composes by default (its figures are the shipped model's)."""
    from omegaconf import OmegaConf

    from ..resources import CONF_DIR

    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "train.yaml")).get("defaults", [])
    name = next((d["model"] for d in defaults if isinstance(d, dict) and "model" in d), None)
    if name is None:
        return {}
    node = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    return {k: node[k] for k in CONFIG_KEYS if k in node}


def _entry_named(model: ModelConfig) -> str | None:
    """The conf/model option whose family and figures `model` has, every one it sets (model=<it> was chosen)."""
    from omegaconf import OmegaConf

    from ..resources import CONF_DIR

    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        node = OmegaConf.load(path)
        if all(node[k] == getattr(model, k) for k in CONFIG_KEYS if k in node):
            return path.stem
    return None


def _contradiction(model: ModelConfig, stated: dict[str, Any], own: dict[str, Any], path: Path) -> str:
    said = ", ".join(f"{k} {v}" for k, v in stated.items())
    real = ", ".join(f"{k} {own[k]}" for k in stated)
    entry = _entry_named(model)
    if entry is not None:
        return (
            f"model={entry} ({said}) contradicts {path} ({real}); drop model={entry} to take the dir's own "
            "family and figures, or point model.name_or_path at the model that entry describes"
        )
    overrides = " ".join(f"model.{k}={v}" for k, v in stated.items())
    return f"{overrides} contradicts {path} ({real}); drop the override: the dir's config.json gives the figures"
