"""transformers' "auto" device-map inference, ported to the planner's block list: the map
from_pretrained(device_map="auto", max_memory=...) computes in transformers 5.23
(integrations/accelerate._get_device_map: get_balanced_memory, the bitsandbytes quantizer's 10 %
max_memory cut, infer_auto_device_map; accelerate 1.15's get_max_layer_size and clean_device_map),
step for step, on a module tree rebuilt from the blocks' dotted names instead of a model on the meta
device: the blocks in module order, the decoder layers the undivided (_no_split_modules) ones, the
modules between blocks holding no tensors of their own, as the analytic inventory of a known text
family has them (layers.py; placement._ported says which stacks). Sizes are compute_module_sizes' under the planner's stand-in quantizer
(placement._PlannedQuantizer): the weights it converts at 0.5 (4-bit) or 1 (int8) byte per element,
every other parameter at the load dtype, each buffer at its own size, a tied weight not at all.

What it leaves out changes no map: the log lines and warnings, the `no_placement_params` escape (no
family the planner inventories sets it, and the map is then cleaned as here), the MPS device, the
caching allocator's reserved-but-free memory that transformers adds to a GPU's budget (none before a
process has used CUDA; a plan is the same on any machine). tests/unit/test_device_maps_are_transformers_own.py
holds it to _get_device_map on the meta model.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .blocks import Block

OFF_GPU = ("cpu", "disk")


@dataclass
class Module:
    """A module of the model as the inference walks it: its own parameters, children and buffers, in
    named_parameters / named_children / named_buffers order (recurse=False), by their full names."""

    name: str
    params: list[str] = field(default_factory=list)
    children: list[Module] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    no_split: bool = False  # a decoder layer: one of the model's _no_split_modules


@dataclass(frozen=True)
class Sizes:
    """compute_module_sizes' two tables: bytes of every module and tensor by name ("" the whole model),
    and bytes of each module's own tensors (its "leaf" size)."""

    of: dict[str, float]
    leaves: dict[str, float]


Entry = tuple[str, Module | None]  # a module or, with None, a parameter or buffer


def module_tree(blocks: Iterable[Block]) -> Module | None:
    """The model's module tree down to its blocks, the modules between them named by the blocks' dotted
    names in block order; None where the blocks cannot say it exactly: a block inside another block,
    or a block other than a decoder layer with tensors in submodules (whose order we do not know)."""
    nodes: dict[str, Module] = {"": Module("")}
    placed: set[str] = set()
    for blk in blocks:
        parts = blk.name.split(".")
        parent = nodes[""]
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            if prefix in placed:
                return None
            if prefix not in nodes:
                nodes[prefix] = Module(prefix)
                parent.children.append(nodes[prefix])
            parent = nodes[prefix]
        if blk.name in nodes:
            return None
        params, buffers = _own_tensors(blk)
        if not blk.is_layer and any(t.rsplit(".", 1)[0] != blk.name for t in params + buffers):
            return None
        nodes[blk.name] = Module(blk.name, params, [], buffers, blk.is_layer)
        parent.children.append(nodes[blk.name])
        placed.add(blk.name)
    return nodes[""]


def _own_tensors(blk: Block) -> tuple[list[str], list[str]]:
    params: list[str] = []
    for lin in blk.linears:
        params += [f"{lin.name}.weight"] + ([f"{lin.name}.bias"] if lin.bias else [])
    params += [name for name, _ in (*blk.params, *blk.experts) if name not in params]
    return params, [name for name, _, _ in blk.buffers]


def tied_groups(blocks: Iterable[Block]) -> list[list[str]]:
    """_init_infer_auto_device_map's tied parameter groups: each tied weight with the one it shares."""
    groups = [sorted([f"{b.name}.weight", f"{b.tied_to}.weight"]) for b in blocks if b.tied_to]
    return groups or [[]]


def block_sizes(blocks: Iterable[Block], load_bytes: int, converted: frozenset[str], element_size: float) -> Sizes:
    """compute_module_sizes(model, quantizer): every parameter and buffer's numel times its element size
    (`converted` weights at `element_size`, the other parameters at `load_bytes`, buffers at their own
    or the load dtype's), added to the tensor and to every module above it."""
    of: dict[str, float] = defaultdict(int)
    leaves: dict[str, float] = defaultdict(int)
    for name, size in _tensor_bytes(blocks, load_bytes, converted, element_size):
        parts = name.split(".")
        for depth in range(len(parts)):
            of[".".join(parts[:depth])] += size
        if "." in name:
            leaves[name.rsplit(".", 1)[0]] += size
        of[name] += size
    return Sizes(of, leaves)


