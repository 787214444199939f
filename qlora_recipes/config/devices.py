"""The hardware a plan is made for: GPU sizes and host RAM (this machine's, `--gpus`, or a recipe's
`hardware` node), the ranks a recipe runs with, whether this machine has the GPUs a recipe asks
for, and the `offload.max_memory` budgets. Nothing here imports torch unless a GPU may be present
(an NVIDIA device node or driver entry exists), so planning on a GPU-less machine stays fast. Sizes
follow accelerate's convention: "80GB" is 80e9 bytes, "75GiB" is 75 * 2**30 bytes, a bare number
is bytes; except that `--gpus` reads a card's marketed size ("24GB") as that card class
(MARKETED_GPU_GIB), the same figure the recipes' `hardware.gpu_memory_gib` uses. And the precision
`precision=auto` picks for that hardware (auto_precision).
"""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..units import PRECISION_DTYPE, GiB, check_bounds, fmt_gib, parse_size
from .gpus import Gpu, card, looks_like_a_name

if TYPE_CHECKING:
    from .schema import TrainConfig

# "auto" budgets (conf/offload/*.yaml): a share of each GPU's total memory and of host RAM.
AUTO_GPU_FRACTION = 0.90
AUTO_CPU_FRACTION = 0.80
# A GPU counts as big enough when torch reports at least this share of the declared memory
# (driver and ECC reservations differ a little between boards of one model).
GPU_MEMORY_TOLERANCE = 0.98
# A GPU as sold ("24GB") has less than that many GiB usable: torch's total_memory after ECC and the
# driver's reservation. `--gpus 24GB` and a recipe sized for a 24 GB card must plan the same card,
# so both take these figures (tests/unit/test_gpu_sizes.py holds every recipe's hardware node to them).
# 8 GB: RTX 4060 / 3070; 12 GB: RTX 3060 / 4070; 16 GB: T4 (15 GiB less ECC) / V100; 24 GB: RTX 3090 /
# 4090; 40 GB: A100 40GB; 48 GB: L40S (44.4 GiB with ECC) / RTX A6000; 80 GB: A100 / H100 80GB.
MARKETED_GPU_GIB = {8: 7.6, 12: 11.5, 16: 14.5, 24: 23.5, 40: 39.4, 48: 44.0, 80: 79.0}


@dataclass(frozen=True)
class Hardware:
    """What the plan is for: total bytes of each GPU (cuda:0, cuda:1, ...) and of host RAM."""

    gpus: tuple[int, ...]
    host_ram: int
    declared: bool = False  # True when the caller described it (--gpus), False when detected here

    @property
    def has_gpu(self) -> bool:
        return len(self.gpus) > 0


def gpu_size(text: str, what: str = "--gpus") -> int:
    """One GPU's usable bytes: a marketed size ("24GB", MARKETED_GPU_GIB) as that card class, any
    other size as accelerate reads it (GB = 1e9 bytes, GiB = 2**30 bytes)."""
    m = re.fullmatch(r"(\d+)\s*GB", text.strip(), re.IGNORECASE)
    if m and int(m.group(1)) in MARKETED_GPU_GIB:
        return int(MARKETED_GPU_GIB[int(m.group(1))] * GiB)
    return parse_size(text, what)


GPU_BYTES = (GiB, 2**40)  # one GPU's size as --gpus may give it: 1 GiB to 1 TiB
MAX_GPUS = 4096  # --gpus 1000000x80GB is a typo, not a cluster


def parse_gpus(text: str) -> list[int]:
    """`--gpus 80GB,80GB` or `2x80GiB` or `2xH100` or `none` -> list of GPU usable bytes (see gpu_size;
    a card's name, config/gpus.py, as its marketed size). Each size needs a unit and sane bounds
    (GPU_BYTES), each count 1 to MAX_GPUS."""
    return [size for size, _ in parse_gpu_cards(text)]


def card_bytes(gpu: Gpu) -> int:
    """A named card's usable bytes: its marketed size as `--gpus 80GB` reads it, else what torch reports."""
    return int((gpu.usable_gib or MARKETED_GPU_GIB[gpu.memory_gb]) * GiB)


