"""The hardware a plan is made for: GPU sizes, host RAM, and the `offload.max_memory` budgets.

Nothing here imports torch unless a GPU may be present (an NVIDIA device node or driver entry
exists), so planning on a GPU-less machine stays fast. Sizes follow accelerate's convention:
"80GB" is 80e9 bytes, "75GiB" is 75 * 2**30 bytes, a bare number is bytes.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .units import GiB, fmt_gib, parse_size

# "auto" budgets (conf/offload/*.yaml): a share of each GPU's total memory and of host RAM.
AUTO_GPU_FRACTION = 0.90
AUTO_CPU_FRACTION = 0.80


@dataclass(frozen=True)
class Hardware:
    """What the plan is for: total bytes of each GPU (cuda:0, cuda:1, ...) and of host RAM."""

    gpus: tuple[int, ...]
    host_ram: int
    declared: bool = False  # True when the caller described it (--gpus), False when detected here

    @property
    def has_gpu(self) -> bool:
        return len(self.gpus) > 0


def parse_gpus(text: str) -> list[int]:
    """`--gpus 80GB,80GB` or `2x80GiB` or `none` -> list of GPU total bytes."""
    text = text.strip()
    if text.lower() in ("", "none", "0", "cpu"):
        return []
    gpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        count = 1
        m = re.match(r"^(\d+)\s*[xX*]\s*(\d.*)$", part)
        if m:
            count, part = int(m.group(1)), m.group(2)
        size = parse_size(part, "--gpus")
        if size <= 0:
            raise UserError(f"--gpus {text!r}: a GPU needs a positive size, e.g. 80GB or 2x80GiB")
        gpus.extend([size] * count)
    return gpus


def _gpu_may_exist() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.isdir("/proc/driver/nvidia/gpus"))


def detect_gpus() -> list[int]:
    """Total memory of each visible CUDA device; [] without importing torch when there is none."""
    if not _gpu_may_exist():
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [int(torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver plans like a machine without GPU
        return []


def host_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def hardware(gpus: list[int] | None = None, host: int | None = None) -> Hardware:
    """Declared devices where given, else what this machine has."""
    if gpus is not None:
        for i, g in enumerate(gpus):
            if not isinstance(g, (int, float)) or g <= 0:
                raise UserError(f"GPU {i} size {g!r} is not a positive number of bytes")
        return Hardware(tuple(int(g) for g in gpus), int(host) if host else host_ram(), declared=True)
    return Hardware(tuple(detect_gpus()), int(host) if host else host_ram(), declared=False)


def resolve_max_memory(max_memory: Mapping[str, object], hw: Hardware, notes: list[str]) -> dict:
    """`offload.max_memory` -> {0: bytes, 1: bytes, ..., "cpu": bytes} for every device of `hw`.

    "gpu" sets every GPU, "0", "1", ... one GPU, "cpu" the host; missing ones and "auto" are
    AUTO_GPU_FRACTION of the GPU's total and AUTO_CPU_FRACTION of host RAM. A budget larger than
    the device, negative or unparsable is a UserError.
    """
    raw = {str(k).strip().lower(): v for k, v in dict(max_memory or {}).items()}
    for key in raw:
        if key not in ("gpu", "cpu") and not key.isdigit():
            raise UserError(
                f"offload.max_memory.{key}: unknown device key; use gpu (every GPU), 0, 1, ... (one GPU) or cpu"
            )
    for key, value in raw.items():  # every value must parse, whether or not this machine uses it
        if not (isinstance(value, str) and value.strip().lower() == "auto"):
            parse_size(value, f"offload.max_memory.{key}")
    gpu_keys = [k for k in raw if k == "gpu" or k.isdigit()]
    if not hw.has_gpu and gpu_keys:
        notes.append(
            f"offload.max_memory.{gpu_keys[0]} ignored: no GPU here (declare one with --gpus / plan_stack(gpus=...))"
        )
    resolved: dict = {}
    for i, total in enumerate(hw.gpus):
        value = raw.get(str(i), raw.get("gpu", "auto"))
        key = str(i) if str(i) in raw else "gpu"
        if isinstance(value, str) and value.strip().lower() == "auto":
            budget = int(total * AUTO_GPU_FRACTION)
        else:
            budget = parse_size(value, f"offload.max_memory.{key}")
            if budget > total:
                raise UserError(
                    f"offload.max_memory.{key}={value} is more than cuda:{i} has ({fmt_gib(total)}); "
                    f"use at most {int(total // GiB)}GiB or auto"
                )
        resolved[i] = budget
    for key in raw:
        if key.isdigit() and hw.has_gpu and int(key) >= len(hw.gpus):
            raise UserError(
                f"offload.max_memory.{key} names GPU {key} but there are {len(hw.gpus)} GPU(s) "
                f"(cuda:0..{len(hw.gpus) - 1}); use gpu or an index below {len(hw.gpus)}"
            )
    value = raw.get("cpu", "auto")
    if isinstance(value, str) and value.strip().lower() == "auto":
        resolved["cpu"] = int(hw.host_ram * AUTO_CPU_FRACTION)
    else:
        budget = parse_size(value, "offload.max_memory.cpu")
        if budget > hw.host_ram:
            raise UserError(
                f"offload.max_memory.cpu={value} is more than this host's RAM ({fmt_gib(hw.host_ram)}); "
                f"use at most {int(hw.host_ram // GiB)}GiB or auto"
            )
        resolved["cpu"] = budget
    return resolved


def disk_free(folder: str | None) -> int:
    """Free bytes on the filesystem that would hold `folder` (its nearest existing parent)."""
    path = Path(folder or ".").expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return int(shutil.disk_usage(path).free)
