"""A written GGUF read back with `gguf`'s reader and held to the merged weights it was made from.

    check_gguf(gguf_path, merged_dir) -> {"tensors", "gguf_tensors", "types", "worst"}

Every tensor of the merged safetensors must be in the GGUF (named by gguf's own HF -> GGUF name map
for the file's architecture) with its shape, and its dequantized values must equal the merged weights
within the rounding of the type it was stored in: none for F32, half an ulp for F16 / BF16, and for
Q8_0 half a step of each 32-value block's scale plus the scale's own F16 rounding. llama.cpp's
converter reorders the rows of Llama's q/k projections (its rotary layout); a tensor is compared as
written or in that order.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

# relative rounding of each float type: half its unit in the last place
HALF_ULP = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}
Q8_BLOCK = 32


def _merged_tensors(merged_dir: Path):
    from safetensors import safe_open

    for shard in sorted(merged_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name).float().numpy()


def _bound(ref, type_name: str):
    """The largest |GGUF - merged| each value may have once stored as `type_name`."""
    import numpy as np

    tiny = 2.0**-24  # F16's smallest step: values that small round to it
    if type_name in HALF_ULP:
        return np.abs(ref) * HALF_ULP[type_name] + (tiny if type_name != "F32" else 0.0)
    if type_name == "Q8_0":
        blocks = ref.reshape(*ref.shape[:-1], -1, Q8_BLOCK)
        scale = np.abs(blocks).max(axis=-1, keepdims=True) / 127
        return np.broadcast_to(scale * (0.5 + 127 * 2.0**-11) + tiny, blocks.shape).reshape(ref.shape)
    raise UserError(f"the GGUF holds a {type_name} tensor; this check knows F32, F16, BF16 and Q8_0")


def _rotary_order(ref, heads: int):
    """llama.cpp's order of a q/k projection's rows (convert_hf_to_gguf's LlamaModel.permute)."""
    rows = ref.shape[0]
    return ref.reshape(heads, 2, rows // heads // 2, *ref.shape[1:]).swapaxes(1, 2).reshape(ref.shape)


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    return field.contents() if field is not None else default


def _candidates(ref, gguf_name: str, reader, arch: str) -> list:
    heads = {
        "attn_q": _field(reader, f"{arch}.attention.head_count"),
        "attn_k": _field(reader, f"{arch}.attention.head_count_kv") or _field(reader, f"{arch}.attention.head_count"),
    }
    part = gguf_name.split(".")[-2] if gguf_name.count(".") >= 2 else ""
    n = heads.get(part)
    if n and ref.ndim == 2 and ref.shape[0] % (2 * n) == 0:
        return [ref, _rotary_order(ref, int(n))]
    return [ref]


def check_gguf(gguf_path: Path, merged_dir: Path) -> dict:
    """Every merged tensor in the GGUF, equal within its type's rounding; a UserError naming the first that is not."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise UserError(f"{gguf_path}: architecture {arch!r} is unknown to the installed gguf reader; upgrade gguf")
    blocks = int(_field(reader, f"{arch}.block_count", 0))
    names = gguf.get_tensor_name_map(by_name[arch], blocks)
    tensors = {t.name: t for t in reader.tensors}
    types: dict[str, int] = {}
    worst = {"tensor": None, "abs_error": 0.0, "type": None}
    count = 0
    for hf_name, ref in _merged_tensors(merged_dir):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name not in tensors:
            raise UserError(
                f"{gguf_path}: no tensor for the merged {hf_name} ({name or 'no GGUF name'}); convert again"
            )
        t = tensors[name]
        values = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        if values.shape != ref.shape:
            raise UserError(f"{gguf_path}: {name} has shape {values.shape}, the merged {hf_name} {ref.shape}")
        kind = t.tensor_type.name
        candidates = _candidates(ref, name, reader, arch)
        errors = [np.abs(values - c) for c in candidates]
        fits = [bool((e <= _bound(c, kind)).all()) for e, c in zip(errors, candidates, strict=True)]
        if not any(fits):
            raise UserError(
                f"{gguf_path}: {name} ({kind}) differs from the merged {hf_name} by up to "
                f"{min(float(e.max()) for e in errors):.3g}, more than {kind} rounds; convert again"
            )
        err = float(errors[fits.index(True)].max())
        if err >= worst["abs_error"]:
            worst = {"tensor": name, "abs_error": err, "type": kind}
        types[kind] = types.get(kind, 0) + 1
        count += 1
    return {"tensors": count, "gguf_tensors": len(tensors), "types": types, "worst": worst}
