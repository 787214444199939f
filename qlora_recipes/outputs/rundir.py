"""Reading what train.py left behind: a run dir (config.yaml + adapter/) or a merged model dir.

Merge and generate both start here: which kind of dir a path is (with a one-line UserError naming what
is missing otherwise), the run's resolved config, prompt style and prompt format, the adapter checked against the base
the config loads (by name, then by tensor shapes), and the stack as it was trained and evaluated — the
quantized base via `loading.load_model` plus the saved adapter. Nothing here imports torch,
transformers or peft at import time, so bad input answers fast.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config.schema import TrainConfig
from ..errors import UserError
from .prompts import PromptFormat, load_prompt_format, recorded_prompt_format
from .runfiles import check_manifest, read_json

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What merge and generate read of a run's config: a run dir without a manifest (older) must have these
# sections; sections added since (logger, hub, ...) take their defaults.
STACK_SECTIONS = ("model", "data", "quant", "peft", "precision", "trainer")
MERGE_REPORT = "merge_report.json"  # written by merge into a merged dir; generate reads its prompt style


def is_merged_dir(path: Path) -> bool:
    """A standalone model dir: config.json with safetensors weights and no adapter."""
    return (
        (path / "config.json").is_file()
        and not (path / "adapter_config.json").is_file()
        and ((path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file())
    )


def resolve_dir(path: str | Path, allow_merged: bool) -> tuple[str, Path]:
    """("run", run_dir) or ("merged", model_dir); a UserError naming what is missing otherwise.
    A run's `adapter/` dir is taken as its run dir."""
    raw = str(path)
    path = Path(raw).expanduser()
    usage = "pass a run dir (config.yaml + adapter/ written by train.py)" + (
        " or a merged model dir (config.json + safetensors, written by scripts/merge.py)" if allow_merged else ""
    )
    if not path.exists():
        raise UserError(f"{raw}: no such directory; {usage}")
    if not path.is_dir():
        raise UserError(f"{raw}: is a file, not a directory; {usage}")
    if (path / "adapter_config.json").is_file() and (path.parent / "config.yaml").is_file():
        path = path.parent  # run/adapter -> run
    if (path / "config.yaml").is_file():
        if not (path / "adapter" / "adapter_config.json").is_file():
            raise UserError(
                f"{raw}: a run dir without a saved adapter (no adapter/adapter_config.json); train.py saves it when "
                "training finishes, so let the run finish (or point at a finished run)"
            )
        if not (path / "adapter" / ADAPTER_WEIGHTS).is_file():
            raise UserError(
                f"{raw}: adapter/ has no {ADAPTER_WEIGHTS}; the adapter was not saved completely, re-run training"
            )
        return "run", path
    if is_merged_dir(path):
        if not allow_merged:
            raise UserError(f"{raw}: is already a merged model (config.json, no adapter); {usage}")
        return "merged", path
    if (path / "adapter_config.json").is_file():
        raise UserError(
            f"{raw}: a bare adapter dir with no run config next to it; {usage} (the run dir holds config.yaml, "
            "which says which base and quantization the adapter was trained with)"
        )
    merged = " and not a merged model (no config.json with safetensors weights)" if allow_merged else ""
    raise UserError(f"{raw}: not a run dir (no config.yaml and adapter/){merged}; {usage}")


def load_run_config(run_dir: Path) -> TrainConfig:
    """The run's fully resolved config.yaml, typed by the schema, after its files are checked against the
    manifest the run wrote when it finished. Without a manifest (an older run) every section of the stack
    must be there (STACK_SECTIONS): a file cut short is damage, not an older run whose missing keys take
    today's defaults. With one, config.yaml is byte for byte what the run wrote (its sha256), so a key it
    lacks was added to the schema since (init_from, objective.ref_adapter, ...) and takes its default."""
    from omegaconf.errors import OmegaConfBaseException

    from ..config.loader import Incomplete, read_saved

    recorded = check_manifest(run_dir)
    path = run_dir / "config.yaml"
    try:
        cfg = read_saved(path, complete=None if recorded else STACK_SECTIONS)
    except Incomplete as err:
        raise UserError(
            f"{path}: damaged or cut short ({err}; a run writes them all); restore it or re-run training"
        ) from None
    except (OmegaConfBaseException, ValueError) as err:  # yaml errors are ValueErrors too
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{path}: not a config this version of train.py wrote ({first}); re-run training") from None
    return cfg


def run_metrics(run_dir: Path) -> dict:
    """The run's metrics.json ({} when it has none); a UserError naming it when it is damaged."""
    path = run_dir / "metrics.json"
    return read_json(path, "re-run training") if path.is_file() else {}


def run_prompt_style(run_dir: Path, cfg: TrainConfig) -> str:
    """How the run's prompts were rendered: "chat" (messages / conversational prompt_completion),
    "alpaca" (instruction rows wrapped in the Alpaca template) or "plain"."""
    stats = run_metrics(run_dir).get("data") or {}
    fmt = stats.get("format", cfg.data.format)
    conversational = bool(stats.get("conversational", False))
    if fmt == "messages" or conversational:
        return "chat"
    if fmt == "alpaca":
        return "alpaca"
    return "plain"


