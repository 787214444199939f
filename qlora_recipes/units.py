"""Units every room shares: sizes (80GB, 75GiB), dtype names and widths.

The one place each of these is defined; nothing here imports torch or Hydra at import time.
Sizes follow accelerate's convention: "80GB" is 80e9 bytes, "75GiB" is 75 * 2**30 bytes, a bare
number is bytes.
"""

from __future__ import annotations

import re

from .errors import UserError

GiB = 1 << 30

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(value: object, what: str) -> int:
    """Bytes from 80GB / 75GiB / 512MiB / 1e9-style integers; UserError naming `what` otherwise."""
    if isinstance(value, bool):
        raise UserError(f"{what}={value!r} is not a size; use e.g. 75GiB, 80GB or auto")
    if isinstance(value, (int, float)):
        if value < 0:
            raise UserError(f"{what}={value} is negative; use a size like 75GiB, 80GB or auto")
        return int(value)
    text = str(value).strip()
    if text.startswith("-"):
        raise UserError(f"{what}={text} is negative; use a size like 75GiB, 80GB or auto")
    match = _SIZE_RE.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"{what}={text!r} is not a size; use e.g. 75GiB, 80GB, 512MiB or auto")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_bounded_size(value: object, what: str, low: int, high: int) -> int:
    """A size typed by a user for hardware (--gpus, --host-ram): it needs a unit (a bare 24 would be 24
    bytes) and must lie in [low, high]; one UserError line naming `what` otherwise."""
    text = str(value).strip()
    if re.fullmatch(r"[0-9]+(\.[0-9]*)?", text):
        raise UserError(f"{what} {text}: a size needs a unit; write e.g. {text}GB or {text}GiB")
    return check_bounds(parse_size(text, what), f"{what} {text}", low, high)


def check_bounds(n: int, what: str, low: int, high: int) -> int:
    if not low <= n <= high:
        raise UserError(
            f"{what}: {fmt_gib(n)} is outside {fmt_gib(low)} to {fmt_gib(high)}; check the number and the unit"
        )
    return n


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def fmt_bytes(n: float) -> str:
    """A size for a line a user reads: MiB below a GiB, GiB above."""
    return fmt_gib(n) if n >= GiB else f"{n / 2**20:.1f} MiB"


# Our dtype names (precision.dtype, quant.storage_dtype) and their short aliases -> canonical name.
DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
    "uint8": "uint8",
    "int8": "int8",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1}
PRECISION_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # precision.name -> dtype


def dtype_name(name: str) -> str:
    """Canonical dtype name for bf16/bfloat16/...; unknown names pass through unchanged."""
    return DTYPE_NAMES.get(str(name), str(name))


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[dtype_name(name)]


def torch_dtype(name: str):
    """The torch dtype for one of our dtype names (imports torch on first use)."""
    import torch

    return getattr(torch, dtype_name(name))
