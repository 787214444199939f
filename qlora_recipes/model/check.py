"""The model dir a run names, checked before anything is loaded or written.

`check_model_dir` (no torch: `validate.check_config` runs it): a local dir has a readable config.json
with sane figures and complete safetensors weights (headers read, sizes compared; nothing loaded).
`check_hub_model`: a hub id is reachable or cached, in seconds (no retry storm offline).
`validate_model` (imports transformers): a model_type transformers knows, and peft.target_modules /
peft.modules_to_save naming modules the model has (the planner's inventory of it).
"""

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ..config.schema import ModelConfig, TrainConfig
from ..errors import UserError
from .checkpoint import hub_unreachable

log = logging.getLogger("train")


def check_model_dir(model: ModelConfig) -> None:
    """A local model dir: config.json readable with sane figures, safetensors weights complete. No torch."""
    path = str(model.name_or_path or "")
    local = Path(path).expanduser()
    where = f"model.name_or_path={path}"
    if not path.strip():
        raise UserError("model.name_or_path is empty; give a local model dir in the HF layout or a hub id")
    if not local.is_dir():
        if local.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1:
            what = "not a directory" if local.exists() else "no such directory"
            raise UserError(f"{where}: {what}; give a local model dir in the HF layout or a hub id")
        return  # a hub id: loading the tokenizer says whether it can be reached
    config = local / "config.json"
    if not config.is_file():
        raise UserError(
            f"{where}: no config.json in it, so it is not a model dir in the Hugging Face layout "
            "(save_pretrained writes one)"
        )
    cj = _read_json(config)
    if not isinstance(cj, dict) or not cj.get("model_type"):
        raise UserError(f"{config}: no model_type in it; it is not a transformers model config")
    text = cj["text_config"] if isinstance(cj.get("text_config"), dict) and "hidden_size" not in cj else cj
    for key in CONFIG_FIGURES:
        value = text.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserError(
                f"{config}: {key}={value!r} must be a positive integer; fix the file or save the model again"
            )
    _check_weights(local, where)


CONFIG_FIGURES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "max_position_embeddings",
)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not readable JSON ({' '.join(str(err).split())}); fix or replace the file") from None


def check_weight_files(local: Path, where: str) -> None:
    """A model dir's safetensors weights are there and whole (headers read, sizes compared): a merged
    dir read back, as a base is before training."""
    _check_weights(local, where)


def _check_weights(local: Path, where: str) -> None:
    """The weights from_pretrained(use_safetensors=True) reads are there and whole (headers only)."""
    index = local / "model.safetensors.index.json"
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: no weight_map in it; fix or replace the file")
        files = sorted({local / str(name) for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise UserError(f"{where}: {f.name}, named in {index.name}, is missing; fetch the model again")
    elif (local / "model.safetensors").is_file():
        files = [local / "model.safetensors"]
    else:
        found = sorted(p.name for p in local.iterdir() if p.suffix in (".bin", ".safetensors", ".pt", ".pth"))
        raise UserError(
            f"{where}: no model.safetensors (nor model.safetensors.index.json) in it"
            + (f", only {', '.join(found[:3])}" if found else "")
            + "; weights load from safetensors only: save the model with save_pretrained(safe_serialization=True)"
        )
    for f in files:
        _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    """The header parses and its tensors end exactly where the file does (truncated or garbage files fail)."""
    problem = None
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size:
                problem = f"{size} bytes, no valid safetensors header"
            else:
                header = json.loads(f.read(n))
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                if 8 + n + max(ends, default=0) != size:
                    problem = f"{size} bytes, but its header describes {8 + n + max(ends, default=0)}"
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror or err}); check the file's permissions") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        problem = "its safetensors header is not valid"
    if problem:
        raise UserError(f"{path}: corrupt or truncated weights ({problem}); fetch or save the model again")


def validate_model(cfg: TrainConfig) -> None:
    """What needs transformers or the model's module names: a model_type transformers knows, and peft's
    target_modules / modules_to_save naming modules the model has. Before anything is written."""
    local = Path(str(cfg.model.name_or_path)).expanduser()
    if local.is_dir():
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        cj = _read_json(local / "config.json")
        custom = "auto_map" in cj
        if cj["model_type"] not in CONFIG_MAPPING_NAMES and not (custom and cfg.model.trust_remote_code):
            raise UserError(
                f"{local / 'config.json'}: model_type {cj['model_type']!r} is not a model type transformers knows"
                + ("; the dir ships its own code: set model.trust_remote_code=true if you trust it" if custom else "")
            )
    _check_target_names(cfg)


def _check_target_names(cfg: TrainConfig) -> None:
    from ..planner.figures import inventory, model_figures

    targets, to_save = cfg.peft.target_modules, cfg.peft.modules_to_save or []
    fig = model_figures(cfg.model)
    blocks = inventory(fig)
    linears = [lin.name for b in blocks for lin in b.linears]
    names = linears + [e[0] for b in blocks for e in b.embeddings]
    modules = names + [b.name for b in blocks] + [p[0].rpartition(".")[0] for b in blocks for p in b.params]
    layers = ", ".join(sorted({n.rpartition(".")[2] for n in linears if n != "lm_head"}))
    for t in [] if isinstance(targets, str) or not isinstance(targets, Sequence) else targets:
        if not any(n == t or n.endswith("." + t) for n in names):
            raise UserError(
                f"peft.target_modules: {t!r} is no layer of this {fig.architecture} model (its linear layers: {layers}); "
                "fix the name or use peft.target_modules=all-linear"
            )
    for t in to_save:
        if not any(n.endswith(t) for n in modules):
            raise UserError(f"peft.modules_to_save: {t!r} is no module of this {fig.architecture} model; e.g. lm_head")


def is_hub_id(model: ModelConfig) -> bool:
    """model.name_or_path names a hub repo (check_model_dir has refused what looks like a missing path)."""
    return not Path(str(model.name_or_path or "")).expanduser().is_dir()


def check_hub_model(model: ModelConfig) -> None:
    """A hub id, before anything asks the hub for it: the hub answers, or the model is in the local
    cache (then offline mode for this process, so loading reads the cache instead of retrying the
    network for a minute), or one line saying how to use a local dir. One short probe, no retries."""
    if not is_hub_id(model):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    repo, revision = str(model.name_or_path), model.revision
    cached = isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise UserError(
            f"model.name_or_path={repo} is a hub id, HF_HUB_OFFLINE is set and it is not in the cache "
            f"({constants.HF_HUB_CACHE}); {LOCAL_DIR_HINT.format(repo=repo)}"
        )
    problem = hub_unreachable(constants.ENDPOINT)
    if problem is None:
        return
    if cached:
        log.warning(
            "the hub (%s) cannot be reached (%s): %s loads from the local cache", constants.ENDPOINT, problem, repo
        )
        constants.HF_HUB_OFFLINE = True  # what transformers asks (huggingface_hub.is_offline_mode)
        os.environ["HF_HUB_OFFLINE"] = "1"  # and any process this one starts
        return
    raise UserError(
        f"model.name_or_path={repo} is a hub id and the hub ({constants.ENDPOINT}) cannot be reached ({problem}); "
        + LOCAL_DIR_HINT.format(repo=repo)
    )


LOCAL_DIR_HINT = (
    "point model.name_or_path at a local model dir in the HF layout (model.name_or_path=/path/to/dir; "
    "where there is a network: hf download {repo} --local-dir /path/to/dir)"
)
