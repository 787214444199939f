"""`quant.experts=4bit`: the fused expert weights of MoE layers stored NF4/FP4, as bitsandbytes stores a
Linear4bit's weight.

transformers 5 fuses each MoE layer's experts into 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I], one slice per expert; gpt-oss and Llama 4 keep them transposed). bitsandbytes replaces
nn.Linear only, so without this those tensors, most of an MoE model, would stay in 16 bits. Experts are
found by shape, not by family: a module whose `num_experts` matches the first dimension of its 3-D
floating parameters. Each such weight is quantized with bitsandbytes' blockwise `quantize_4bit` as it is
loaded (see `quantized_while_loading`) and kept as a frozen `Params4bit`; biases and routers stay in the
compute dtype. In forward a layer's experts are dequantized inside `_Experts4bit`, and dequantized again
in its backward for the input's gradient: no 16-bit expert weight outlives the matmul that used it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from contextlib import contextmanager

import torch

from ..config.schema import PeftConfig, QuantConfig
from ..families import V4_EXPERT_NAMES
from ..units import torch_dtype

log = logging.getLogger(__name__)

BLOCKSIZE = 64  # bitsandbytes' Linear4bit default: the planner's absmax figures assume it
_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj")  # what the experts' matmuls read; biases excluded


def applies(quant: QuantConfig) -> bool:
    return quant.method in ("nf4", "fp4") and quant.experts == "4bit"


def expert_weights(module: torch.nn.Module) -> list[str]:
    """Names of `module`'s own 16-bit expert weights: 3-D floating parameters with one slice per expert."""
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int):
        return []
    return [
        name
        for name, p in module.named_parameters(recurse=False)
        if name in _WEIGHT_NAMES and p.dim() == 3 and p.is_floating_point() and p.shape[0] == experts
    ]


def experts_module(module: torch.nn.Module) -> bool:
    """An experts module, its weights in 16 or 4 bits."""
    own = dict(module.named_parameters(recurse=False))
    return bool(expert_weights(module)) or any(is_4bit(own.get(n)) for n in _WEIGHT_NAMES)


def _forward_kind(module: torch.nn.Module) -> str | None:
    """How the experts run: "routed" for transformers' `use_experts_implementation` classes (tokens and
    their top-k expert ids in), "batched" for Llama 4's (tokens already laid out per expert), else None."""
    if all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "_apply_gate")):
        return "routed"
    own = set(dict(module.named_parameters(recurse=False)))
    takes = list(inspect.signature(type(module).forward).parameters)[1:]
    if {"gate_up_proj", "down_proj"} <= own and hasattr(module, "act_fn") and takes == ["hidden_states"]:
        return "batched"
    return None  # a forward of its own (routing arguments, other names): run as it is, in 16 bits


def quantize_weight(module: torch.nn.Module, name: str, quant: QuantConfig) -> None:
    """Replace `module.<name>` by its NF4/FP4 codes (a frozen Params4bit holding its quant state), on the
    weight's own device: only this one tensor exists in 16 bits meanwhile."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    weight = getattr(module, name)
    storage = torch_dtype(quant.storage_dtype)
    with torch.no_grad():
        codes, state = bnbf.quantize_4bit(
            weight.detach().to(torch_dtype(quant.compute_dtype)),
            blocksize=BLOCKSIZE,
            compress_statistics=quant.double_quant,
            quant_type=quant.method,
            quant_storage=storage,
        )
    packed = bnb.nn.Params4bit(
        codes,
        requires_grad=False,
        quant_state=state,
        blocksize=BLOCKSIZE,
        compress_statistics=quant.double_quant,
        quant_type=quant.method,
        quant_storage=storage,
        bnb_quantized=True,
    )
    packed._is_hf_initialized = True  # transformers must not re-initialise it as a missing weight
    module._parameters[name] = packed


def is_4bit(param) -> bool:
    return type(param).__name__ == "Params4bit"


def dequantized(weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The 16-bit weight a Params4bit stands for, in its compute dtype or `dtype` (merge asks for fp32)."""
    import bitsandbytes.functional as bnbf

    state = weight.quant_state
    if dtype is not None and dtype != state.dtype:
        state = copy.copy(state)  # shallow: only the output dtype changes
        state.dtype = dtype
    return bnbf.dequantize_4bit(weight.data, state)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert, group e times w[e] ([E, in, out]); `offsets` the groups' ends."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    fast = x.device.type == "cpu" or (x.device.type == "cuda" and x.dtype == torch.bfloat16)
    if fn is not None and fast:
        return fn(x, w, offs=offsets)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host sync for the whole layer
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


