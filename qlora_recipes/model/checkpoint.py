"""What a checkpoint says about itself, read without torch: where its config.json is (a local dir's,
or a hub id's in the local Hugging Face cache, fetched when the hub answers), the dtype and bytes its
weights are stored in (the safetensors headers; config.json's `dtype` where the weights are not here),
and the quantization it was saved with (a `quantization_config`, as the `*-bnb-4bit` uploads carry).
The planner plans what these say; a `quant` option that contradicts a saved quantization is one line.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

log = logging.getLogger("train")

# safetensors dtype names -> torch's
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def local_dir(name_or_path: str) -> Path | None:
    """The local model dir `name_or_path` names, when it is one with a config.json."""
    path = Path(str(name_or_path or "")).expanduser()
    return path if str(name_or_path or "").strip() and (path / "config.json").is_file() else None


def hub_config_json(repo: str, revision: str | None) -> tuple[Path | None, str]:
    """(config.json of a hub id, or None; where it came from, or why it is missing): the local HF cache
    first, else the hub when HF_HUB_OFFLINE is not set (one download, then cached)."""
    from huggingface_hub import constants

    return _hub_config_json(repo, revision, str(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))


@functools.lru_cache(maxsize=16)  # a plan's ladder and searches ask many times: the hub once a process
def _hub_config_json(repo: str, revision: str | None, cache: str, offline: bool) -> tuple[Path | None, str]:
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo, "config.json", cache_dir=cache, revision=revision)
    except ValueError:  # not a repo id at all (huggingface_hub's validation)
        return None, f"{repo!r} is no hub id"
    if isinstance(cached, str):
        return Path(cached), f"the HF cache ({cache})"
    if offline:
        return None, f"HF_HUB_OFFLINE is set and it is not in the HF cache ({cache})"
    problem = hub_unreachable(constants.ENDPOINT)  # one short probe: the download's retries take 30 s
    if problem is not None:
        return None, f"not in the HF cache ({cache}) and the hub ({constants.ENDPOINT}) cannot be reached: {problem}"
    try:
        path = hf_hub_download(repo, "config.json", revision=revision, cache_dir=cache)
    except Exception as err:  # unreachable, gated, missing: each library error says it differently
        first = " ".join(str(err).split()) or type(err).__name__
        return None, f"not in the HF cache ({cache}) and the hub did not give it: {first[:160]}"
    return Path(path), f"the hub ({constants.ENDPOINT})"


def read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not readable JSON ({' '.join(str(err).split())}); fix or replace the file") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object; fix or replace the file")
    return data


@dataclass(frozen=True)
class Stored:
    """The weights as a checkpoint stores them: the dtype of its floating parameters (None: unknown),
    and the bytes of all its tensors (None: its safetensors files are not here)."""

    dtype: str | None = None
    bytes: int | None = None


def stored_weights(folder: Path | None, config: dict[str, Any]) -> Stored:
    """The dtype and bytes of a checkpoint's weights: from its safetensors headers when the files are
    in `folder`, else the dtype config.json records (transformers writes `dtype`, formerly `torch_dtype`)."""
    declared = config.get("dtype") or config.get("torch_dtype")
    text = config.get("text_config")
    if not declared and isinstance(text, dict):
        declared = text.get("dtype") or text.get("torch_dtype")
    declared = str(declared) if declared in SAFETENSORS_DTYPES.values() else None
    files = _safetensors_files(folder) if folder is not None else []
    if not files:
        return Stored(declared, None)
    per_dtype: dict[str, int] = {}
    total = 0
    for f in files:
        header = _header(f)
        if header is None:
            return Stored(declared, None)  # check_model_dir reports a broken file; plan as declared
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            size = tensor["data_offsets"][1] - tensor["data_offsets"][0]
            total += size
            kind = SAFETENSORS_DTYPES.get(tensor["dtype"])
            if kind and name.endswith((".weight", ".bias")):  # the parameters, not a quantization state
                per_dtype[kind] = per_dtype.get(kind, 0) + size
    dtype = max(per_dtype, key=per_dtype.__getitem__) if per_dtype else declared
    return Stored(dtype, total)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return []
        files = [folder / n for n in sorted(names)]
        return files if all(f.is_file() for f in files) else []
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return header if isinstance(header, dict) else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class SavedQuant:
    """The quantization a checkpoint was saved with: bitsandbytes' (method nf4, fp4 or int8, its
    settings), or another library's quant_method (method is that name, nothing else known)."""

    method: str
    double_quant: bool = False
    storage_dtype: str = "uint8"
    skip_modules: tuple[str, ...] = ()

    @property
    def bitsandbytes(self) -> bool:
        return self.method in ("nf4", "fp4", "int8")

    def describe(self) -> str:
        if self.method == "int8":
            return "bitsandbytes int8"
        return f"bitsandbytes {self.method}, {'' if self.double_quant else 'no '}double quant, {self.storage_dtype} storage"


def saved_quantization(config: dict[str, Any]) -> SavedQuant | None:
    """The checkpoint's own `quantization_config`, or None for a 16/32-bit checkpoint."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    skip = tuple(str(m) for m in (q.get("llm_int8_skip_modules") or ()))
    if q.get("load_in_4bit") or q.get("_load_in_4bit"):
        return SavedQuant(
            method=str(q.get("bnb_4bit_quant_type", "fp4")),
            double_quant=bool(q.get("bnb_4bit_use_double_quant", False)),
            storage_dtype=str(q.get("bnb_4bit_quant_storage", "uint8")),
            skip_modules=skip,
        )
    if q.get("load_in_8bit") or q.get("_load_in_8bit"):
        return SavedQuant(method="int8", skip_modules=skip)
    return SavedQuant(method=str(q.get("quant_method", "unknown")))


def quant_contradiction(saved: SavedQuant, method: str, double_quant: bool, storage_dtype: str) -> str | None:
    """What of the run's quant group contradicts the checkpoint's own quantization (None: nothing).
    transformers loads a quantized checkpoint as it was saved, whatever the quant group says."""
    if not saved.bitsandbytes:
        return None  # another library's format: transformers itself says whether it loads beside bitsandbytes
    if method != saved.method:
        return f"quant={method}: use quant={saved.method}, as it is stored (or the checkpoint in 16 or 32 bits)"
    if method == "int8":
        return None
    if double_quant != saved.double_quant:
        return (
            f"quant.double_quant={str(double_quant).lower()}: use quant.double_quant={str(saved.double_quant).lower()}"
        )
    if storage_dtype != saved.storage_dtype:
        return f"quant.storage_dtype={storage_dtype}: use quant.storage_dtype={saved.storage_dtype}"
    return None


def config_json_of(name_or_path: str, revision: str | None) -> Path | None:
    """The config.json of a local dir or a hub id (HF cache, else the hub), or None where out of reach."""
    folder = local_dir(name_or_path)
    if folder is not None:
        return folder / "config.json"
    return hub_config_json(str(name_or_path), revision)[0]


def bitsandbytes_saved(name_or_path: str, revision: str | None) -> SavedQuant | None:
    """The bitsandbytes quantization a checkpoint is stored in, or None (16/32-bit, another format, out of reach)."""
    path = config_json_of(name_or_path, revision)
    saved = saved_quantization(read_config(path)) if path is not None else None
    return saved if saved is not None and saved.bitsandbytes else None


def hub_unreachable(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """Why the hub cannot be reached (one HEAD request, no retries), or None when it answers at all."""
    import httpx2
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=timeout_s)
    except (httpx2.TransportError, OSError) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        return text if len(text) <= 160 else text[:157] + "..."
    return None
