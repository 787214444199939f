"""The model a stack trains, built on fake tensors: the loader's path as far as it goes without weights.

What `loading.load_model` gets from `from_pretrained` is rebuilt here from the same parts: the
config from the model's figures (or its local config.json), the model class built on the meta device
in the precision dtype with the stack's attention, transformers' own bitsandbytes quantizer
(`preprocess_model`: `replace_with_bnb_linear` with the skip list and `modules_to_not_convert` the
loader computes), then every tensor materialised as a FakeTensor on the device, each 4-bit linear's
weight quantized by `bitsandbytes.functional.quantize_4bit` (its fake kernel: the packed data and the
QuantState, double quantization included, are the real shapes and dtypes), `postprocess_model`,
`use_cache=False` and `loading._keep_4bit_layout_trainable`. From there the run's own code takes
over: `loading.make_trainable` (k-bit prep or its lean variant, gradient checkpointing, peft) and
TRL's `add_fused_lm_head`.

One difference from the loader: `bitsandbytes.nn.Params4bit` cannot wrap a FakeTensor (a tensor
subclass cannot be re-wrapped as another), so the packed weight is a plain frozen Parameter carrying
the attributes a Params4bit has (`quant_state`, `quant_type`, `blocksize`, `compress_statistics`,
`quant_storage`, `bnb_quantized`, `module`); Linear4bit.forward, peft's 4-bit LoRA layer and
prepare_model_for_kbit_training (which casts only fp16/bf16 tensors, never the uint8 data) read
exactly those.

MoE models (`quant.experts=4bit`): the fused 3-D expert weights are stored 4-bit by the loader's own
`model/moe_experts` code before the model is prepared, as `load_model` does (`experts_4bit`: its
`quantize_weight` and the 4-bit forward on the skeleton, so k-bit prep and peft see 4-bit experts), and
quantized again on the fake device by `materialize` (`quantize_weight` once more). There a Params4bit
cannot wrap the fake codes either, so a fake tensor whose class is named Params4bit stands in: the
run's code tells 4-bit experts by that name (`moe_experts.is_4bit`). Their forward and backward are
the loader's `_Experts4bit` (each layer's experts dequantized in the matmul, again in backward).

`layers` builds a model with fewer decoder layers than the figures (a layer-sliced trace); the
layers are identical, so bytes per layer scale exactly (`bench.trace.run` extrapolates and a test
checks it against a full trace).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def hf_config(cfg: Any, layers: int | None = None):
    """The transformers config of the stack's model: its local config.json, else the figures."""
    from qlora_recipes.planner import model_figures
    from qlora_recipes.planner.figures import hf_config as figures_config

    fig = model_figures(cfg.model)
    config = figures_config(fig)
    if not fig.config_dir and fig.architecture == "mistral":
        # transformers' MistralConfig defaults to a 4096-token sliding window (Mistral-7B-v0.1);
        # v0.2+ (conf/model/mistral-7b: v0.3) has none, and the window would make transformers
        # build an explicit mask (memory-efficient SDPA) where the real model runs flash
        config.sliding_window = None
    if layers is not None:
        from bench.trace.vision import set_layers

        set_layers(config, int(layers))
    config.use_cache = False
    return config


_PARAMS4BIT_ATTRS = ("blocksize", "compress_statistics", "quant_type", "quant_storage")


def _quantize_linear(module, device, bnb, attrs: dict) -> None:
    """The 4-bit weight a Linear4bit holds after loading: quantize_4bit of a bf16/fp16 weight of its
    shape (fake kernel), kept as a frozen Parameter with the Params4bit attributes (`attrs`, read
    from the skeleton's Params4bit)."""
    import torch

    src = SimpleNamespace(**attrs)
    dense = torch.empty(
        module.out_features, module.in_features, dtype=module.compute_dtype or torch.bfloat16, device=device
    )
    with torch.no_grad():
        dense.normal_(0.0, 0.02)  # real tensors need finite values; nothing on fake ones
    packed, state = bnb.functional.quantize_4bit(
        dense,
        blocksize=src.blocksize,
        compress_statistics=src.compress_statistics,
        quant_type=src.quant_type,
        quant_storage=src.quant_storage,
    )
    del dense
    weight = torch.nn.Parameter(packed, requires_grad=False)
    for name in _PARAMS4BIT_ATTRS:
        setattr(weight, name, getattr(src, name))
    weight.quant_state = state
    weight.bnb_quantized = True
    weight.module = module
    module._parameters["weight"] = weight
    module.quant_state = state