class _Experts4bit(torch.autograd.Function):
    """x times every expert's dequantized weight: grouped by `offsets` (rows sorted by expert), or one
    batch per expert (`offsets` None, x [E, n, in]). `layout` "oi": weight [E, out, in], "io": [E, in, out].
    Nothing of the 16-bit weight is saved: backward dequantizes it again for the input's gradient, and
    the frozen weight gets none."""

    @staticmethod
    def forward(ctx, x, weight, offsets, layout):
        w = dequantized(weight)
        w = w.transpose(-2, -1) if layout == "oi" else w  # [E, in, out]
        ctx.weight, ctx.offsets, ctx.layout, ctx.x_dtype = weight, offsets, layout, x.dtype
        xw = x.to(w.dtype)
        out = torch.bmm(xw, w) if offsets is None else _grouped_mm(xw, w, offsets)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        w = dequantized(ctx.weight)
        wt = w if ctx.layout == "oi" else w.transpose(-2, -1)  # [E, out, in]
        g = grad.to(w.dtype)
        dx = torch.bmm(g, wt) if ctx.offsets is None else _grouped_mm(g, wt, ctx.offsets)
        return dx.to(ctx.x_dtype), None, None, None


def _lora_rows(module, name: str, x: torch.Tensor, layout: str, ids=None) -> torch.Tensor | None:
    """x times the active LoRA updates of `module.<name>` (model/expert_lora.py sets them while its
    wrapper's forward runs), None without any. Rows sorted by expert with their expert `ids`, or one batch
    per expert (`ids` None, x [E, n, in]). A routed row goes through every expert's A at once (the experts
    together hold about rank r) and keeps only its own expert's columns before B: no loop, no host sync."""
    wrapper, adapters = module.__dict__.get("_expert_lora", {}).get(name, (None, ()))
    out = None
    for adapter in adapters:
        first, second, scaling = wrapper.io_factors(adapter, layout, x.dtype)  # [E, in, r], [E, r, out]
        if ids is None:
            rows = torch.bmm(torch.bmm(x, first), second)
        else:
            experts, _, rank = first.shape
            h = x @ first.permute(1, 0, 2).reshape(x.shape[-1], experts * rank)
            own = ids.unsqueeze(-1) == torch.arange(experts, device=ids.device).repeat_interleave(rank)
            rows = (h * own) @ second.reshape(experts * rank, -1)
        out = rows * scaling if out is None else out + rows * scaling
    return out


def _project(module, name: str, x: torch.Tensor, offsets, ids=None) -> torch.Tensor:
    layout = "io" if module.is_transposed else "oi"
    out = _Experts4bit.apply(x, getattr(module, name), offsets, layout)
    lora = _lora_rows(module, name, x, layout, ids)
    out = out if lora is None else out + lora.to(out.dtype)
    bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
    return out if bias is None else out + bias[ids].to(out.dtype)


def _batched(module, name: str, x: torch.Tensor) -> torch.Tensor:
    out = _Experts4bit.apply(x, getattr(module, name), None, "io")
    lora = _lora_rows(module, name, x, "io")
    return out if lora is None else out + lora.to(out.dtype)