def parse_gpu_cards(text: str) -> list[tuple[int, Gpu | None]]:
    """parse_gpus, each GPU with the card it names (None for a size)."""
    text = text.strip()
    if text.lower() in ("", "none", "0", "cpu"):
        return []
    gpus: list[tuple[int, Gpu | None]] = []
    for part in text.split(","):
        part = part.strip()
        count = 1
        m = re.match(r"^(\d+)\s*[xX*]\s*(\S.*)$", part)
        if m and not re.fullmatch(r"[0-9.]+\s*[A-Za-z]{1,3}", part):  # "80XB" is a bad size, not 80 of "B"
            count, part = int(m.group(1)), m.group(2)
            if not 1 <= count <= MAX_GPUS:
                raise UserError(
                    f"--gpus {text!r}: {count} GPUs of {part}; give 1 to {MAX_GPUS} (or --gpus none to plan for the CPU)"
                )
        if re.fullmatch(r"[0-9]+(\.[0-9]*)?", part):
            raise UserError(f"--gpus {text!r}: {part} has no unit; write e.g. {part}GB (a card as sold) or {part}GiB")
        if looks_like_a_name(part):
            named = card(part, f"--gpus {text!r}")
            gpus.extend([(card_bytes(named), named)] * count)
            continue
        gpus.extend([(check_bounds(gpu_size(part, "--gpus"), f"--gpus {text!r}", *GPU_BYTES), None)] * count)
    if len(gpus) > MAX_GPUS:
        raise UserError(f"--gpus {text!r}: {len(gpus)} GPUs; give at most {MAX_GPUS}")
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


def declared_gpus(cfg: TrainConfig) -> list[int]:
    """The GPUs of one node of the recipe's `hardware` node (total bytes each); [] = CPU only."""
    hw = cfg.hardware
    if hw.gpus <= 0:
        return []
    if not hw.gpu_memory_gib or hw.gpu_memory_gib <= 0:
        raise UserError(f"hardware.gpus={hw.gpus} without hardware.gpu_memory_gib: set the memory of each GPU in GiB")
    return [int(hw.gpu_memory_gib * GiB)] * int(hw.gpus)


def declared_host_ram(cfg: TrainConfig) -> int | None:
    """Host RAM of one node in bytes, or None (the planner then uses this machine's)."""
    ram = cfg.hardware.host_ram_gib
    return int(float(ram) * GiB) if ram else None


def host_budget(cfg: TrainConfig) -> int | None:
    """The host RAM a run on this machine is planned within: the declared hardware.host_ram_gib where it
    is below this machine's RAM, else None (the planner then uses this machine's)."""
    declared = declared_host_ram(cfg)
    return min(declared, host_ram()) if declared else None


def ranks(cfg: TrainConfig) -> int:
    """Ranks the recipe runs with: one per GPU on every node, or 1 for dist.strategy=none."""
    hw = cfg.hardware
    if cfg.dist.strategy == "none":
        return 1
    return max(1, hw.gpus) * max(1, hw.nodes)


def describe(cfg: TrainConfig) -> str:
    """The recipe's hardware node in words: 2 x 23.5 GiB GPUs (name)."""
    hw = cfg.hardware
    if hw.gpus <= 0:
        return hw.name
    nodes = f" x {hw.nodes} nodes" if hw.nodes > 1 else ""
    return f"{hw.gpus} x {hw.gpu_memory_gib:g} GiB GPU{'s' if hw.gpus > 1 else ''}{nodes} ({hw.name})"


