"""The GPUs `qlora plan --gpus NAME` knows: memory, dense 16-bit tensor FLOPs, memory bandwidth and the
host link of each card, from the vendor's datasheet (cited per card). `--gpus H100` plans for that
card's memory as `--gpus 80GB` does (devices.MARKETED_GPU_GIB for the marketed sizes), and the time
model (planner/timing.py) reads the rest. Figures are dense (no 2:4 sparsity); on GeForce cards the
16-bit figure is the one with fp32 accumulation, which is what torch's bf16/fp16 matmuls use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: int  # as marketed
    tflops_16bit: float  # dense bf16 (fp16 where the card has no bf16) tensor-core peak, TFLOP/s
    memory_tb_s: float  # HBM / GDDR bandwidth, TB/s
    host_link_gb_s: float  # PCIe to the host, one direction, GB/s
    peer_link_gb_s: float  # GPU-to-GPU (NVLink where the board has it, else PCIe), one direction, GB/s
    bf16: bool = True  # computes bf16 natively (compute capability 8.0 and later)
    usable_gib: float | None = None  # what torch reports, where the marketed size is not in MARKETED_GPU_GIB


PCIE3, PCIE4, PCIE5 = 16.0, 32.0, 64.0  # GB/s per direction of an x16 slot (PCI-SIG: 8, 16, 32 GT/s per lane)

# Per card: the NVIDIA datasheet the figures come from. NVLink figures are NVIDIA's bidirectional
# totals halved (one direction).
CARDS = (
    # H100 Tensor Core GPU datasheet: SXM5 80 GB HBM3, BF16 1,979 TFLOPS with sparsity (989 dense),
    # 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5.
    Gpu("H100", 80, 989.0, 3.35, PCIE5, 450.0),
    # same datasheet, PCIe card: BF16 1,513 with sparsity (756 dense), HBM2e 2.0 TB/s, NVLink bridge 600 GB/s
    Gpu("H100-PCIe", 80, 756.0, 2.0, PCIE5, 300.0),
    # H200 Tensor Core GPU datasheet: SXM 141 GB HBM3e, BF16 1,979 with sparsity, 4.8 TB/s, NVLink 900 GB/s;
    # torch reports 140.4 GiB (nvidia-smi: 143,771 MiB)
    Gpu("H200", 141, 989.0, 4.8, PCIE5, 450.0, usable_gib=140.4),
    # A100 Tensor Core GPU datasheet: BF16 312 TFLOPS dense, 80 GB HBM2e 2,039 GB/s (SXM), 40 GB HBM2
    # 1,555 GB/s, NVLink 600 GB/s, PCIe Gen4
    Gpu("A100-80GB", 80, 312.0, 2.039, PCIE4, 300.0),
    Gpu("A100-40GB", 40, 312.0, 1.555, PCIE4, 300.0),
    # L40S datasheet: BF16 733 TFLOPS with sparsity (366 dense), 48 GB GDDR6 864 GB/s, PCIe Gen4, no NVLink
    Gpu("L40S", 48, 366.0, 0.864, PCIE4, PCIE4),
    # A10G (AWS G5): NVIDIA publishes no datasheet; AWS and NVIDIA's A10 sheet give 24 GB GDDR6 at 600 GB/s;
    # its tensor cores run at about 70 dense BF16 TFLOPS (the A10's 125 at the A10G's lower tensor clock)
    Gpu("A10G", 24, 70.0, 0.6, PCIE4, PCIE4),
    # L4 datasheet: BF16 242 TFLOPS with sparsity (121 dense), 24 GB GDDR6 300 GB/s, PCIe Gen4 x16
    Gpu("L4", 24, 121.0, 0.3, PCIE4, PCIE4),
    # Ada (AD102) whitepaper, RTX 4090: BF16 tensor with FP32 accumulate 165.2 dense, 24 GB GDDR6X 1,008 GB/s
    Gpu("RTX-4090", 24, 165.2, 1.008, PCIE4, PCIE4),
    # Ampere GA102 whitepaper, RTX 3090: BF16 tensor with FP32 accumulate 71 dense, 24 GB GDDR6X 936 GB/s
    Gpu("RTX-3090", 24, 71.0, 0.936, PCIE4, PCIE4),
    # Blackwell GB202, RTX 5090: FP16 tensor 838 TFLOPS with sparsity and FP16 accumulate, so 209.5 dense
    # with FP32 accumulate; 32 GB GDDR7 1,792 GB/s, PCIe Gen5; torch reports 31.4 GiB
    Gpu("RTX-5090", 32, 209.5, 1.792, PCIE5, PCIE5, usable_gib=31.4),
    # T4 datasheet: FP16 mixed precision 65 TFLOPS, no BF16; 16 GB GDDR6 320 GB/s, PCIe Gen3
    Gpu("T4", 16, 65.0, 0.32, PCIE3, PCIE3, bf16=False),
    # V100 datasheet (SXM2): 125 TFLOPS tensor (FP16), no BF16; HBM2 900 GB/s, NVLink 300 GB/s, PCIe Gen3;
    # 32 GB: torch reports 31.7 GiB
    Gpu("V100", 32, 125.0, 0.9, PCIE3, 150.0, bf16=False, usable_gib=31.7),
    Gpu("V100-16GB", 16, 125.0, 0.9, PCIE3, 150.0, bf16=False),
)
ALIASES = {"H100-SXM": "H100", "H100-80GB": "H100", "A100": "A100-80GB", "V100-32GB": "V100"}
ALIASES |= {"RTX4090": "RTX-4090", "RTX3090": "RTX-3090", "RTX5090": "RTX-5090"}


def _key(text: str) -> str:
    return re.sub(r"[\s_]+", "-", text.strip()).upper()


_BY_KEY = {_key(c.name): c for c in CARDS} | {
    _key(a): next(c for c in CARDS if c.name == n) for a, n in ALIASES.items()
}


def known_names() -> str:
    return ", ".join(c.name for c in CARDS)


def looks_like_a_name(text: str) -> bool:
    """A --gpus part that names a card rather than a size (a size is digits and a unit)."""
    return not re.fullmatch(r"[0-9.]+\s*[A-Za-z]{0,3}", text.strip()) or _key(text) in _BY_KEY


def card(text: str, what: str = "--gpus") -> Gpu:
    """The card `text` names (case, spaces and underscores do not matter); UserError listing them otherwise."""
    found = _BY_KEY.get(_key(text))
    if found is None:
        raise UserError(
            f"{what}: {text.strip()!r} is not a GPU we know; name one of {known_names()}, or give a size (80GB)"
        )
    return found