def run_prompt_format(run_dir: Path, cfg: TrainConfig, style: str) -> PromptFormat:
    """How a plain prompt is wrapped for this run (`style`: the run's, or one --chat / --no-chat forced):
    the prompt format its metrics.json recorded; for a run dir from before that record, the one its data
    (config.yaml's data group) gives when read again; else the style alone."""
    recorded = recorded_prompt_format(run_dir)
    if recorded is None:
        from .. import data  # (imports datasets: only for such older run dirs)

        try:
            recorded = data.load_splits(cfg.data, None, int(cfg.trainer.seq_len), int(cfg.seed))[2]["prompt_format"]
        except UserError as err:
            log.warning(
                "%s records no prompt format and its data cannot be read again (%s); plain prompts go in as %s "
                "prompts without the data's prefix or suffix (--raw to send them exactly as typed)",
                run_dir,
                err,
                style,
            )
        else:
            log.info("%s records no prompt format (an older run): taken from its data, %s", run_dir, recorded)
    return load_prompt_format(run_dir, style, recorded)


def run_tokenizer(cfg: TrainConfig, run_dir: Path):
    """The tokenizer saved with the adapter (the one training used), else the base's."""
    from transformers import AutoTokenizer

    from ..model import loading

    try:
        return AutoTokenizer.from_pretrained(str(run_dir / "adapter"), trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):
        return loading.load_tokenizer(cfg.model)


def adapter_config(adapter_dir: Path) -> dict:
    """The adapter's adapter_config.json; a UserError when it cannot be read."""
    path = adapter_dir / "adapter_config.json"
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, OSError) as err:
        raise UserError(
            f"{path}: not readable JSON ({err}); the adapter was not saved completely, re-run training"
        ) from None


def same_base(a: str, b: str) -> bool:
    """Same base model: equal ids, the same existing dir, or the same last path component (a run dir
    moved with the repository, or a hub id against a local copy named after it)."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists() and pa.resolve() == pb.resolve():
        return True
    return pa.name.lower() == pb.name.lower()


def check_adapter_base(cfg: TrainConfig, run_dir: Path) -> dict:
    """The adapter must have been trained on the base the run's config loads (by name)."""
    adapter_cfg = adapter_config(run_dir / "adapter")
    if adapter_cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(
            f"{run_dir}/adapter: a {adapter_cfg.get('peft_type')} adapter; only LoRA/DoRA/rsLoRA adapters merge"
        )
    trained_on = adapter_cfg.get("base_model_name_or_path")
    loads = cfg.model.name_or_path
    if trained_on and not same_base(str(trained_on), str(loads)):
        raise UserError(
            f"{run_dir}/adapter was trained on base {trained_on} (adapter_config.json base_model_name_or_path) but "
            f"{run_dir}/config.yaml loads model.name_or_path={loads}; an adapter only fits the base it was trained on: "
            "set model.name_or_path in config.yaml to that base (if it is the same model at another path, fix "
            "base_model_name_or_path in adapter_config.json)"
        )
    return adapter_cfg


def check_adapter_shapes(model, run_dir: Path, adapter_cfg: dict) -> None:
    """Every adapter tensor must fit a module of the loaded base (shapes), before peft loads it (peft
    would fail with a size-mismatch traceback, or skip modules it cannot find with only a warning)."""
    from safetensors import safe_open

    path = run_dir / "adapter" / ADAPTER_WEIGHTS
    trained_on = adapter_cfg.get("base_model_name_or_path") or "an unknown base"
    fix = f"the adapter was trained on {trained_on}: load that base (model.name_or_path in {run_dir}/config.yaml)"
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise UserError(f"{path}: not a readable safetensors file ({err}); re-run training") from None
    for key, shape in shapes.items():
        name = key.removeprefix("base_model.model.")
        marker = next((m for m in (".lora_A.", ".lora_B.", ".lora_magnitude_vector") if m in name), None)
        if marker is None:
            continue  # modules_to_save copies, trainable tokens: peft checks those itself
        module_name, side = name.split(marker)[0], "in" if marker == ".lora_A." else "out"
        module_name = module_name.replace(".base_layer", "")  # peft nests the wrappers of one module's weights
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise UserError(
                f"{run_dir}/adapter does not fit the loaded base {model.name_or_path}: it has weights for "
                f"{module_name}, which the base does not have; {fix}"
            ) from None
        if not hasattr(module, "in_features"):
            continue  # embeddings / convolutions: shapes checked by peft
        want = module.in_features if side == "in" else module.out_features
        got = shape[1] if marker == ".lora_A." else shape[0]
        if got != want:
            raise UserError(
                f"{run_dir}/adapter does not fit the loaded base {model.name_or_path}: {module_name} has "
                f"{side}_features={want} in the base but the adapter's {name} has shape {list(shape)}; {fix}"
            )


def load_stack(cfg: TrainConfig, run_dir: Path, adapter_cfg: dict | None = None):
    """The stack the run trained and evaluated: its (quantized) base via `loading.load_model`, plus
    the saved adapter, in eval mode."""
    adapter_cfg = adapter_cfg if adapter_cfg is not None else check_adapter_base(cfg, run_dir)
    from ..model import expert_lora, loading

    base = loading.load_model(cfg, run_dir)
    check_adapter_shapes(base, run_dir, adapter_cfg)
    try:
        model = expert_lora.load_adapter(base, str(run_dir / "adapter"))
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{run_dir}/adapter could not be loaded onto {cfg.model.name_or_path} ({first})") from None
    model.eval()
    return model