def check_hardware_here(cfg: TrainConfig, recipe: str, gpus_here: list[int] | None = None) -> None:
    """UserError (one line, pointing to `make plan-<recipe>`) unless this node has the GPUs the
    recipe's hardware node asks for: at least that many, each with at least that much memory."""
    hw = cfg.hardware
    if hw.gpus <= 0:
        return
    here = detect_gpus() if gpus_here is None else list(gpus_here)
    want = int(hw.gpu_memory_gib * GiB) if hw.gpu_memory_gib else 0
    plan_hint = f"see its memory plan without a GPU: make plan-{recipe}"
    if len(here) < hw.gpus:
        have = "no CUDA GPU" if not here else f"{len(here)} GPU(s) of {', '.join(f'{g / GiB:.1f}' for g in here)} GiB"
        raise UserError(f"recipe {recipe} needs {describe(cfg)}; this machine has {have}; {plan_hint}")
    small = [(i, g) for i, g in enumerate(here[: hw.gpus]) if g < want * GPU_MEMORY_TOLERANCE]
    if small:
        i, g = small[0]
        raise UserError(
            f"recipe {recipe} needs {describe(cfg)}; cuda:{i} has {g / GiB:.1f} GiB; "
            f"{plan_hint} (or plan for this GPU: make plan ARGS='recipe={recipe}')"
        )


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


# ---------------------------------------------------------------------------------------------
# precision=auto (conf/precision/auto.yaml): the precision the hardware computes natively.
# ---------------------------------------------------------------------------------------------
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 CPUs with bf16 arithmetic


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cuda_device() -> tuple[str, tuple[int, int]] | None:
    """Name and compute capability of this machine's first CUDA GPU; None, without importing torch
    where no GPU may exist, when there is none."""
    if not _gpu_may_exist():
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))
    except Exception:  # a broken driver: the CPU decides, as for the plan
        return None


def auto_precision(gpus: list[int] | None = None, hardware_bf16: bool = True) -> tuple[str, str]:
    """What precision=auto picks, and why in words: bf16 where the device computes it natively (CUDA
    compute capability 8.0 and later; CPUs with AVX512-BF16 or AMX), fp16 on older GPUs (T4, V100),
    fp32 on other CPUs. `gpus` None: this machine's GPU, else its CPU; a list: the GPUs a plan is
    made for (`qlora plan --gpus`, a recipe's hardware node; [] is this machine's CPU), which compute
    bf16 unless `hardware_bf16` (the recipe's hardware.bf16) is false. That false never picks bf16,
    so a recipe sized for a pre-Ampere GPU gets fp16 on a GPU and fp32 on a CPU, as validation wants."""
    here = cuda_device() if gpus is None else None
    if here is not None:
        name, cap = here
        card = f"{name}, compute capability {cap[0]}.{cap[1]}"
        if cap < (8, 0):
            return "fp16", f"{card}, has no native bf16 (Ampere, 8.0, and later have)"
        if not hardware_bf16:
            return "fp16", f"{card}, but the recipe's hardware.bf16=false"
        return "bf16", f"{card}, computes bf16 natively"
    if gpus:
        if hardware_bf16:
            return "bf16", "the GPUs planned for compute bf16 natively: hardware.bf16=true (false plans fp16: T4, V100)"
        return "fp16", "the GPUs planned for have no native bf16: hardware.bf16=false (T4, V100)"
    native = [f for f in BF16_CPU_FLAGS if f in cpu_flags()]
    if not hardware_bf16:
        return "fp32", "no GPU here for fp16, and the recipe's hardware.bf16=false rules out bf16"
    if native:
        return "bf16", f"this CPU computes bf16 natively: {', '.join(native)}"
    return "fp32", f"this CPU has no native bf16: no {'/'.join(BF16_CPU_FLAGS)} flag"


def auto_precision_value(hardware_bf16: bool, key: str = "name") -> str:
    """The `${auto_precision:${hardware.bf16}[,dtype]}` resolver of conf/precision/auto.yaml: this
    machine's pick (name, or its dtype), for a config not pinned by resolve_auto_precision."""
    name = auto_precision(None, bool(hardware_bf16))[0]
    return PRECISION_DTYPE[name] if key == "dtype" else name


def precision_line(cfg: TrainConfig, gpus: list[int] | None = None) -> str | None:
    """The one line precision=auto says about its pick for `gpus` (see auto_precision); None for a
    precision the user named."""
    if not cfg.precision.auto:
        return None
    name, why = auto_precision(gpus, bool(cfg.hardware.bf16))
    return f"precision=auto: {name} ({why})"