def _tensor_bytes(blocks: Iterable[Block], load: int, converted: frozenset[str], element_size: float):
    for blk in blocks:
        seen: set[str] = set()
        for lin in blk.linears:
            weight = f"{lin.name}.weight"
            yield weight, lin.numel * (element_size if weight in converted else load)
            if lin.bias:
                seen.add(f"{lin.name}.bias")
                yield f"{lin.name}.bias", lin.out_features * load
        for name, numel in (*blk.params, *blk.experts):
            if name not in seen:
                yield name, numel * load
        for name, numel, size in blk.buffers:
            yield name, numel * (size or load)


def infer(tree: Module, sizes: Sizes, max_memory: dict, tied: list[list[str]], quantized: bool, cut: float):
    """_get_device_map(model, "auto", max_memory, quantizer): the balanced budgets, the quantizer's cut
    (`cut` of every budget when `quantized`), then infer_auto_device_map, cleaned."""
    budgets = balanced_memory(tree, sizes, max_memory)
    if quantized:
        budgets = {k: v * cut for k, v in budgets.items()}
    return _Inference(tree, sizes, budgets, tied).run()


def device_order(max_memory: dict) -> dict:
    """accelerate's get_max_memory on a given budget: the GPUs by index, then the CPU and disk."""
    gpus = sorted(k for k in max_memory if isinstance(k, int))
    return {k: max_memory[k] for k in gpus + [k for k in ("cpu", "disk") if k in max_memory]}


def balanced_memory(tree: Module, sizes: Sizes, max_memory: dict) -> dict:
    """get_balanced_memory (low_zero off): every GPU but the last holds at most its share of the model
    plus 1.25 x the largest decoder layer or leaf module."""
    budgets = device_order(max_memory)
    gpus = sorted(k for k, v in budgets.items() if k not in OFF_GPU and v > 0)
    if not gpus:
        return budgets
    per_gpu = sizes.of[""] // len(gpus)
    layers = [sizes.of[m.name] for m in _walk(tree) if m.no_split]
    biggest_layer = max(layers) if layers else 0
    per_gpu += int(1.25 * max(biggest_layer, max(sizes.leaves.values(), default=0)))
    for idx in gpus[:-1]:
        budgets[idx] = min(per_gpu, budgets[idx])
    return budgets


def _walk(module: Module):
    yield module
    for child in module.children:
        yield from _walk(child)


def max_layer_size(entries: list[Entry], sizes: Sizes) -> tuple[float, list[str]]:
    """accelerate's get_max_layer_size: the largest module that is placed whole (a decoder layer, a
    module without children, a tensor) and the names of those that size."""
    largest, names = 0, []
    todo = list(entries)
    while todo:
        name, module = todo.pop(0)
        if module is not None and module.children and not module.no_split:
            todo = [(c.name, c) for c in module.children] + todo
            continue
        size = sizes.of.get(name, 0)
        if size > largest:
            largest, names = size, [name]
        elif size == largest:
            names.append(name)
    return largest, names