def quant_state_tensors(state) -> list:
    """Every tensor a bitsandbytes QuantState holds (absmax, code, offset, nested state)."""
    import torch

    out = []
    for name in ("absmax", "code", "offset"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    if getattr(state, "state2", None) is not None:
        out += quant_state_tensors(state.state2)
    return out


def meta_base(cfg: Any, layers: int | None = None, device_map: dict | None = None):
    """The model skeleton from_pretrained builds before loading: on the meta device, in the precision
    dtype, 4-bit linears swapped in by transformers' quantizer. Call outside the FakeTensorMode (a
    Params4bit cannot wrap a fake tensor). `device_map`: an offloading map (bench/trace/offload.py),
    whose cpu/disk modules the quantizer leaves unquantized as the loader's does. Returns (model,
    hf_quantizer or None)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from bench.trace.vision import is_vlm, skip_list
    from qlora_recipes.config.attention import VARLEN
    from qlora_recipes.model.hf_configs import bnb_config
    from qlora_recipes.units import torch_dtype

    dtype = torch_dtype(cfg.precision.dtype)
    config = hf_config(cfg, layers)
    qconf = bnb_config(cfg.quant, cfg.offload, cfg.model)
    if qconf is not None and qconf.load_in_8bit:
        raise NotImplementedError("quant=int8 is not traced (LLM.int8 keeps outlier columns chosen from the data)")
    attn = cfg.model.attn_implementation or "sdpa"
    if attn == VARLEN:  # a padding-free stack's pick, as the loader registers it
        from qlora_recipes.model import packed_attention

        packed_attention.register()
        # fake tensors hold no sequence bounds to read: one causal call per row allocates what the
        # row's per-sequence calls allocate together
        packed_attention.sequence_bounds = lambda n, batch, *args: [[0, n]] * batch
    auto = AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, dtype=dtype, attn_implementation=attn)
    quantizer = None
    if qconf is not None:
        if is_vlm(config):  # the vision tower and projector stay in the compute dtype, as the loader's
            qconf.llm_int8_skip_modules = skip_list(cfg, model)
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(qconf, pre_quantized=False)
        quantizer.preprocess_model(
            model=model, dtype=dtype, device_map=device_map or {"": 0}, checkpoint_files=None, use_kernels=False
        )
    return model, quantizer


def materialize(model, linears: dict, device: str, quant=None):
    """The prepared model on (fake) tensors of `device`: every tensor allocated, 4-bit weights
    quantized, tied weights tied again (call inside the FakeTensorMode). `linears`: the Params4bit
    attributes of each Linear4bit, from `four_bit_linears` before the model was prepared; `quant`:
    the stack's quant group, for 4-bit fused experts (`experts_4bit`)."""
    experts = _four_bit_experts(model) if quant is not None else []
    shapes = [
        (module._parameters[n].quant_state.shape, module._parameters[n].quant_state.dtype) for module, n in experts
    ]
    model.to_empty(device=device)
    if linears:
        import bitsandbytes as bnb

        for module, attrs in linears.items():
            _quantize_linear(module, device, bnb, attrs)
    if experts:
        _requantize_experts(experts, shapes, quant, device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "tie_word_embeddings", False):
        base.tie_weights()
    return model


def experts_4bit(cfg: Any, model, here: bool = True) -> int:
    """What `moe_experts.quantize_experts` does while loading, on the skeleton (meta tensors, which it
    leaves alone): each experts module's fused weights quantized by its `quantize_weight`, its class
    given the 4-bit forward. `here` as the loader passes it (False where layers are offloaded). Returns
    the experts modules quantized."""
    from qlora_recipes.model import moe_experts

    if not (moe_experts.applies(cfg.quant) and here):
        return 0
    done = 0
    for module in list(model.modules()):
        names = moe_experts.expert_weights(module)
        kind = moe_experts._forward_kind(module) if names else None
        if kind is None:
            continue  # the loader keeps these in 16 bits too
        for name in names:
            moe_experts.quantize_weight(module, name, cfg.quant)
        moe_experts._run_4bit(module, kind)
        done += 1
    return done


def _four_bit_experts(model) -> list:
    """(module, weight name) of every 4-bit fused expert weight (`experts_4bit`)."""
    from qlora_recipes.model import moe_experts

    return [
        (module, name)
        for module in model.modules()
        for name, p in module._parameters.items()
        if p is not None and p.dim() == 2 and moe_experts.is_4bit(p) and hasattr(module, "num_experts")
    ]


def _requantize_experts(experts: list, shapes: list, quant, device) -> None:
    """The expert weights on the fake device: a dense weight of each one's shape and compute dtype,
    stored by `moe_experts.quantize_weight` as loading does, its Params4bit a fake stand-in."""
    import bitsandbytes as bnb
    import torch

    from qlora_recipes.model import moe_experts

    real = bnb.nn.Params4bit
    bnb.nn.Params4bit = _fake_params4bit
    try:
        for (module, name), (shape, dtype) in zip(experts, shapes, strict=True):
            module._parameters[name] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), False)
            moe_experts.quantize_weight(module, name, quant)
    finally:
        bnb.nn.Params4bit = real


