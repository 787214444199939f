"""torch's MemTracker, counting live tensor storage in the plan's own component names.

`torch.distributed._tools.mem_tracker.MemTracker` is a TorchDispatchMode that sees every tensor an op
creates (fake tensors too), keeps a weak reference to each storage and its byte size (CUDA sizes
rounded up to the caching allocator's 512-byte blocks), and categorises it: parameter, buffer,
gradient, activation (forward and checkpoint recompute), temporary (backward) or optimizer state;
it also keeps per-module peaks. This subclass adds what the comparison with the planner needs:

- components: each storage is labelled with the plan row it belongs to - quantized_weights (4-bit
  data and QuantState tensors), other_params, buffers, lora_weights, gradients, optimizer_state
  (what the optimizer holds after its step), and the transients by the phase that made them:
  activations (forward), lm_head_loss (the fused head, forward and backward), layer_working (the
  decoder layers' backward: recompute and gradients), dequant_scratch (4-bit dequantization,
  tagged by bench.trace.kernels), optimizer_scratch (the step's temporaries);
- phases: the driver names the phase (`tracker.phase`); the peak of each phase and its components;
- frozen parameters get no gradient hooks (MemTracker registers one on every parameter, which
  torch refuses for tensors that do not require grad).

Bytes per device: a fake CUDA tensor counts on cuda:0, a CPU tensor (TRL's offloaded activations in
pinned host RAM) on cpu.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType

TRANSIENT = (
    "activations",
    "lm_head_loss",
    "layer_working",
    "dequant_scratch",
    "optimizer_scratch",
    "reference_forward",
    "kl_forward",
    "sampling",
    "vision_forward",
    "other",
)
HELD = "held_by_tracker"
PHASE_COMPONENT = {
    "load": "other",
    "forward": "activations",
    "loss": "lm_head_loss",
    "backward": "layer_working",
    "optimizer": "optimizer_scratch",
    "reference": "reference_forward",  # DPO, KTO: the reference's no_grad forward, adapter off
    "kl": "kl_forward",  # KTO: the policy's no_grad forward of its KL batch
    "prefill": "sampling",  # GRPO: the step's generation, its prompts' forward
    "decode": "sampling",  # and its decoding steps
    "vision": "vision_forward",  # a VLM: its vision tower's and projector's forward on the images
}


class PlanTracker(MemTracker):
    supports_higher_order_operators = True  # flex attention's op: its outputs are counted as any op's

    def __init__(self) -> None:
        super().__init__()
        self.phase = "load"
        self.tag: str | None = None  # a component that overrides the phase's (kernels.GpuKernels)
        self.now: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.peak: dict[str, int] = {}
        self.peak_components: dict[str, dict[str, int]] = {}
        self.peak_phase: dict[str, str] = {}
        self.phase_peaks: dict[tuple[str, str], tuple[int, dict[str, int]]] = {}
        self._by_fqn: dict[str, Any] = {}
        self.census = False  # record the live tensors at the peak (debugging the breakdown)
        self.peak_census: dict[str, list] = {}
        self._op = None

    # --- labelling -------------------------------------------------------------------------
    def _component(self, winfo: Any) -> str:
        ref = winfo.reftype
        if ref == _MemRefType.PARAM:
            return "other_params"
        if ref == _MemRefType.BUFFER:
            return "buffers"
        if ref == _MemRefType.GRAD:
            return "gradients"
        if ref == _MemRefType.OPT:
            return "optimizer_scratch"
        if ref == _MemRefType.OTH:
            return "other"
        if self.tag:
            return self.tag
        return PHASE_COMPONENT.get(self.phase, "other")

    def label(self, tensor: torch.Tensor, component: str) -> None:
        """Put the storages of `tensor` (tracked or not) under `component`."""
        for winfo in self._update_and_maybe_create_winfos(
            tensor, _MemRefType.OTH if not self._tracked(tensor) else None
        ):
            self._move(winfo, component)

    def _tracked(self, tensor: torch.Tensor) -> bool:
        from torch.distributed._tools.common_utils import get_untyped_storages

        return all(st in self._WINFO for st in get_untyped_storages(tensor))

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        if reftype is None:  # relabel only: keep the reftype MemTracker gave it
            from torch.distributed._tools.common_utils import get_untyped_storages

            return {self._WINFO[st][0] for st in get_untyped_storages(t)}
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _move(self, winfo: Any, component: str) -> None:
        old = getattr(winfo, "component", None)
        if old == component:
            return
        dev = str(winfo.device)
        if old is not None:
            self.now[dev][old] -= winfo.mem_consumed
        self.now[dev][component] += winfo.mem_consumed
        winfo.component = component
        winfo.pinned = True  # a label given by the driver survives reftype changes

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        dev = str(winfo.device)
        if u_type == _UpdateType.ADD:
            winfo.component = self._component(winfo)
            winfo.op = (str(self._op), self.phase) if self.census else None
            self.now[dev][winfo.component] += winfo.mem_consumed
        elif u_type == _UpdateType.DEL:
            self.now[dev][winfo.component] -= winfo.mem_consumed
        elif u_type == _UpdateType.REF:
            if not getattr(winfo, "pinned", False):
                old = winfo.component
                new = self._component(winfo)
                if new != old:
                    self.now[dev][old] -= winfo.mem_consumed
                    self.now[dev][new] += winfo.mem_consumed
                    winfo.component = new
        elif u_type == _UpdateType.SIZE:
            self.now[dev][winfo.component] += winfo.mem_consumed - old_mem_consumed

    # --- peaks -----------------------------------------------------------------------------
    def _update_peak_stats(self, peak_state) -> None:
        """MemTracker's, looking up the active modules by name instead of scanning every tracked
        module after every op (thousands of LoRA submodules in a real-size model)."""
        if len(self._by_fqn) != len(self.memory_tracking):
            self._by_fqn = {stats.mod_fqn: stats for stats in self.memory_tracking.values()}
        curr = self._curr_mem_snap
        for fqn in self._mod_tracker.parents:
            stats = self._by_fqn.get(fqn)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, snap in curr.items():
                if stats.local_peak.get(dev, 0) < snap[_TOTAL_KEY]:
                    stats.local_peak[dev] = snap[_TOTAL_KEY]
                    stats.snapshots[peak_state][-1][dev] = dict(snap)
        for dev, snap in curr.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
        self.note_peak()

    def reset_mod_stats(self) -> None:
        super().reset_mod_stats()
        self._by_fqn = {}

    @contextlib.contextmanager
    def second_forward(self):
        """A second forward of the same modules before the first one's backward (DPO's reference
        forward): MemTracker keeps one set of module stats per iteration and refuses a module called
        again; the second forward gets its own set, dropped after it, and the first one's comes back
        for its backward. Bytes are counted throughout."""
        saved = dict(self.memory_tracking)
        self.reset_mod_stats()
        try:
            yield
        finally:
            self.reset_mod_stats()
            self.memory_tracking.update(saved)

    @contextlib.contextmanager
    def modules_untracked(self):
        """Forwards without module stats (generation's prefill and one per decoding step, no backward):
        MemTracker keeps one set per iteration; bytes are counted throughout."""
        active = self._depth > 0
        if active:
            self._mod_tracker.__exit__(None, None, None)
        try:
            yield
        finally:
            if active:
                self._mod_tracker.__enter__()

    def release_transients(self) -> int:
        """After a micro-batch's backward nothing of its transients is left in a run; what is still
        alive here is held by MemTracker's own module hooks (register_multi_grad_hook keeps the
        embedding output - a leaf that requires grad under k-bit prep - and its gradient in a cycle
        through autograd nodes). Those bytes move to `held_by_tracker`, left out of every total."""
        moved = 0
        for winfo, _ in list(self._WINFO.values()):
            if getattr(winfo, "component", None) in TRANSIENT:
                self._move(winfo, HELD)
                moved += winfo.mem_consumed
        return moved

    def relabel_live(self, old: str, new: str) -> None:
        """Move what is still alive under `old` to `new` (a VLM's tower tensors kept for backward past
        its forward: activations, as the plan counts them)."""
        for winfo, _ in list(self._WINFO.values()):
            if getattr(winfo, "component", None) == old:
                self._move(winfo, new)

    def note_peak(self) -> None:
        for device, snap in self._curr_mem_snap.items():
            dev = str(device)
            total = snap[_TOTAL_KEY] - self.now[dev].get(HELD, 0)
            if total > self.peak.get(dev, -1):
                self.peak[dev] = total
                self.peak_components[dev] = {k: v for k, v in self.now[dev].items() if v and k != HELD}
                self.peak_phase[dev] = self.phase
                if self.census:
                    self.peak_census[dev] = self._census(dev)
            key = (dev, self.phase)
            if total > self.phase_peaks.get(key, (-1, None))[0]:
                self.phase_peaks[key] = (total, {k: v for k, v in self.now[dev].items() if v and k != HELD})
                if self.census:
                    self.peak_census[f"{dev}|{self.phase}"] = self._census(dev)

    def _census(self, dev: str) -> list:
        """The live transient storages on `dev`: (component, op that made it, phase, bytes), largest first."""
        rows = []
        for winfo, _ in list(self._WINFO.values()):
            if str(winfo.device) == dev and getattr(winfo, "component", None) not in (
                "quantized_weights",
                "other_params",
                "buffers",
                "lora_weights",
                "optimizer_state",
                "inputs",
            ):
                op = getattr(winfo, "op", None) or ("?", "?")
                rows.append((getattr(winfo, "component", "?"), op[0], op[1], winfo.mem_consumed))
        return sorted(rows, key=lambda r: -r[3])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = func
        return super().__torch_dispatch__(func, types, args, kwargs)

    def current(self) -> dict[str, dict[str, int]]:
        return {dev: {k: v for k, v in comps.items() if v and k != HELD} for dev, comps in self.now.items()}

    def reset_peaks(self) -> None:
        self.peak, self.peak_components, self.peak_phase, self.phase_peaks = {}, {}, {}, {}

    # --- MemTracker's parameter hooks, without hooks on frozen parameters -----------------------
    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):
        def _grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        param_memory = 0
        for param in module.parameters():
            winfos = self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
            param_memory += sum(w.mem_consumed for w in winfos)
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
            if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(_grad_hook),
                    param.register_post_accumulate_grad_hook(lambda p: _grad_hook(p.grad)),
                )
        buffer_memory = 0
        for buffer in module.buffers():
            winfos = self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
            buffer_memory += sum(w.mem_consumed for w in winfos)
        return param_memory, buffer_memory