def routed_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped experts forward (integrations/moe.py) over 4-bit weights: each token's
    top-k (token, expert) pairs sorted by expert, both projections grouped, weighted and summed back."""
    shape, k = hidden_states.shape, top_k_index.size(-1)
    x = hidden_states.reshape(-1, shape[-1])
    ids, perm = torch.sort(top_k_index.reshape(-1))
    offsets = torch.cumsum(torch.bincount(ids, minlength=self.num_experts), 0, dtype=torch.int32)
    h = _project(self, "gate_up_proj" if self.has_gate else "up_proj", x[perm // k], offsets, ids)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _project(self, "down_proj", h, offsets, ids)
    if getattr(self, "has_post_expert_norm", False):
        h = self.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(h.dtype)
    unsorted = torch.empty_like(perm)
    unsorted[perm] = torch.arange(perm.numel(), device=perm.device)
    return h[unsorted].view(x.shape[0], k, shape[-1]).sum(dim=1).to(hidden_states.dtype).view(shape)


def batched_forward(self, hidden_states):
    """Llama 4's experts forward over 4-bit weights: the tokens come laid out per expert."""
    size = self.gate_up_proj.quant_state.shape[1]  # hidden (its weights are [E, in, out])
    x = hidden_states.view(self.num_experts, -1, size)
    gate, up = _batched(self, "gate_up_proj", x).chunk(2, dim=-1)
    out = _batched(self, "down_proj", up * self.act_fn(gate))
    return out.view(-1, size)


_FORWARDS = {"routed": routed_forward, "batched": batched_forward}
_CLASSES: dict[tuple[type, str], type] = {}


def _run_4bit(module: torch.nn.Module, kind: str) -> None:
    """The module's class becomes a subclass whose forward reads the 4-bit weights (same attributes,
    same parameter names, so state dicts and peft see the model as before)."""
    cls = type(module)
    key = (cls, kind)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{cls.__name__}4bit", (cls,), {"forward": _FORWARDS[kind]})
    module.__class__ = _CLASSES[key]


@contextmanager
def quantized_while_loading(quant: QuantConfig, here: bool = True):
    """Within: each expert weight transformers sets while loading is quantized right after it lands on
    its device, so at most one 16-bit expert tensor exists at a time (transformers loads one tensor at a
    time when it quantizes on the fly). transformers has no hook for parameters its quantizer does not
    own, so this wraps the one function that sets every loaded tensor, and the one that sizes the
    allocator warm-up before it (experts at their stored size), and restores both on exit. `here`
    False (offloaded or sharded loading): nothing is changed."""
    if not (applies(quant) and here):
        yield
        return
    import transformers.core_model_loading as loading
    import transformers.modeling_utils as modeling

    original, sized = loading.set_param_for_module, modeling.get_total_byte_count

    def set_and_quantize(model, target_name, *args, **kwargs):
        original(model, target_name, *args, **kwargs)
        path, _, name = target_name.rpartition(".")
        module = model.get_submodule(path) if path else model
        if name in expert_weights(module) and getattr(module, name).device.type != "meta":
            quantize_weight(module, name, quant)

    def sized_as_stored(model, device_map, *args, **kwargs):
        # The caching-allocator warm-up takes this many bytes at once before loading: counted as
        # loaded, 16-bit experts would make it the run's peak (8.1 GiB for gpt-oss's 4 layers on a
        # GPU, its experts 1.6 GiB stored), or on a small card cache all of it.
        totals = sized(model, device_map, *args, **kwargs)
        for name, device in device_map.items():
            path, _, leaf = name.rpartition(".")
            module = model.get_submodule(path) if path else model
            if device in totals and leaf in expert_weights(module):
                weight = getattr(module, leaf)
                totals[device] -= weight.numel() * weight.element_size() - stored_size(weight.numel(), quant)
        return totals

    loading.set_param_for_module, modeling.get_total_byte_count = set_and_quantize, sized_as_stored
    try:
        yield
    finally:
        loading.set_param_for_module, modeling.get_total_byte_count = original, sized