class _FakeParams4bit:
    """Named Params4bit: see the module's docstring (made a FakeTensor subclass on first use)."""


def _fake_params4bit(data, requires_grad=False, quant_state=None, **attrs):
    """`bnb.nn.Params4bit(...)` on fake codes: a frozen fake parameter of the same storage size whose
    class is named Params4bit, carrying the quant state and the other attributes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    cls = _FAKE_CLASS.setdefault("cls", type("Params4bit", (FakeTensor,), {}))
    with unset_fake_temporarily():
        elem = torch.empty(data.shape, dtype=data.dtype, device="meta")
    weight = cls(data.fake_mode, elem, data.device, requires_grad=False)
    weight._is_param = True
    for name, value in attrs.items():
        setattr(weight, name, value)
    weight.quant_state = quant_state
    return weight


_FAKE_CLASS: dict = {}


def four_bit_linears(model) -> dict:
    """{Linear4bit: its Params4bit attributes} of the skeleton (before `materialize`)."""
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover - bitsandbytes is a requirement
        return {}
    return {
        m: {k: getattr(m.weight, k) for k in _PARAMS4BIT_ATTRS}
        for m in model.modules()
        if isinstance(m, bnb.nn.Linear4bit)
    }


def make_trainable(cfg: Any, model, quantizer):
    """The run's own preparation, on the skeleton (meta tensors): what `load_model` does after the
    weights (the quantizer's postprocess_model, use_cache off, the CPU 4-bit layout kept trainable),
    then `loading.make_trainable` (k-bit prep or the lean path, gradient checkpointing, peft
    adapters in fp32) and TRL's fused LM head as SFTTrainer adds it. Done on the meta device because
    a module made of fake tensors cannot be moved (`Module._apply` swaps fake parameters, and the fake
    mode holds weak references to them); k-bit prep's casts and peft's adapters are the same
    tensors either way, allocated when `materialize` runs."""
    from trl.trainer.utils import add_fused_lm_head

    from qlora_recipes.model import loading

    if quantizer is not None:
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)
    model.config.use_cache = False
    loading._keep_4bit_layout_trainable(model)
    model = loading.make_trainable(cfg, model)
    add_fused_lm_head(model.get_base_model(), outputs=SFT_FUSED_OUTPUTS)
    model.train()
    return model


# SFTTrainer.__init__ (TRL 1.16): add_fused_lm_head(..., outputs=("log_probs", "entropy", "is_top1"));
# tests/unit/test_memory_tracer.py checks the source still says so.
SFT_FUSED_OUTPUTS = ("log_probs", "entropy", "is_top1")