class _Inference:
    """infer_auto_device_map's walk: modules in order onto the GPUs, then the CPU, then disk; a
    module that does not fit is split into its parameters and children, or moves on to the next
    device; the main devices (the first GPU and the CPU) keep room for the largest layer left."""

    def __init__(self, tree: Module, sizes: Sizes, max_memory: dict, tied: list[list[str]]):
        self.max_memory = device_order(max_memory)
        self.devices = list(self.max_memory) + ([] if "disk" in self.max_memory else ["disk"])
        gpus = [d for d in self.devices if d not in OFF_GPU]
        self.main_devices = [gpus[0], "cpu"] if gpus else ["cpu"]
        self.sizes, self.tied = sizes, tied
        self.todo: list[Entry] = [(p, None) for p in tree.params] + [(c.name, c) for c in tree.children]
        self.todo += [(b, None) for b in tree.buffers]
        self.device_map: OrderedDict[str, Any] = OrderedDict()
        self.current = 0
        self.used = dict.fromkeys(self.devices, 0)
        self.largest, self.largest_names = max_layer_size(self.todo, sizes)

    def run(self) -> OrderedDict[str, Any]:
        while self.todo:
            self._treat(*self.todo.pop(0))
        return clean_device_map(self.device_map)

    def _treat(self, name: str, module: Module | None) -> None:
        self.largest_names = [n for n in self.largest_names if n != name and not n.startswith(name + ".")]
        if not self.largest_names:
            self._update_largest()
        size = self.sizes.of.get(name, 0)
        tied_params = self._tied_outside(name)
        device = self.devices[self.current]
        budget = self.max_memory[device] if device != "disk" else None
        reserved = 0
        if device in self.main_devices:
            budget, reserved = budget - self.largest, self.largest
        with_ties, tied_names, tied_modules = self._size_with_ties(tied_params, size)
        if budget is None or self.used[device] + with_ties <= budget:
            self._put(name, device, with_ties, tied_names)
            return
        fits_untied = bool(tied_params) and self.used[device] + size <= budget
        if fits_untied and self._split_tied(name, module, tied_names, tied_modules):
            return
        if module is not None and module.children and not module.no_split:
            children = [(p, None) for p in module.params] + [(c.name, c) for c in module.children]
            self.todo = children + self.todo
            self._update_largest()
            return
        self.used[device] += reserved  # nothing here splits: the next device
        self.current += 1
        self.todo.insert(0, (name, module))

    def _update_largest(self) -> None:
        self.largest, self.largest_names = max_layer_size([e for e in self.todo if e[1] is not None], self.sizes)

    def _tied_outside(self, name: str) -> list[str]:
        """The weights tied to one inside `name` that lie outside it (transformers matches by substring)."""
        inside = name + "."
        groups = [g for g in self.tied if any(inside in k + "." for k in g) and not all(inside in k + "." for k in g)]
        return [p for g in groups for p in g if inside not in p + "."]

    def _size_with_ties(self, tied_params: list[str], size: float) -> tuple[float, list[str], list[Module | None]]:
        """get_module_size_with_ties: the module's size plus each not yet placed module holding a tied weight."""
        names: list[str] = []
        modules: list[Module | None] = []
        for param in tied_params:
            holder, module = [(n, m) for n, m in self.todo if param.startswith(n + ".")][0]
            if holder not in names:
                names.append(holder)
                modules.append(module)
                size += self.sizes.of.get(holder, 0)
        return size, names, modules

    def _put(self, name: str, device: Any, size: float, tied_names: list[str]) -> None:
        self.used[device] += size
        self.device_map[name] = device
        for tied in tied_names:
            at = next((i for i, (n, _) in enumerate(self.todo) if n == tied), None)
            if at is not None:
                self.todo.pop(at)
            self.device_map[tied] = device

    def _split_tied(self, name: str, module: Module | None, names: list[str], modules: list[Module | None]) -> bool:
        """The module fits without its tied modules: split the first of those that splits, treat it again."""
        for tied_name, tied in zip(names, modules, strict=True):
            if tied is None or not tied.children or tied.no_split:
                continue
            children = [(p, None) for p in tied.params] + [(c.name, c) for c in tied.children]
            at = [i for i, (n, _) in enumerate(self.todo) if n == tied_name][0]
            self.todo = [(name, module)] + self.todo[:at] + children + self.todo[at + 1 :]
            self._update_largest()
            return True
        return False


def clean_device_map(device_map: OrderedDict[str, Any], module_name: str = "") -> OrderedDict[str, Any]:
    """accelerate's clean_device_map: a module whose parts all went to one device becomes one entry
    (at the map's end, as there), recursively; the children in the same set order as there."""
    prefix = "" if module_name == "" else f"{module_name}."
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module_name] = values[0]
    children_modules = [k for k in device_map.keys() if k.startswith(prefix) and len(k) > len(module_name)]
    idx = len(module_name.split(".")) + 1 if len(module_name) > 0 else 1
    for child in set(".".join(k.split(".")[:idx]) for k in children_modules):
        clean_device_map(device_map, module_name=child)
    return device_map