def quantize_experts(model: torch.nn.Module, quant: QuantConfig, here: bool = True) -> dict:
    """Every experts module of `model` with 4-bit weights (quantizing what loading left in 16 bits) and
    the forward that reads them. Returns the counts, also logged: nothing is left in 16 bits unsaid.
    `here` False: offloaded (accelerate's hooks move 16-bit weights) or sharded (FSDP / ZeRO-3 shard
    them) loading, not built for 4-bit experts yet: they stay as loaded."""
    counts = {"layers": 0, "weights": 0, "params": 0, "bytes": 0, "kept_16bit": 0}
    if not applies(quant):
        return counts
    for module in model.modules():
        if not experts_module(module) or type(module) in _CLASSES.values():
            continue
        kind = _forward_kind(module)
        meta = any(p.device.type == "meta" for p in module.parameters())
        if kind is None or not here or meta or hasattr(module, "_hf_hook"):
            counts["kept_16bit"] += 1
            continue
        for weight in expert_weights(module):
            quantize_weight(module, weight, quant)
        _run_4bit(module, kind)
        counts["layers"] += 1
        for p in module.parameters(recurse=False):
            if is_4bit(p):
                counts["weights"] += 1
                counts["params"] += p.quant_state.shape.numel()
                counts["bytes"] += stored_bytes(p)
    if counts["kept_16bit"]:
        log.warning(
            "quant.experts=4bit: %d expert layers stay in 16 bits (offloaded, sharded, or a forward not known here)",
            counts["kept_16bit"],
        )
    if counts["layers"]:
        log.info(
            "quant.experts=4bit: %d expert layers, %d weights (%d params) stored %s in %.1f MiB",
            counts["layers"],
            counts["weights"],
            counts["params"],
            quant.method,
            counts["bytes"] / 2**20,
        )
    return counts


def stored_size(numel: int, quant: QuantConfig) -> int:
    """Bytes `numel` weights take stored 4-bit: the codes, an absmax per block (8-bit plus a float per
    256 of them with double quant, else a float each)."""
    blocks = -(-numel // BLOCKSIZE)
    absmax = blocks + 4 * -(-blocks // 256) if quant.double_quant else 4 * blocks
    return -(-numel // 2) + absmax


def stored_bytes(param) -> int:
    """A Params4bit's bytes: its codes, absmax (8-bit plus the nested state with double quant), code book."""
    state = param.quant_state
    total = param.data.numel() * param.data.element_size() + state.absmax.numel() * state.absmax.element_size()
    total += state.code.numel() * state.code.element_size()
    nested = state.state2
    if nested is not None:
        total += sum(t.numel() * t.element_size() for t in (nested.absmax, nested.code))
    return total


def lora_on_linears(peft_cfg: PeftConfig, model: torch.nn.Module) -> PeftConfig:
    """`peft_cfg` with `target_modules=all-linear` spelled out as `linear_targets` on a model with fused
    experts (logged); as given otherwise."""
    targets = linear_targets(model) if peft_cfg.target_modules == "all-linear" else None
    if targets is None:
        return peft_cfg
    log.info(
        "peft: all-linear on an MoE model: LoRA on its nn.Linear layers %s (on the experts: peft.experts)", targets
    )
    return dataclasses.replace(peft_cfg, target_modules=targets)


def linear_targets(model: torch.nn.Module) -> list[str] | None:
    """For `peft.target_modules=all-linear` on a model with fused experts: the leaf names of its nn.Linear
    layers (attention, shared or dense MLPs; never the output head), else None (all-linear as peft reads
    it). peft 0.21 maps all-linear on such models to the expert parameters too (`target_parameters`,
    its ParamWrapper, which refuses LoRA dropout and cannot wrap a 4-bit weight): the experts get theirs
    from model/expert_lora.py instead (peft.experts). Leaf names that peft would map onto the fused
    experts (v4's per-expert names) are left out, logged."""
    fused = [n for n, m in model.named_modules() if experts_module(m)]
    if not fused:
        return None
    head = model.get_output_embeddings()
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if plain_linear(m) and m is not head and not any(n.startswith(f + ".") for f in fused)
    }
    dropped = sorted(names & V4_EXPERT_NAMES)
    if dropped:
        log.info("peft: all-linear on MoE experts' layers leaves out %s (peft maps them onto the experts)", dropped)
    return sorted(names - V4_EXPERT_NAMES)


def plain_linear(module: torch.nn.Module) -> bool:
    """An nn.Linear whose forward is nn.Linear's (or bitsandbytes' quantized one's): peft's LoRA adds its
    output to the base layer's, so a model's subclass with a forward of its own (Llama 4's router returns
    (scores, logits)) cannot take one."""
    cls = type(module)
    own = cls.forward is not torch.nn.Linear.forward and not cls.__module__.startswith("bitsandbytes.")
    return isinstance(module, torch.nn.Linear) and not own
