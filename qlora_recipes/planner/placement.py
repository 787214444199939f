"""Where the loader puts each block: the execution device of a one-device plan, or the device map
from_pretrained infers under `offload.max_memory` (transformers' own inference: ported to the block
list in device_map.py for the text families the planner inventories, run on a meta model for the
others, skipped when the whole model provably fits one device), and that budget map in the form the
loader takes.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..config import devices as _dev
from ..errors import UserError
from ..units import dtype_bytes
from . import device_map
from .blocks import OUTPUT_HEAD
from .components import BlockBytes, should_convert, skip_patterns
from .constants import BNB_MAX_MEMORY_FACTOR
from .figures import Block, inventory, meta_model, vision_language
from .spec import StackSpec
from .vlm_layout import layout


def on_one_device(st: StackSpec) -> bool:
    """No device map to infer: the default (this rank's GPU, else the CPU), cpu or cuda:N."""
    return st.device_map is None or st.device_map == "cpu" or bool(re.fullmatch(r"(cuda:)?\d+", st.device_map))


def resolve_placement(
    st: StackSpec, hw: _dev.Hardware, bbs: list[tuple[Block, BlockBytes]], notes: list[str]
) -> tuple[str, dict, dict | None]:
    """(execution device, device map, resolved max_memory or None) for the stack on `hw`."""
    if st.device_map is None:
        if hw.has_gpu:
            rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            if rank >= len(hw.gpus):
                rank = 0
            return f"cuda:{rank}", {"": rank}, None
        return "cpu", {"": "cpu"}, None
    if st.device_map == "cpu":
        return "cpu", {"": "cpu"}, None
    if re.fullmatch(r"(cuda:)?\d+", st.device_map):
        idx = int(st.device_map.split(":")[-1])
        if idx >= len(hw.gpus):
            raise UserError(
                f"offload.device_map={st.device_map} names GPU {idx} but there are {len(hw.gpus)} GPU(s) here; "
                "declare them with --gpus or use auto"
            )
        return f"cuda:{idx}", {"": idx}, None
    max_memory = _dev.resolve_max_memory(dict(st.max_memory), hw, notes)
    dmap = infer_device_map(st, max_memory, bbs)
    gpu_ids = sorted(v for v in dmap.values() if isinstance(v, int))
    exec_dev = f"cuda:{gpu_ids[0]}" if gpu_ids else ("cuda:0" if hw.has_gpu else "cpu")
    dmap = pin_output_head(st, dmap, gpu_ids[0] if gpu_ids else (0 if hw.has_gpu else "cpu"), notes)
    if "disk" in dmap.values() and not st.offload_folder:
        n_disk = sum(1 for v in dmap.values() if v == "disk")
        raise UserError(
            f"offload: {n_disk} module(s) would be placed on disk but offload.folder is not set; "
            "use offload=disk (folder: offload), set offload.folder=<dir>, or raise offload.max_memory.cpu"
        )
    return exec_dev, dmap, max_memory


def pin_output_head(st: StackSpec, dmap: OrderedDict, exec_value: Any, notes: list[str]) -> OrderedDict:
    """The device map the loader is given (model/loading.py passes it as a dict): the inferred one, with
    the LM head moved to the execution device when inference offloaded it. TRL's fused LM head
    (add_fused_lm_head) reads `lm_head.weight` directly, outside the module's forward where
    accelerate's offload hook would onload it, so an offloaded head would reach the loss as a meta
    tensor. With tied embeddings the input embeddings share that weight and move with it (named by the
    inventory: a VLM's sit in its language model); one inside an offloaded module takes that module
    apart into its blocks. Their bytes count on the execution device like any block placed there."""
    blocks = inventory(st.fig)
    head = next((b for b in blocks if b.name == OUTPUT_HEAD), None)
    heads = [OUTPUT_HEAD] + ([head.tied_to] if head is not None and head.tied_to else [])
    out, moved = OrderedDict(dmap), []
    for name in heads:
        key = _holder(name, out)
        if key is None or out[key] not in OFFLOADED or out[key] == exec_value:
            continue
        if key != name:
            out = _split(out, key, _placed_names(st, blocks))
        if name in out:
            out[name] = exec_value
            moved.append(name)
    if moved:
        notes.append(
            f"{', '.join(moved)} kept on the execution device ({dev_name(exec_value)}), not offloaded: TRL's fused "
            "LM head reads its weight outside the offload hook"
        )
    return out


def _holder(name: str, dmap: Mapping[str, Any]) -> str | None:
    """The map's key that places `name`: itself or the module holding it; None for the whole model ("")."""
    keys = [k for k in dmap if k and (name == k or name.startswith(k + "."))]
    return max(keys, key=len, default=None)


def _placed_names(st: StackSpec, blocks: tuple[Block, ...]) -> list[str]:
    """Every module the loader places, in module order: the inventory's blocks, after a VLM's vision parts
    where its vision row stands for them (the inventory leaves them out then)."""
    names = [b.name for b in blocks]
    if not vision_language(st.fig):
        return names
    known = layout(st.fig)
    if known is not None:
        return [*known.prefixes, *names]
    from ..model.vision import vision_prefixes

    return [*vision_prefixes(meta_model(st.fig, st.dtype)), *names]


def _split(dmap: OrderedDict, key: str, names: list[str]) -> OrderedDict:
    """`key`'s entry replaced, in place, by one per block inside it, each where it was."""
    out: OrderedDict = OrderedDict()
    for k, v in dmap.items():
        if k != key:
            out[k] = v
            continue
        for n in names:
            if n.startswith(key + "."):
                out[n] = v
    return out


class _PlannedQuantizer:
    """Stands in for transformers' Bnb4BitHfQuantizer / Bnb8BitHfQuantizer inside the loader's
    device-map inference: quantized linear weights count 0.5 (4-bit) or 1 (int8) byte per element
    (`quantized_element_size`), max_memory shrinks by 10 % (`adjust_max_memory`); `names`: the
    weights that will be quantized, everything else counts at its dtype. It avoids importing
    bitsandbytes (7 s) just to size things."""

    def __init__(self, element_size: float, names: frozenset[str]):
        self.element_size = element_size
        self.names = names

    def param_element_size(self, model, param_name: str, param) -> float:
        return self.element_size if param_name in self.names else param.element_size()

    def adjust_max_memory(self, max_memory):
        return {k: v * BNB_MAX_MEMORY_FACTOR for k, v in max_memory.items()}

    def validate_environment(self, *args, **kwargs) -> None:
        return None


OFFLOADED = ("cpu", "disk")
MAX_PLACEMENT_ROUNDS = 8


def offloads(dmap: Mapping[str, Any]) -> bool:
    """Whether the loader hooks modules of this map to onload them, and so loads with
    llm_int8_enable_fp32_cpu_offload (model/loading.py asks here): any on disk, or on cpu beside a GPU
    (with no GPU the CPU is the execution device)."""
    values = {str(v) for v in dmap.values()}
    return "disk" in values or ("cpu" in values and bool(values - set(OFFLOADED)))


def unquantized_blocks(st: StackSpec, dmap: Mapping[str, Any], names: Iterable[str]) -> frozenset[str]:
    """The blocks of `names` a quantized stack loads unquantized under this map: those on cpu/disk
    when the map offloads (components.unquantized_bytes says why)."""
    if not st.quantized or not offloads(dmap):
        return frozenset()
    return frozenset(n for n in names if dev_name(place(n, dmap)) in OFFLOADED)


def rewrites_offloaded(st: StackSpec) -> bool:
    """Whether from_pretrained writes the weights of disk modules to offload.folder. transformers 5
    (integrations/accelerate.accelerate_disk_offload) indexes a safetensors checkpoint's own tensors
    (the loader passes use_safetensors=True), read in place and cast to the load dtype; it re-saves a
    tensor (core_model_loading.offload_and_maybe_resave_param, in the load dtype) only when a
    WeightConverter of the model's conversion mapping rebuilds it (MoE experts), not for the
    families figures.py knows."""
    if st.fig.traits.known:
        return False
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return any(isinstance(c, WeightConverter) for c in get_model_conversion_mapping(meta_model(st.fig, st.dtype)))


def infer_device_map(
    st: StackSpec, max_memory: dict, blocks_bytes: list[tuple[Block, BlockBytes]], shortcut: bool = True
) -> OrderedDict[str, Any]:
    """The device map the loader is given for from_pretrained(device_map=st.device_map, max_memory=...).

    transformers 5 computes an "auto" map with its port of accelerate's infer_auto_device_map
    (transformers.integrations.accelerate._get_device_map: get_balanced_memory, the quantizer's 10 %
    max_memory cut, infer_auto_device_map with quantized element sizes). For a text model of a family
    the planner inventories from its figures, device_map.py computes that very map from the block
    list (no torch, no meta model); for the others (vision-language models, a checkpoint's own code,
    families planned from the meta model) we call transformers' function on a meta-device model from
    AutoModelForCausalLM.from_config under accelerate.init_empty_weights (_ported says which).
    But transformers quantizes before it infers an "auto" map, so it sizes every linear at 4/8 bits,
    while the loader passes this map as a dict and the modules it offloads stay unquantized in the
    load dtype (4x an NF4 linear in bf16): a cpu budget filled at 4-bit sizes would hold 4x its bytes.
    So the blocks a map offloads are re-sized unquantized and the map inferred again, until no more
    blocks move off the GPU (sizes only grow, so this ends; a few rounds).

    The OOM ladder asks for the same map many times (its candidates and offload probes re-plan
    stacks that differ only in what the map does not read), so maps are kept by their inputs."""
    trivial = _whole_model_fits_one_device(st, max_memory, blocks_bytes) if shortcut else None
    if trivial is not None:
        return OrderedDict([("", trivial)])
    linears = _quantized_linear_names(st, blocks_bytes)
    # everything the inference reads: the meta model (figures, dtype), the strategy, the quantizer's
    # element size and the weights it converts, the budgets in their order
    key = (st.fig, st.dtype, st.device_map, st.quant, tuple(max_memory.items()), _linears_key(linears))
    dmap = _INFERRED.pop(key, None)
    if dmap is None:
        dmap = _inferred_map(st, max_memory, linears)
    if MAP_CACHE_SIZE > 0:
        _INFERRED[key] = dmap  # most recent last
        while len(_INFERRED) > MAP_CACHE_SIZE:
            _INFERRED.pop(next(iter(_INFERRED)))
    return OrderedDict(dmap)


MAP_CACHE_SIZE = 64  # inferred maps kept (a ladder walk asks for a few dozen); 0 infers every time
_INFERRED: dict[tuple, OrderedDict[str, Any]] = {}


def _linears_key(linears: dict[str, list[str]]) -> tuple:
    return tuple((blk, tuple(ws)) for blk, ws in linears.items())


def _inferred_map(st: StackSpec, max_memory: dict, linears: dict[str, list[str]]) -> OrderedDict[str, Any]:
    """transformers' map for the stack, re-inferred until the blocks it offloads are sized unquantized."""
    infer = _map_inference(st, max_memory)
    unquantized: frozenset[str] = frozenset()
    for _ in range(MAX_PLACEMENT_ROUNDS):
        dmap = infer(frozenset(w for blk, ws in linears.items() if blk not in unquantized for w in ws))
        moved = unquantized_blocks(st, dmap, linears)
        if moved <= unquantized:
            break
        unquantized |= moved
    return OrderedDict(dmap)


def _map_inference(st: StackSpec, max_memory: dict) -> Callable[[frozenset[str]], dict]:
    """The map for the weights the quantizer converts: device_map.py's port where it covers the stack,
    else transformers' _get_device_map on the meta model."""
    element_size = 0.5 if st.quant in ("nf4", "fp4") else 1.0
    blocks = inventory(st.fig)
    tree = device_map.module_tree(blocks) if _ported(st, max_memory) else None
    if tree is not None:
        tied, load = device_map.tied_groups(blocks), dtype_bytes(st.dtype)

        def ported(names: frozenset[str]) -> dict:
            sizes = device_map.block_sizes(blocks, load, names, element_size)
            return device_map.infer(tree, sizes, max_memory, tied, st.quantized, BNB_MAX_MEMORY_FACTOR)

        return ported
    from transformers.integrations.accelerate import _get_device_map

    model = meta_model(st.fig, st.dtype)

    def transformers_own(names: frozenset[str]) -> dict:
        quantizer = _PlannedQuantizer(element_size, names) if st.quantized else None
        return _quiet_device_map(_get_device_map, model, st.device_map, dict(max_memory), quantizer)

    return transformers_own


def _ported(st: StackSpec, max_memory: Mapping) -> bool:
    """Whether device_map.py gives transformers' map for this stack: an "auto" map of a text model of a
    family inventoried from its figures (not a vision-language model, not a checkpoint's own code),
    over GPUs, the CPU and disk. The others (VLMs, trust_remote_code, families planned from the meta
    model) get transformers' own function on the meta model."""
    fig = st.fig
    if st.device_map != "auto" or not fig.traits.known or fig.trust_remote_code:
        return False
    if vision_language(fig) or layout(fig) is not None:
        return False
    return all(isinstance(k, int) or k in ("cpu", "disk") for k in max_memory)


def _quantized_linear_names(st: StackSpec, blocks_bytes: list[tuple[Block, BlockBytes]]) -> dict[str, list[str]]:
    """Per block, the weights of its linears the quantizer converts (none without quantization)."""
    if not st.quantized:
        return {blk.name: [] for blk, _ in blocks_bytes}
    patterns = skip_patterns(st, inventory(st.fig))
    return {
        blk.name: [f"{lin.name}.weight" for lin in blk.linears if should_convert(lin.name, patterns)]
        for blk, _ in blocks_bytes
    }


def _quiet_device_map(get_device_map, *args) -> dict:
    quiet = [logging.getLogger(n) for n in ("accelerate.utils.modeling", "transformers.integrations.accelerate")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)  # "Device 0 is not available" when planning declared GPUs
    try:
        return get_device_map(*args)
    finally:
        for lg, lv in zip(quiet, levels, strict=True):
            lg.setLevel(lv)


def _whole_model_fits_one_device(st: StackSpec, max_memory: dict, blocks_bytes: list[tuple[Block, BlockBytes]]):
    """The map {"": device} without building a meta model, when that is provably what the loader
    builds: one accelerator (or none), and the whole model fits its budget with the room the
    loader keeps for the largest layer. In _get_device_map a single device keeps the user's budget
    (get_balanced_memory changes only all but the last GPU), the bnb quantizer takes 10 % off, and
    infer_auto_device_map puts a module on the main device while used + size <= budget - largest
    layer; the root's children ("model", "lm_head") then all land there. The sizes are the loader's
    (quantized weights at 0.5 / 1 byte per element, everything else as loaded, buffers included).
    tests/unit/test_memory_planner.py checks this against _get_device_map on both sides of the boundary.
    Saves importing torch + transformers (~5 s) for the common single-GPU recipe."""
    gpus = [k for k, v in max_memory.items() if isinstance(k, int) and v > 0]
    if len(gpus) > 1 or any(isinstance(k, int) and v <= 0 for k, v in max_memory.items()):
        return None
    device = gpus[0] if gpus else "cpu"
    if device not in max_memory:
        return None
    budget = max_memory[device] * (BNB_MAX_MEMORY_FACTOR if st.quantized else 1.0)
    sizes = [bb.placed_bytes for _, bb in blocks_bytes]
    if sum(sizes) + max(sizes) <= 0.999 * budget:
        return device
    return None


def place(name: str, dmap: Mapping[str, Any]) -> Any:
    """The device the map gives the block `name` (its longest matching prefix)."""
    best = None
    for key, dev in dmap.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, dev)
    if best is not None:
        return best[1]
    for key, dev in dmap.items():  # a block the map split further: where its first part went
        if key.startswith(name + "."):
            return dev
    return "cpu"


def dev_name(dev: Any) -> str:
    """A device map value as a plan device name: 0 -> cuda:0, "cpu", "disk"."""
    if isinstance(dev, int):
        return f"cuda:{dev}"
    s = str(dev)
    return f"cuda:{s}" if s.isdigit() else s


def loader_max_memory(plan: dict) -> dict | None:
    """The resolved max_memory in from_pretrained's form ({0: bytes, ..., "cpu": bytes}), or None."""
    mm = plan.get("max_memory")
    if not mm:
        return None
    return {(int(k) if k.isdigit() else k): int(v) for k, v in mm.items()}
