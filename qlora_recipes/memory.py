"""Memory planner: does a QLoRA stack fit the devices it will run on, and what to change if not.

`plan_stack(cfg)` turns a composed config into a plan (the content of `plan.json`): bytes per
component and device, each device's budget, peak and headroom, the layer-to-device map the loader
will build, and a ladder of overrides, cheapest first, that make a stack fit. It needs no GPU, no
network and no model weights: architecture figures come from the model option file or a local
`config.json`. The single-device path is pure arithmetic and never imports torch; only a plan with
`offload.device_map` set builds a meta-device model (torch + transformers + accelerate, ~5 s to
import) to ask the loader's own device-map inference where each layer goes.

What each component counts (bytes; DESIGN.md section 3 has the facts and sources):

- quantized_weights: bitsandbytes Linear4bit / Linear8bitLt weights of the decoder linears. NF4/FP4:
  the packed data ((n+1)//2 bytes) plus its QuantState: fp32 absmax per 64-block, or with double
  quantization a uint8 absmax per block + fp32 absmax per 256 of those + the fp32 offset + the
  256-entry fp32 code of the second level; + the 16-entry fp32 code. int8: n bytes + fp32 SCB per
  output row. Exactly what `Params4bit`/`Int8Params` hold (tests/test_memory.py checks it).
- other_params: embeddings, norms, biases, lm_head and any linear left unquantized, at the dtype they
  have after `prepare_model_for_kbit_training` (it casts fp16/bf16 params that are not Params4bit to
  fp32; peft/utils/other.py). Without quantization they keep the precision dtype.
- buffers: rotary inv_freq tables and the like (counted by `get_memory_footprint`).
- lora_weights: r*(in+out) per targeted linear (+ out for DoRA's magnitude), fp32 (peft upcasts
  adapters: autocast_adapter_dtype=True); r*(V+h) per targeted embedding; modules_to_save copies.
- gradients: fp32, one per trainable element.
- optimizer_state: per `optim.name`. torch AdamW: exp_avg + exp_avg_sq fp32 + a 4-byte step. bnb
  8-bit AdamW (adamw_bnb_8bit, paged_adamw_8bit): uint8 state1/state2 + fp32 absmax per 256 for
  tensors of >= 4096 elements (`min_8bit_size`), fp32 states below that, + 2 shared 256-entry qmaps.
  bnb 32-bit: 8 bytes/element. transformers Adafactor (beta1=None): factored second moment, rows +
  columns for matrices, full for vectors, + a 4-byte RMS per tensor. Paged optimizers allocate
  tensors of >= 1e5 elements in CUDA managed memory that can spill to host RAM; counted on the GPU.
- activations (kept for backward), by micro-batch b, sequence s, tokens T = b*s, compute bytes c:
    with gradient checkpointing (HF, reentrant or not): every decoder layer keeps its input, T*h
    elements (DESIGN.md section 3) - fp32 in a quantized model, because
    prepare_model_for_kbit_training leaves the embeddings in fp32 and bitsandbytes linears return
    their input's dtype, so the residual stream is fp32 (4*T*h bytes, not 2*T*h);
    without: each layer keeps what autograd saves, `layer_saved_bytes` - Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", Eq. 1: s*b*h*(34 + 5*a*s/h)
    for a 16-bit GPT) taken term by term for a Llama-family QLoRA layer; the 5*a*s/h attention-score
    term only with eager attention (SDPA/flash keep no s*s tensor). Checked against the tensors
    autograd saves on CPU (tests/test_memory.py).
- layer_working: one layer at a time in backward: its recomputed saved tensors (checkpointing) plus
  gradient buffers T*(2h + 2f) in the residual dtype.
- logits_loss: T*V*(c + 8): the logits, their fp32 upcast in the loss and the fp32 log-softmax kept
  for backward (transformers ForCausalLMLoss; no fused/chunked loss in this stack), + the c-byte
  copy of the fp32 lm_head weight that autocast makes.
- dequant_scratch: the largest quantized weight dequantized to c bytes per element (forward and
  backward of a 4-bit/8-bit linear); DoRA adds its weight-norm temporaries.
- optimizer_scratch: foreach torch AdamW's sqrt(exp_avg_sq) temporary, 4 bytes/trainable element.
- eval_transient: an evaluation batch (no grad): its logits/loss or one layer's forward.
- offload_staging: room the loader keeps on the execution device for one offloaded layer.
- cuda_context / process_baseline, allocator_overhead: documented constants below.

The transient rows do not coexist: a device's peak is its fixed and static rows plus the largest
phase - train (activations + max(logits_loss, layer_working + dequant_scratch)), optimizer step
(optimizer_scratch) or eval (eval_transient) - plus allocator overhead.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import devices as _dev
from .errors import UserError

GiB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Documented constants
# ---------------------------------------------------------------------------------------------
# CUDA context of a process that imports torch, bitsandbytes and runs cuBLAS/flash kernels: the
# driver context with lazy module loading (CUDA >= 11.7) is 0.3-0.6 GiB on A100/H100, cuBLAS and
# cuBLASLt workspaces up to 32 MiB per handle on Hopper, plus the kernel images of bitsandbytes and
# the attention kernels that get loaded. Not visible to torch.cuda.memory_allocated(); nvidia-smi
# shows it. 1 GiB is the round, slightly conservative figure.
CUDA_CONTEXT_BYTES = 1 * GiB
# RSS of the training process before any model: python + torch + transformers + peft + trl +
# bitsandbytes imported measured 0.51 GiB here (2-core CPU box, torch 2.13); + tokenizer and data.
CPU_PROCESS_BASELINE_BYTES = int(0.6 * GiB)
# Caching allocator (torch CUDA allocator; glibc malloc on CPU): long-lived tensors waste little
# (512-byte rounding, 2 MiB / 20 MiB segments); the per-step tensors of varying size fragment
# segments. Rules of thumb: 1 % of static bytes, 15 % of the dynamic (per-step) bytes.
ALLOCATOR_STATIC_FRACTION = 0.01
ALLOCATOR_DYNAMIC_FRACTION = 0.15
# The ladder aims for at least this much headroom on every device; a plan with less gets one.
HEADROOM_TARGET = 0.05
# bitsandbytes constants (bitsandbytes/functional.py, optim/optimizer.py, 0.50).
BNB_4BIT_BLOCKSIZE = 64
BNB_DQ_BLOCKSIZE = 256
BNB_4BIT_CODE_ELEMENTS = 16
BNB_DYNAMIC_CODE_ELEMENTS = 256
BNB_MIN_8BIT_SIZE = 4096
BNB_OPTIM_BLOCKSIZE = 256
BNB_PAGED_MIN_ELEMENTS = 100_000
# transformers' bnb quantizers shrink max_memory by 10 % before placing layers (adjust_max_memory).
BNB_MAX_MEMORY_FACTOR = 0.90

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
KNOWN_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma2")
QUANT_METHODS = ("nf4", "fp4", "int8", "none")
PEFT_METHODS = ("lora", "dora", "rslora")
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

# transformers `optim` strings -> how the optimizer keeps state.
OPTIMIZERS = {
    "adamw_torch": "adam32_torch",
    "adamw_torch_fused": "adam32_torch_fused",
    "adamw_bnb_8bit": "adam8_bnb",
    "adamw_8bit": "adam8_bnb",
    "paged_adamw_8bit": "adam8_bnb_paged",
    "paged_adamw_32bit": "adam32_bnb_paged",
    "paged_adamw": "adam32_bnb_paged",
    "adafactor": "adafactor",
    "sgd": "sgd",
}

# Slowdown classes of the ladder's rungs.
COSTS = {
    "eval_batch": ("none", "evaluation runs in smaller batches"),
    "micro_batch": ("small", "same effective batch; lower GPU utilisation, ~5-20 % slower"),
    "checkpointing": ("moderate", "recomputes each layer's forward in backward, ~20-35 % slower"),
    "optimizer": ("none", "8-bit paged AdamW: same speed, no quality loss (QLoRA paper)"),
    "seq_len": ("quality", "examples longer than the new length are truncated"),
    "rank": ("quality", "fewer adapter parameters"),
    "cpu_offload": ("large", "offloaded layers cross PCIe every step: several times slower"),
    "disk_offload": ("severe", "offloaded layers are read from disk every step: 10x or more slower"),
}


# ---------------------------------------------------------------------------------------------
# Architecture figures
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figures:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    source: str = "conf/model"
    config_dir: str | None = None  # a local dir with config.json (used for the meta model)
    trust_remote_code: bool = False


_FIGURE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")


def _get(node: Any, key: str, default: Any = None) -> Any:
    """Read `key` from a DictConfig/dict/dataclass; MISSING ('???') reads as None."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(node, DictConfig):
            if key not in node or OmegaConf.is_missing(node, key):
                return default
            value = node[key]
            return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except ImportError:  # pragma: no cover
        pass
    if isinstance(node, Mapping):
        value = node.get(key, default)
        return default if value == "???" else value
    return getattr(node, key, default)


def _arch_biases(arch: str, cfg_json: Mapping[str, Any] | None = None) -> tuple[bool, bool, bool]:
    cj = cfg_json or {}
    if arch == "qwen2":
        return True, False, False
    if arch in ("llama", "gemma2"):
        ab = bool(cj.get("attention_bias", False))
        return ab, ab, bool(cj.get("mlp_bias", False))
    return False, False, False


def model_figures(model_cfg: Any) -> Figures:
    """Figures of cfg.model: from `<name_or_path>/config.json` if that is a local dir, else the yaml."""
    name = _get(model_cfg, "name_or_path")
    trust = bool(_get(model_cfg, "trust_remote_code", False))
    if name and Path(str(name)).expanduser().is_dir() and (Path(str(name)).expanduser() / "config.json").is_file():
        return _figures_from_config_json(Path(str(name)).expanduser(), trust)
    missing = [k for k in _FIGURE_FIELDS if _get(model_cfg, k) is None]
    if missing:
        raise UserError(
            f"model {name or '<unnamed>'!s}: no architecture figures ({', '.join('model.' + k for k in missing)} "
            "unset) and no local config.json; pick a conf/model option, add one with the figures, "
            "or point model.name_or_path at a local model dir"
        )
    arch = str(_get(model_cfg, "architecture", "llama")).lower()
    heads = int(_get(model_cfg, "num_heads"))
    hidden = int(_get(model_cfg, "hidden_size"))
    head_dim = _get(model_cfg, "head_dim")
    qkv_bias, o_bias, mlp_bias = _arch_biases(arch)
    fig = Figures(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(_get(model_cfg, "num_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(model_cfg, "num_kv_heads")),
        head_dim=int(head_dim) if head_dim else (hidden // heads if heads else 0),
        intermediate_size=int(_get(model_cfg, "intermediate_size")),
        vocab_size=int(_get(model_cfg, "vocab_size")),
        tie_embeddings=bool(_get(model_cfg, "tie_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        max_position_embeddings=int(_get(model_cfg, "max_position_embeddings", 4096) or 4096),
        source="conf/model",
        trust_remote_code=trust,
    )
    _check_figures(fig, f"model {name}")
    return fig


def _figures_from_config_json(path: Path, trust: bool) -> Figures:
    try:
        cj = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path / 'config.json'}: cannot read it ({e}); fix or remove the file") from None
    if "text_config" in cj and "hidden_size" not in cj:
        cj = {**cj["text_config"], "model_type": cj["text_config"].get("model_type", cj.get("model_type"))}
    arch = str(cj.get("model_type", "")).lower()
    hidden = cj.get("hidden_size", cj.get("n_embd"))
    layers = cj.get("num_hidden_layers", cj.get("n_layer"))
    heads = cj.get("num_attention_heads", cj.get("n_head"))
    inter = cj.get("intermediate_size", cj.get("n_inner"))
    vocab = cj.get("vocab_size")
    missing = [
        k
        for k, v in [
            ("hidden_size", hidden),
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("intermediate_size", inter),
            ("vocab_size", vocab),
        ]
        if v is None
    ]
    if missing or not arch:
        raise UserError(
            f"{path / 'config.json'}: lacks {', '.join(missing) or 'model_type'}; the planner needs them "
            "(or a conf/model option with the figures)"
        )
    kv = cj.get("num_key_value_heads") or heads
    head_dim = cj.get("head_dim") or hidden // heads
    # Per-class defaults of tie_word_embeddings when config.json leaves it out.
    tie_default = arch not in ("llama", "mistral", "qwen2")
    qkv_bias, o_bias, mlp_bias = _arch_biases(arch, cj)
    fig = Figures(
        architecture=arch,
        hidden_size=int(hidden),
        num_layers=int(layers),
        num_heads=int(heads),
        num_kv_heads=int(kv),
        head_dim=int(head_dim),
        intermediate_size=int(inter),
        vocab_size=int(vocab),
        tie_embeddings=bool(cj.get("tie_word_embeddings", tie_default)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        max_position_embeddings=int(cj.get("max_position_embeddings", 4096) or 4096),
        source=str(path / "config.json"),
        config_dir=str(path),
        trust_remote_code=trust,
    )
    _check_figures(fig, str(path / "config.json"))
    return fig


def _check_figures(fig: Figures, where: str) -> None:
    for k in _FIGURE_FIELDS + ("head_dim",):
        v = getattr(fig, k)
        if not isinstance(v, int) or v <= 0:
            raise UserError(f"{where}: {k}={v!r} must be a positive integer")
    if fig.num_heads % fig.num_kv_heads:
        raise UserError(f"{where}: num_heads={fig.num_heads} is not a multiple of num_kv_heads={fig.num_kv_heads}")


# ---------------------------------------------------------------------------------------------
# Parameter inventory: the modules a device map places, with their linears and other tensors
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Linear:
    name: str  # full module name, e.g. model.layers.3.self_attn.q_proj
    in_features: int
    out_features: int
    bias: bool

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class Block:
    """A module the loader places as a whole: a decoder layer, the embeddings, a norm, lm_head."""

    name: str
    linears: tuple[Linear, ...] = ()
    params: tuple[tuple[str, int], ...] = ()  # non-linear params: (full name, numel)
    buffers: tuple[tuple[str, int, int], ...] = ()  # (full name, numel, bytes/elem; 0 = load dtype)
    embeddings: tuple[tuple[str, int, int], ...] = ()  # (module name, num_embeddings, dim)
    is_layer: bool = False
    tied_to: str | None = None  # lm_head of a tied model: its weight is the embedding's


def inventory(fig: Figures) -> tuple[Block, ...]:
    """The blocks of the model: analytic for the known families, from a meta model otherwise."""
    if fig.architecture in KNOWN_ARCHITECTURES:
        return _analytic_inventory(fig)
    return _meta_inventory(fig)


@functools.lru_cache(maxsize=32)
def _analytic_inventory(fig: Figures) -> tuple[Block, ...]:
    h, f, d = fig.hidden_size, fig.intermediate_size, fig.head_dim
    qd, kvd = fig.num_heads * d, fig.num_kv_heads * d
    norms = ["input_layernorm", "post_attention_layernorm"]
    if fig.architecture == "gemma2":
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    blocks: list[Block] = []
    embed_buffers: tuple = ()
    if fig.architecture == "gemma2":
        embed_buffers = (("model.embed_tokens.embed_scale", 1, 0),)  # 0-dim, in the load dtype
    blocks.append(
        Block(
            "model.embed_tokens",
            params=(("model.embed_tokens.weight", fig.vocab_size * h),),
            buffers=embed_buffers,
            embeddings=(("model.embed_tokens", fig.vocab_size, h),),
        )
    )
    for i in range(fig.num_layers):
        p = f"model.layers.{i}"
        linears = (
            Linear(f"{p}.self_attn.q_proj", h, qd, fig.qkv_bias),
            Linear(f"{p}.self_attn.k_proj", h, kvd, fig.qkv_bias),
            Linear(f"{p}.self_attn.v_proj", h, kvd, fig.qkv_bias),
            Linear(f"{p}.self_attn.o_proj", qd, h, fig.o_bias),
            Linear(f"{p}.mlp.gate_proj", h, f, fig.mlp_bias),
            Linear(f"{p}.mlp.up_proj", h, f, fig.mlp_bias),
            Linear(f"{p}.mlp.down_proj", f, h, fig.mlp_bias),
        )
        blocks.append(Block(p, linears=linears, params=tuple((f"{p}.{n}.weight", h) for n in norms), is_layer=True))
    blocks.append(Block("model.norm", params=(("model.norm.weight", h),)))
    half = d // 2
    blocks.append(
        Block(
            "model.rotary_emb",
            buffers=(("model.rotary_emb.inv_freq", half, 4), ("model.rotary_emb.original_inv_freq", half, 4)),
        )
    )
    if fig.tie_embeddings:
        blocks.append(Block("lm_head", tied_to="model.embed_tokens"))
    else:
        blocks.append(Block("lm_head", linears=(Linear("lm_head", h, fig.vocab_size, False),)))
    return tuple(blocks)


# ---------------------------------------------------------------------------------------------
# Meta-device model (torch/transformers/accelerate; only for device maps and unknown families)
# ---------------------------------------------------------------------------------------------
def _hf_config(fig: Figures):
    from transformers import AutoConfig

    try:
        if fig.config_dir:
            return AutoConfig.from_pretrained(fig.config_dir, trust_remote_code=fig.trust_remote_code)
        kwargs = dict(
            hidden_size=fig.hidden_size,
            num_hidden_layers=fig.num_layers,
            num_attention_heads=fig.num_heads,
            num_key_value_heads=fig.num_kv_heads,
            intermediate_size=fig.intermediate_size,
            vocab_size=fig.vocab_size,
            tie_word_embeddings=fig.tie_embeddings,
            max_position_embeddings=fig.max_position_embeddings,
            head_dim=fig.head_dim,
        )
        return AutoConfig.for_model(fig.architecture, **kwargs)
    except (ValueError, KeyError, OSError) as e:
        raise UserError(
            f"model.architecture={fig.architecture!r}: transformers cannot build it ({str(e).splitlines()[0]}); "
            f"use one of {', '.join(KNOWN_ARCHITECTURES)} or a local dir with config.json"
        ) from None


@functools.lru_cache(maxsize=4)
def meta_model(fig: Figures, dtype: str):
    """The model on the meta device, as from_pretrained builds it before loading (no weights)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        from transformers.modeling_utils import no_init_weights
    config = _hf_config(fig)
    with init_empty_weights(), no_init_weights():
        return AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, _torch_dtype_name(dtype)), trust_remote_code=fig.trust_remote_code
        )


def _torch_dtype_name(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)


@functools.lru_cache(maxsize=8)
def _meta_inventory(fig: Figures) -> tuple[Block, ...]:
    import torch

    model = meta_model(fig, "bfloat16")
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    tied = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    blocks: list[Block] = []

    def visit(name: str, module) -> None:
        children = list(module.named_children())
        if module.__class__.__name__ in no_split or not children or list(module.named_parameters(recurse=False)):
            blocks.append(_block_from_module(name, module, tied, module.__class__.__name__ in no_split, torch))
            return
        for child, sub in children:
            visit(f"{name}.{child}" if name else child, sub)

    visit("", model)
    return tuple(blocks)


def _block_from_module(name: str, module, tied: dict, is_layer: bool, torch) -> Block:
    prefix = f"{name}." if name else ""
    linears, params, buffers, embeddings = [], [], [], []
    linear_params = set()
    for sub_name, sub in module.named_modules():
        full = prefix + sub_name if sub_name else name
        if isinstance(sub, torch.nn.Linear):
            linears.append(Linear(full, sub.in_features, sub.out_features, sub.bias is not None))
            linear_params.add(f"{full}.weight")
            if sub.bias is not None:
                params.append((f"{full}.bias", sub.bias.numel()))
                linear_params.add(f"{full}.bias")
        elif isinstance(sub, torch.nn.Embedding):
            embeddings.append((full, sub.num_embeddings, sub.embedding_dim))
    for pname, p in module.named_parameters():
        full = prefix + pname
        if full in linear_params:
            continue
        params.append((full, p.numel()))
    for bname, b in module.named_buffers():
        size = 0 if b.is_floating_point() and b.dtype != torch.float32 else b.element_size()
        buffers.append((prefix + bname, b.numel(), size))
    tied_to = None
    if f"{name}.weight" in tied:
        tied_to = tied[f"{name}.weight"].rsplit(".", 1)[0]
        linears = []
        params = [p for p in params if p[0] != f"{name}.weight"]
    return Block(name, tuple(linears), tuple(params), tuple(buffers), tuple(embeddings), is_layer, tied_to)


# ---------------------------------------------------------------------------------------------
# The stack: what of the config changes memory
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stack:
    fig: Figures
    name_or_path: str
    quant: str = "nf4"
    double_quant: bool = True
    quant_storage_bytes: int = 1
    skip_modules: tuple[str, ...] = ()
    peft: str = "lora"
    r: int = 16
    alpha: float = 32
    lora_dropout: float = 0.05
    target_modules: Any = "all-linear"  # "all-linear", a regex string, or a tuple of names
    modules_to_save: tuple[str, ...] = ()
    optim: str = "paged_adamw_8bit"
    dtype: str = "bfloat16"
    micro_batch: int = 4
    grad_accum: int = 4
    eval_batch: int = 16
    evaluates: bool = True
    seq_len: int = 2048
    checkpointing: bool = True
    checkpointing_mode: str = "non_reentrant"
    attn: str = "sdpa"
    device_map: str | None = None
    max_memory: tuple[tuple[str, str], ...] = ()
    offload_folder: str | None = None
    offload_option: str = "none"  # the conf/offload option this looks like (for ladder overrides)
    world_size: int = 1

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.quant != "none"


def stack_from_cfg(cfg: Any, world_size: int | None = None) -> Stack:
    """Read the memory-relevant choices from a composed config; UserError on values it cannot plan."""
    model, quant, peft, optim = _get(cfg, "model"), _get(cfg, "quant"), _get(cfg, "peft"), _get(cfg, "optim")
    offload, precision, trainer, data = (
        _get(cfg, "offload"),
        _get(cfg, "precision"),
        _get(cfg, "trainer"),
        _get(cfg, "data"),
    )
    if model is None:
        raise UserError("config has no model group; compose conf/train.yaml (config_name train)")
    fig = model_figures(model)
    method = str(_get(quant, "method", "nf4")).lower()
    if method not in QUANT_METHODS:
        raise UserError(f"quant.method={method!r} is not one of {', '.join(QUANT_METHODS)}")
    pmethod = str(_get(peft, "method", "lora")).lower()
    if pmethod not in PEFT_METHODS:
        raise UserError(f"peft.method={pmethod!r} is not one of {', '.join(PEFT_METHODS)}")
    oname = str(_get(optim, "name", "paged_adamw_8bit"))
    if oname not in OPTIMIZERS:
        raise UserError(f"optim.name={oname!r}: the planner knows {', '.join(OPTIMIZERS)}; pick one of those")
    dtype = str(_get(precision, "dtype", "bfloat16"))
    if dtype not in DTYPE_BYTES:
        raise UserError(f"precision.dtype={dtype!r} is not one of bfloat16, float16, float32")
    storage = str(_get(quant, "storage_dtype", "uint8"))
    storage_bytes = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}.get(storage)
    if storage_bytes is None:
        raise UserError(f"quant.storage_dtype={storage!r} is not one of uint8, bfloat16, float16, float32")
    ints = {}
    for key, node, name, lo in [
        ("micro_batch", trainer, "micro_batch_size", 1),
        ("grad_accum", trainer, "grad_accum", 1),
        ("eval_batch", trainer, "eval_batch_size", 1),
        ("seq_len", trainer, "seq_len", 1),
        ("r", peft, "r", 1),
    ]:
        group = "peft" if node is peft else "trainer"
        value = _get(node, name)
        if value is None or int(value) < lo:
            raise UserError(f"{group}.{name}={value!r} must be an integer >= {lo}")
        ints[key] = int(value)
    mode = str(_get(trainer, "checkpointing_mode", "non_reentrant"))
    if mode not in ("non_reentrant", "reentrant"):
        raise UserError(f"trainer.checkpointing_mode={mode!r} is not one of non_reentrant, reentrant")
    device_map = _get(offload, "device_map")
    if device_map is not None:
        device_map = str(device_map)
        if not (device_map in DEVICE_MAP_STRATEGIES or device_map == "cpu" or re.fullmatch(r"(cuda:)?\d+", device_map)):
            raise UserError(
                f"offload.device_map={device_map!r} is not one of null, {', '.join(DEVICE_MAP_STRATEGIES)}, cpu, cuda:N"
            )
    max_memory = _get(offload, "max_memory") or {}
    folder = _get(offload, "folder")
    option = "none" if device_map is None else ("disk" if folder else "cpu")
    targets = _get(peft, "target_modules", "all-linear")
    if isinstance(targets, (list, tuple)):
        targets = tuple(str(t) for t in targets)
    elif targets is None:
        raise UserError("peft.target_modules is null; use all-linear or a list like [q_proj, v_proj]")
    evaluates = bool(_get(data, "eval_path")) or float(_get(data, "eval_fraction", 0.0) or 0.0) > 0
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return Stack(
        fig=fig,
        name_or_path=str(_get(model, "name_or_path", "")),
        quant=method,
        double_quant=bool(_get(quant, "double_quant", True)),
        quant_storage_bytes=storage_bytes,
        skip_modules=tuple(_get(quant, "skip_modules", []) or []),
        peft=pmethod,
        r=ints["r"],
        alpha=float(_get(peft, "alpha", 2 * ints["r"])),
        lora_dropout=float(_get(peft, "dropout", 0.0) or 0.0),
        target_modules=targets,
        modules_to_save=tuple(_get(peft, "modules_to_save", None) or ()),
        optim=oname,
        dtype=dtype,
        micro_batch=ints["micro_batch"],
        grad_accum=ints["grad_accum"],
        eval_batch=ints["eval_batch"],
        evaluates=evaluates,
        seq_len=ints["seq_len"],
        checkpointing=bool(_get(trainer, "gradient_checkpointing", True)),
        checkpointing_mode=mode,
        attn=str(_get(model, "attn_implementation", "sdpa") or "sdpa"),
        device_map=device_map,
        max_memory=tuple((str(k), str(v)) for k, v in dict(max_memory).items()),
        offload_folder=str(folder) if folder else None,
        offload_option=option,
        world_size=max(1, int(world_size)),
    )


# ---------------------------------------------------------------------------------------------
# Static bytes per block
# ---------------------------------------------------------------------------------------------
def _should_convert(full_name: str, patterns: Iterable[str] | None) -> bool:
    """transformers.quantizers.quantizers_utils.should_convert_module (5.x), same three rules."""
    if patterns is None:
        return True
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", full_name) or full_name.endswith(key) for key in patterns)


def _skip_patterns(st: Stack, blocks: tuple[Block, ...]) -> list[str]:
    """What transformers keeps unquantized: the given skip list, else the output embeddings (and tied)."""
    if st.skip_modules:
        return list(st.skip_modules)
    skip = ["lm_head"]
    for b in blocks:
        if b.tied_to:
            skip += [b.name, b.tied_to]
    return skip


def quantized_linear_bytes(
    numel: int, out_features: int, method: str, double_quant: bool, storage_bytes: int = 1
) -> tuple[int, int]:
    """(bytes of the weight tensor, bytes of its quantization state) for one bitsandbytes linear."""
    if method in ("nf4", "fp4"):
        mod = storage_bytes * 2
        data = ((numel + 1) // mod) * storage_bytes
        blocks = -(-numel // BNB_4BIT_BLOCKSIZE)
        code = BNB_4BIT_CODE_ELEMENTS * 4
        if double_quant:
            # uint8 absmax, fp32 absmax of the absmax per 256, fp32 offset, fp32 code of the 2nd level
            state = blocks + 4 * -(-blocks // BNB_DQ_BLOCKSIZE) + 4 + 4 * BNB_DYNAMIC_CODE_ELEMENTS + code
        else:
            state = 4 * blocks + code
        return data, state
    if method == "int8":
        return numel, 4 * out_features  # int8 weight + fp32 SCB per output row
    raise ValueError(method)


def _lora_targets(st: Stack, blocks: tuple[Block, ...]) -> tuple[set[str], set[str]]:
    """(targeted linear names, targeted embedding names), following peft's matching rules."""
    linear_names = [lin.name for b in blocks for lin in b.linears]
    embed_names = [e[0] for b in blocks for e in b.embeddings]
    tm = st.target_modules
    if isinstance(tm, str) and tm == "all-linear":
        # peft: every linear except the output layer (lm_head)
        return {n for n in linear_names if n != "lm_head"}, set()

    def match(name: str) -> bool:
        if isinstance(tm, str):
            return re.fullmatch(tm, name) is not None
        return any(name == t or name.endswith("." + t) for t in tm)

    lin, emb = {n for n in linear_names if match(n)}, {n for n in embed_names if match(n)}
    if not lin and not emb:
        raise UserError(
            f"peft.target_modules={tm!r} matches no module of {st.fig.architecture} "
            "(names like q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); fix the list or use all-linear"
        )
    return lin, emb


@dataclass
class BlockBytes:
    quant_data: int = 0
    quant_state: int = 0
    other: int = 0  # after prepare_model_for_kbit_training
    other_at_load: int = 0
    buffers: int = 0
    params_total: int = 0
    params_quantized: int = 0
    lora_numel: int = 0
    lora_tensors: list = field(default_factory=list)  # shapes of trainable tensors
    max_dequant: int = 0  # elements of the largest quantized weight
    max_dora: int = 0  # bytes of DoRA's weight-norm temporaries for the largest adapted linear
    lora_in: int = 0  # sum of in_features of adapted linears (dropout copies)
    dora_out: int = 0  # sum of out_features of DoRA-adapted linears
    dora_in: int = 0  # sum of in_features of DoRA-adapted linears
    dora_weight: int = 0  # sum of out*in of DoRA-adapted linears
    placed_bytes: int = 0  # what the loader counts when placing (quantized at 0.5/1 byte/elem)

    @property
    def weights(self) -> int:
        return self.quant_data + self.quant_state + self.other + self.buffers


def block_bytes(st: Stack) -> list[tuple[Block, BlockBytes]]:
    blocks = inventory(st.fig)
    load = DTYPE_BYTES[st.dtype]
    # prepare_model_for_kbit_training upcasts fp16/bf16 non-quantized params to fp32 (quantized models only)
    after = 4 if st.quantized else load
    patterns = _skip_patterns(st, blocks)
    lora_lin, lora_emb = _lora_targets(st, blocks)
    mts = st.modules_to_save
    out = []
    for blk in blocks:
        bb = BlockBytes()
        for lin in blk.linears:
            n = lin.numel
            bb.params_total += n + (lin.out_features if lin.bias else 0)
            if st.quantized and _should_convert(lin.name, patterns):
                data, state = quantized_linear_bytes(
                    n, lin.out_features, st.quant, st.double_quant, st.quant_storage_bytes
                )
                bb.quant_data += data
                bb.quant_state += state
                bb.params_quantized += n
                bb.max_dequant = max(bb.max_dequant, n)
                bb.placed_bytes += int(n * (0.5 if st.quant in ("nf4", "fp4") else 1))
            else:
                bb.other += n * after
                bb.other_at_load += n * load
                bb.placed_bytes += n * load
            if lin.bias:
                bb.other += lin.out_features * after
                bb.other_at_load += lin.out_features * load
                bb.placed_bytes += lin.out_features * load
            if lin.name in lora_lin:
                r = st.r
                bb.lora_tensors += [(r, lin.in_features), (lin.out_features, r)]
                bb.lora_in += lin.in_features
                if st.peft == "dora":
                    bb.lora_tensors.append((lin.out_features,))
                    bb.dora_out += lin.out_features
                    bb.dora_in += lin.in_features
                    bb.dora_weight += lin.numel
                    # eye(in) fp32, lora weight in x out fp32, dequantized weight (c), W + s*BA and s*BA fp32
                    bb.max_dora = max(bb.max_dora, 4 * lin.in_features**2 + lin.numel * (load + 12))
        bias_names = {f"{lin.name}.bias" for lin in blk.linears}
        for pname, numel in blk.params:
            if pname in bias_names:
                continue
            bb.params_total += numel
            bb.other += numel * after
            bb.other_at_load += numel * load
            bb.placed_bytes += numel * load
        for _, numel, size in blk.buffers:
            bb.buffers += numel * (size or load)
            bb.placed_bytes += numel * (size or load)
        for ename, num, dim in blk.embeddings:
            if ename in lora_emb:
                bb.lora_tensors += [(st.r, num), (dim, st.r)]
                if st.peft == "dora":
                    bb.lora_tensors.append((dim,))
        if mts and any(blk.name == m or blk.name.endswith("." + m) for m in mts):
            for _, numel in blk.params:
                bb.lora_tensors.append((numel,))
            for lin in blk.linears:
                bb.lora_tensors.append((lin.out_features, lin.in_features))
                if lin.bias:
                    bb.lora_tensors.append((lin.out_features,))
        bb.lora_numel = sum(math.prod(s) for s in bb.lora_tensors)
        out.append((blk, bb))
    return out


def optimizer_bytes(optim: str, shapes: Iterable[tuple[int, ...]]) -> tuple[int, int]:
    """(state bytes, of which paged) the optimizer holds for these trainable tensors after a step."""
    kind = OPTIMIZERS[optim]
    total = paged = 0
    for shape in shapes:
        n = math.prod(shape)
        pageable = 0
        if kind in ("adam32_torch", "adam32_torch_fused"):
            b = 8 * n + 4  # exp_avg, exp_avg_sq (fp32) and the fp32 `step` tensor
        elif kind in ("adam8_bnb", "adam8_bnb_paged"):
            if n >= BNB_MIN_8BIT_SIZE:  # uint8 state1/state2 + fp32 absmax1/absmax2 per 256-block
                pageable = 2 * n
                b = pageable + 2 * 4 * -(-n // BNB_OPTIM_BLOCKSIZE)
            else:  # bitsandbytes keeps small tensors' state in fp32
                b = pageable = 8 * n
        elif kind == "adam32_bnb_paged":
            b = pageable = 8 * n
        elif kind == "adafactor":  # exp_avg_sq_row + exp_avg_sq_col (or exp_avg_sq for vectors) + RMS
            if len(shape) >= 2:
                b = 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) + 4
            else:
                b = 4 * n + 4
        else:  # sgd without momentum
            b = 0
        total += b
        if kind.endswith("_paged") and n >= BNB_PAGED_MIN_ELEMENTS:
            paged += pageable
    return total, paged


def _optimizer_shared_bytes(optim: str) -> int:
    # bnb 8-bit optimizers share one signed and one unsigned 256-entry fp32 qmap per device
    return 2 * 4 * BNB_DYNAMIC_CODE_ELEMENTS if OPTIMIZERS[optim] in ("adam8_bnb", "adam8_bnb_paged") else 0


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------
def _eager(st: Stack) -> bool:
    # Gemma 2's attention-logit soft-capping has no SDPA path: transformers runs it eagerly.
    return st.attn == "eager" or st.fig.architecture == "gemma2"


def _dtypes(st: Stack, on_cpu: bool) -> tuple[int, int, int]:
    """(c, r, mask): compute dtype bytes; bytes of the residual stream and of the quantized
    linears' outputs; bytes per element of a LoRA dropout mask.

    prepare_model_for_kbit_training leaves embeddings and norm weights in fp32, so in a quantized
    model the hidden states are fp32 end to end (bitsandbytes linears return their input's dtype);
    without quantization they stay in the precision dtype. On CUDA dropout keeps a bool mask; on
    CPU peft upcasts the LoRA input to fp32 (CUDA autocast is off) and dropout keeps an fp32 noise.
    """
    c = st.act_bytes
    r = 4 if st.quantized else c
    return c, r, (4 if on_cpu else 1)


def layer_saved_bytes(st: Stack, bb: BlockBytes, b: int, on_cpu: bool = False) -> int:
    """Bytes one decoder layer keeps for backward (no checkpointing), micro-batch b, T = b*s tokens.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    Eq. 1: a 16-bit GPT layer keeps s*b*h*(34 + 5*a*s/h) bytes. The same accounting, term by term,
    for a Llama-family QLoRA layer as autograd runs it (c compute, r residual bytes, see _dtypes):
      RMSNorms: fp32 input + rsqrt                          (4h + 4) per norm (2; Gemma 2: 4)
      attention, SDPA: Q, K, V as cast for the kernel (K/V repeated to all heads when a padding
        mask stops SDPA's native GQA), the output, the fp32 log-sum-exp
                                                            c*(2*a*d + 2*kv*d) + 4a
        eager instead: Q and the repeated K, V; and Korthikanti's 5*a*s/h term without dropout:
        the fp32 softmax and its c-byte cast (+ the tanh output of Gemma 2's soft-capping)
                                                            3c*a*d + b*a*s^2*(4 + c [+ c]) / T
      gated MLP: gate and up outputs, act(gate)             3*r*f
        (bitsandbytes linears save no input: bnb 0.50 MatMul4Bit keeps only the packed weight)
      LoRA, per adapted linear: the c-byte input of lora_A (autocast cast) + dropout mask
                                                            (c + mask) * in  (mask 0 without dropout)
      LoRA weights cast to c for autocast, kept by each matmul      c * adapter elements (c < 4)
      DoRA: base and LoRA results kept for the magnitude    2c*out
        and with dropout, F.linear(dropout(x), dequantized W) keeps its input and W
                                                            c*in + c*out*in / T
    Frozen 4-bit linears keep no inputs (Korthikanti's 2sbh terms), but the fp32 residual stream and
    MLP outputs and the LoRA input copies make a QLoRA layer keep about twice 34*s*b*h (Llama-2-7B,
    s=2048: 74*s*b*h). tests/test_memory.py checks the tally against what autograd keeps on CPU.
    """
    fig, s = st.fig, st.seq_len
    c, r, mask = _dtypes(st, on_cpu)
    h, f, a, d = fig.hidden_size, fig.intermediate_size, fig.num_heads, fig.head_dim
    qd, kvd = a * d, fig.num_kv_heads * d
    norms = 4 if fig.architecture == "gemma2" else 2
    per_token = norms * (4 * h + 4) + 3 * r * f
    if _eager(st):
        per_token += 3 * c * qd
    else:
        kv_saved = 2 * qd if fig.num_kv_heads < a and b > 1 else 2 * kvd
        per_token += c * (2 * qd + kv_saved) + 4 * a
    per_token += (c + (mask if st.lora_dropout > 0 else 0)) * bb.lora_in
    per_token += 2 * c * bb.dora_out
    total = b * s * per_token
    if c < 4:
        total += c * sum(math.prod(t) for t in bb.lora_tensors)
    if bb.dora_out and st.lora_dropout > 0:
        # DoRA with dropout recomputes the base output as F.linear(dropout(x), dequantized W):
        # that matmul keeps the c-byte input and the whole dequantized weight of each linear
        total += b * s * c * bb.dora_in + c * bb.dora_weight
    if _eager(st):
        total += b * a * s * s * (4 + c + (c if fig.architecture == "gemma2" else 0))
    return total


def _backward_working(st: Stack, b: int, on_cpu: bool = False) -> int:
    """Gradient buffers alive while one layer runs backward: hidden-state and MLP gradients."""
    fig, s = st.fig, st.seq_len
    _, r, _ = _dtypes(st, on_cpu)
    w = b * s * r * (2 * fig.hidden_size + 2 * fig.intermediate_size)
    if _eager(st):
        w += b * fig.num_heads * s * s * 4  # fp32 gradient of the softmax
    return w


def _shared_per_device(st: Stack, b: int, on_cpu: bool = False) -> int:
    """RoPE cos/sin (shared by the batch, in the residual dtype) and the attention mask every layer
    reads (none for SDPA without padding at b=1)."""
    fig, s = st.fig, st.seq_len
    c, r, _ = _dtypes(st, on_cpu)
    rope = 2 * s * fig.head_dim * r
    if _eager(st):
        mask = b * s * s * c
    else:
        mask = b * s * s if b > 1 else 0
    return rope + mask


def _logits_bytes(st: Stack, b: int, on_cpu: bool = False) -> int:
    """Around the loss: c-byte logits (kept in the model output), their fp32 upcast and fp32
    log-softmax (transformers ForCausalLMLoss, no fused loss), the final norm's fp32 input, the
    lm_head input cast and, for an fp32 lm_head under autocast, its c-byte weight copy."""
    fig = st.fig
    c, r, _ = _dtypes(st, on_cpu)
    per = c + 8 + (2 * c if fig.architecture == "gemma2" else 0)  # Gemma 2 final-logit soft-capping
    total = b * st.seq_len * (fig.vocab_size * per + (4 + 4) * fig.hidden_size + (c if r != c else 0) * fig.hidden_size)
    if st.quantized and c < 4:
        total += c * fig.vocab_size * fig.hidden_size  # prepare_model_for_kbit_training made lm_head fp32
    return total


def _eval_layer_bytes(st: Stack, b: int, on_cpu: bool = False) -> int:
    """One layer's forward without grad: residual, normed input, Q/K/V/out, gate/up/act."""
    fig, s = st.fig, st.seq_len
    c, r, _ = _dtypes(st, on_cpu)
    h, f, a, d = fig.hidden_size, fig.intermediate_size, fig.num_heads, fig.head_dim
    w = b * s * (2 * r * h + 4 * h + c * (4 * a * d) + 3 * r * f)
    if _eager(st):
        w += b * a * s * s * (4 + c)
    return w


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------
class _PlannedQuantizer:
    """Stands in for transformers' Bnb4BitHfQuantizer / Bnb8BitHfQuantizer inside the loader's
    device-map inference: quantized linear weights count 0.5 (4-bit) or 1 (int8) byte per element
    (`quantized_element_size`), max_memory shrinks by 10 % (`adjust_max_memory`). It avoids
    importing bitsandbytes (7 s) just to size things."""

    def __init__(self, element_size: float, names: frozenset[str]):
        self.element_size = element_size
        self.names = names

    def param_element_size(self, model, param_name: str, param) -> float:
        return self.element_size if param_name in self.names else param.element_size()

    def adjust_max_memory(self, max_memory):
        return {k: v * BNB_MAX_MEMORY_FACTOR for k, v in max_memory.items()}

    def validate_environment(self, *args, **kwargs) -> None:
        return None


def infer_device_map(
    st: Stack, max_memory: dict, blocks_bytes: list[tuple[Block, BlockBytes]], shortcut: bool = True
) -> OrderedDict[str, Any]:
    """The device map from_pretrained(device_map=st.device_map, max_memory=...) builds for this model.

    transformers 5 computes it with its port of accelerate's infer_auto_device_map
    (transformers.integrations.accelerate._get_device_map: get_balanced_memory, the quantizer's 10 %
    max_memory cut, infer_auto_device_map with quantized element sizes); we call that very function
    on a meta-device model from AutoModelForCausalLM.from_config under accelerate.init_empty_weights.
    """
    trivial = _whole_model_fits_one_device(st, max_memory, blocks_bytes) if shortcut else None
    if trivial is not None:
        return OrderedDict([("", trivial)])
    from transformers.integrations.accelerate import _get_device_map

    model = meta_model(st.fig, st.dtype)
    hf_quantizer = None
    if st.quantized:
        patterns = _skip_patterns(st, inventory(st.fig))
        names = frozenset(
            f"{lin.name}.weight"
            for blk, _ in blocks_bytes
            for lin in blk.linears
            if _should_convert(lin.name, patterns)
        )
        hf_quantizer = _PlannedQuantizer(0.5 if st.quant in ("nf4", "fp4") else 1.0, names)
    quiet = [logging.getLogger(n) for n in ("accelerate.utils.modeling", "transformers.integrations.accelerate")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)  # "Device 0 is not available" when planning declared GPUs
    try:
        dmap = _get_device_map(model, st.device_map, dict(max_memory), hf_quantizer)
    finally:
        for lg, lv in zip(quiet, levels, strict=True):
            lg.setLevel(lv)
    return OrderedDict(dmap)


def _whole_model_fits_one_device(st: Stack, max_memory: dict, blocks_bytes: list[tuple[Block, BlockBytes]]):
    """The map {"": device} without building a meta model, when that is provably what the loader
    builds: one accelerator (or none), and the whole model fits its budget with the room the
    loader keeps for the largest layer. In _get_device_map a single device keeps the user's budget
    (get_balanced_memory changes only all but the last GPU), the bnb quantizer takes 10 % off, and
    infer_auto_device_map puts a module on the main device while used + size <= budget - largest
    layer; the root's children ("model", "lm_head") then all land there. The sizes are the loader's
    (quantized weights at 0.5 / 1 byte per element, everything else as loaded, buffers included).
    tests/test_memory.py checks this against _get_device_map on both sides of the boundary.
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


def _place(name: str, dmap: Mapping[str, Any]) -> Any:
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


def _dev_name(dev: Any) -> str:
    if isinstance(dev, int):
        return f"cuda:{dev}"
    s = str(dev)
    return f"cuda:{s}" if s.isdigit() else s


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
COMPONENTS = (
    "quantized_weights",
    "other_params",
    "buffers",
    "lora_weights",
    "gradients",
    "optimizer_state",
    "activations",
    "layer_working",
    "logits_loss",
    "dequant_scratch",
    "optimizer_scratch",
    "eval_transient",
    "offload_staging",
    "cuda_context",
    "process_baseline",
    "allocator_overhead",
)
STATIC = ("quantized_weights", "other_params", "buffers", "lora_weights", "gradients", "optimizer_state")
FIXED = ("cuda_context", "process_baseline", "offload_staging")


def plan_stack(
    cfg: Any,
    gpus: list[int] | None = None,
    host_ram: int | None = None,
    world_size: int | None = None,
    ladder: bool = True,
) -> dict:
    """Plan a composed config for the devices it will run on (`gpus`: total bytes of each GPU to
    plan for; default: this machine's GPUs, or its CPU when it has none). Returns the plan.json dict."""
    st = stack_from_cfg(cfg, world_size)
    hw = _dev.hardware(gpus, host_ram)
    plan = _plan(st, hw)
    if ladder:
        plan["ladder"] = _ladder(st, hw, plan) if _needs_ladder(plan) else []
    return plan


def _plan(st: Stack, hw: _dev.Hardware) -> dict:
    notes: list[str] = []
    bbs = block_bytes(st)
    exec_dev: str
    max_memory_resolved: dict | None = None
    if st.device_map is None:
        if hw.has_gpu:
            rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            if rank >= len(hw.gpus):
                rank = 0
            exec_dev = f"cuda:{rank}"
            dmap: dict = {"": rank}
        else:
            exec_dev, dmap = "cpu", {"": "cpu"}
    elif st.device_map == "cpu":
        exec_dev, dmap = "cpu", {"": "cpu"}
    elif re.fullmatch(r"(cuda:)?\d+", st.device_map):
        idx = int(st.device_map.split(":")[-1])
        if idx >= len(hw.gpus):
            raise UserError(
                f"offload.device_map={st.device_map} names GPU {idx} but there are {len(hw.gpus)} GPU(s) here; "
                "declare them with --gpus or use auto"
            )
        exec_dev, dmap = f"cuda:{idx}", {"": idx}
    else:
        max_memory_resolved = _dev.resolve_max_memory(dict(st.max_memory), hw, notes)
        dmap = infer_device_map(st, max_memory_resolved, bbs)
        gpu_ids = sorted(v for v in dmap.values() if isinstance(v, int))
        exec_dev = f"cuda:{gpu_ids[0]}" if gpu_ids else ("cuda:0" if hw.has_gpu else "cpu")
        if "disk" in dmap.values() and not st.offload_folder:
            n_disk = sum(1 for v in dmap.values() if v == "disk")
            raise UserError(
                f"offload: {n_disk} module(s) would be placed on disk but offload.folder is not set; "
                "use offload=disk (folder: offload), set offload.folder=<dir>, or raise offload.max_memory.cpu"
            )

    comp: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    placed: dict[str, str] = {}
    layers_on: dict[str, list[BlockBytes]] = defaultdict(list)
    dequant_on: dict[str, int] = defaultdict(int)
    dora_on: dict[str, int] = defaultdict(int)
    offloaded_max = 0
    disk_max = 0
    trainable_shapes: dict[str, list] = defaultdict(list)
    lm_dev = exec_dev
    counts = dict(params_total=0, params_quantized=0, lora_params=0, footprint_at_load=0, quant_state_bytes=0)
    for blk, bb in bbs:
        where = _dev_name(_place(blk.name, dmap))
        placed[blk.name] = where
        compute = where if where.startswith("cuda") or not hw.has_gpu else exec_dev
        if where == "disk" and not hw.has_gpu:
            compute = "cpu"
        holder = "cpu" if where == "disk" else where  # trainable tensors cannot live on disk
        comp["quantized_weights"][where] += bb.quant_data + bb.quant_state
        comp["other_params"][where] += bb.other_at_load if where == "disk" else bb.other  # stored as loaded
        comp["buffers"][where] += bb.buffers
        if where == "disk":
            disk_max = max(disk_max, bb.placed_bytes)
        if where in ("cpu", "disk") and compute != where:
            offloaded_max = max(offloaded_max, bb.placed_bytes)
        if bb.lora_numel:
            comp["lora_weights"][holder] += 4 * bb.lora_numel
            comp["gradients"][holder] += 4 * bb.lora_numel
            trainable_shapes[holder] += bb.lora_tensors
        if blk.is_layer:
            layers_on[compute].append(bb)
        dequant_on[compute] = max(dequant_on[compute], bb.max_dequant * st.act_bytes if st.quantized else 0)
        dora_on[compute] = max(dora_on[compute], bb.max_dora)
        if blk.name == "lm_head":
            lm_dev = compute
        counts["params_total"] += bb.params_total
        counts["params_quantized"] += bb.params_quantized
        counts["lora_params"] += bb.lora_numel
        counts["footprint_at_load"] += bb.quant_data + bb.other_at_load + bb.buffers
        counts["quant_state_bytes"] += bb.quant_state
    disk_bytes = sum(comp[k].get("disk", 0) for k in ("quantized_weights", "other_params", "buffers"))
    # optimizer state lives with its parameters
    paged_total = 0
    for holder, shapes in trainable_shapes.items():
        state, paged = optimizer_bytes(st.optim, shapes)
        comp["optimizer_state"][holder] += state + _optimizer_shared_bytes(st.optim)
        paged_total += paged if holder.startswith("cuda") else 0
        if OPTIMIZERS[st.optim] == "adam32_torch":
            comp["optimizer_scratch"][holder] += 4 * sum(math.prod(s) for s in shapes)
        elif OPTIMIZERS[st.optim] == "adafactor":
            comp["optimizer_scratch"][holder] += 8 * max((math.prod(s) for s in shapes), default=0)
    # activations, by the device each layer computes on
    b, s = st.micro_batch, st.seq_len
    for dev, layer_bbs in layers_on.items():
        if not layer_bbs:
            continue
        cpu = dev == "cpu"
        worst = max(layer_bbs, key=lambda x: layer_saved_bytes(st, x, b, cpu))
        if st.checkpointing:
            _, r, _ = _dtypes(st, cpu)
            stored = len(layer_bbs) * b * s * st.fig.hidden_size * r  # each layer's input
            working = layer_saved_bytes(st, worst, b, cpu) + _backward_working(st, b, cpu)
        else:
            stored = sum(layer_saved_bytes(st, x, b, cpu) for x in layer_bbs)
            working = _backward_working(st, b, cpu)
        comp["activations"][dev] += stored + _shared_per_device(st, b, cpu)
        comp["layer_working"][dev] += working
        comp["dequant_scratch"][dev] += dequant_on[dev] + dora_on[dev]
        if st.evaluates:
            comp["eval_transient"][dev] = max(
                comp["eval_transient"][dev], _eval_layer_bytes(st, st.eval_batch, cpu) + dequant_on[dev]
            )
    comp["logits_loss"][lm_dev] += _logits_bytes(st, b, lm_dev == "cpu")
    if st.evaluates:
        comp["eval_transient"][lm_dev] = max(
            comp["eval_transient"][lm_dev], _logits_bytes(st, st.eval_batch, lm_dev == "cpu")
        )
    if offloaded_max and hw.has_gpu:
        comp["offload_staging"][exec_dev] += offloaded_max
    if disk_max:
        comp["offload_staging"]["cpu"] += disk_max

    # devices of the plan
    dev_names: list[str] = []
    if st.device_map is None or st.device_map == "cpu" or re.fullmatch(r"(cuda:)?\d+", st.device_map or ""):
        dev_names = [exec_dev]
    else:
        dev_names = [f"cuda:{i}" for i in range(len(hw.gpus))] + ["cpu"]
        if st.offload_folder or disk_bytes:
            dev_names.append("disk")
    for d in dev_names:
        if d.startswith("cuda"):
            comp["cuda_context"][d] += CUDA_CONTEXT_BYTES
        elif d == "cpu":
            comp["process_baseline"][d] += CPU_PROCESS_BASELINE_BYTES

    devices = []
    for d in dev_names:
        if d == "disk":
            budget = _dev.disk_free(st.offload_folder)
            peak = disk_bytes
            phase = "offloaded weights"
        else:
            static = sum(comp[k].get(d, 0) for k in STATIC)
            fixed = sum(comp[k].get(d, 0) for k in FIXED)
            act = comp["activations"].get(d, 0)
            phases = {
                "train: loss": act + comp["logits_loss"].get(d, 0),
                "train: layer backward": act + comp["layer_working"].get(d, 0) + comp["dequant_scratch"].get(d, 0),
                "optimizer step": comp["optimizer_scratch"].get(d, 0),
                "eval": comp["eval_transient"].get(d, 0),
            }
            by_phase = {
                k: int(fixed + static + v + ALLOCATOR_STATIC_FRACTION * static + ALLOCATOR_DYNAMIC_FRACTION * v)
                for k, v in phases.items()
            }
            phase = max(by_phase, key=lambda k: by_phase[k])
            comp["allocator_overhead"][d] = int(
                ALLOCATOR_STATIC_FRACTION * static + ALLOCATOR_DYNAMIC_FRACTION * phases[phase]
            )
            peak = by_phase[phase]
            if not any(phases.values()):
                phase = "static"  # nothing computes here: weights and adapters only
            if d.startswith("cuda"):
                budget = hw.gpus[int(d.split(":")[1])]
            else:
                budget = hw.host_ram
        entry = {
            "device": d,
            "budget": int(budget),
            "peak": int(peak),
            "headroom": int(budget - peak),
            "headroom_pct": round(100.0 * (budget - peak) / budget, 2) if budget else 0.0,
            "peak_phase": phase,
        }
        if d != "disk":
            entry["peak_by_phase"] = by_phase
        if max_memory_resolved is not None and d != "disk":
            key: Any = int(d.split(":")[1]) if d.startswith("cuda") else "cpu"
            entry["max_memory"] = int(max_memory_resolved.get(key, 0))
        devices.append(entry)

    if OPTIMIZERS[st.optim].endswith("_paged") and not hw.has_gpu:
        notes.append("paged optimizers fall back to unpaged on CPU (bitsandbytes): same bytes, no spill")
    if paged_total:
        notes.append(
            f"{paged_total / 2**20:,.0f} MiB of optimizer state is paged (CUDA managed memory): under pressure it "
            "spills to host RAM instead of failing"
        )
    if st.device_map is None and hw.has_gpu and len(hw.gpus) > 1:
        notes.append("offload.device_map null: every data-parallel rank holds a full copy; planned for one rank's GPU")
    if st.quantized and any(v in ("cpu", "disk") for v in placed.values()) and hw.has_gpu:
        notes.append(
            "layers on cpu/disk with a bitsandbytes model need "
            "BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True); "
            "their LoRA adapters, gradients and optimizer state are planned on cpu"
        )
    if not st.quantized:
        notes.append("quant=none: no prepare_model_for_kbit_training, weights stay in the precision dtype")

    gpu_peaks = [x["peak"] for x in devices if x["device"].startswith("cuda")]
    worst = max(gpu_peaks) if gpu_peaks else max(x["peak"] for x in devices if x["device"] == "cpu")
    trainable = counts["lora_params"]
    fits = all(x["peak"] <= x["budget"] for x in devices)
    components = {k: {d: int(v) for d, v in comp[k].items() if v} for k in COMPONENTS if any(comp[k].values())}
    fig = st.fig
    return {
        "version": 1,
        "model": {
            "name_or_path": st.name_or_path,
            "architecture": fig.architecture,
            "figures_from": fig.source,
            "hidden_size": fig.hidden_size,
            "num_layers": fig.num_layers,
            "num_heads": fig.num_heads,
            "num_kv_heads": fig.num_kv_heads,
            "head_dim": fig.head_dim,
            "intermediate_size": fig.intermediate_size,
            "vocab_size": fig.vocab_size,
            "tie_embeddings": fig.tie_embeddings,
        },
        "stack": {
            "quant": st.quant + ("+dq" if st.quantized and st.quant != "int8" and st.double_quant else ""),
            "peft": st.peft,
            "r": st.r,
            "alpha": st.alpha,
            "target_modules": list(st.target_modules) if isinstance(st.target_modules, tuple) else st.target_modules,
            "optim": st.optim,
            "dtype": st.dtype,
            "micro_batch_size": st.micro_batch,
            "grad_accum": st.grad_accum,
            "eval_batch_size": st.eval_batch if st.evaluates else None,
            "seq_len": st.seq_len,
            "gradient_checkpointing": st.checkpointing,
            "attention": "eager" if _eager(st) else st.attn,
            "device_map": st.device_map,
            "world_size": st.world_size,
            "hardware": {"gpus": list(hw.gpus), "host_ram": hw.host_ram, "declared": hw.declared},
        },
        "counts": {
            **counts,
            "trainable_params": trainable,
            "quantized_bytes_per_param": round(sum(comp["quantized_weights"].values()) / counts["params_quantized"], 6)
            if counts["params_quantized"]
            else None,
            "paged_optimizer_bytes": paged_total,
        },
        "components": components,
        "devices": devices,
        "device_map": {k: v for k, v in dmap.items()},
        "max_memory": {str(k): int(v) for k, v in max_memory_resolved.items()} if max_memory_resolved else None,
        "fits": fits,
        "peak_gib": round(worst / GiB, 3),
        "tokens_per_step": st.micro_batch * st.seq_len * st.grad_accum * st.world_size,
        "effective_batch": st.micro_batch * st.grad_accum * st.world_size,
        "ladder": [],
        "notes": notes,
        "constants": {
            "cuda_context_bytes": CUDA_CONTEXT_BYTES,
            "cpu_process_baseline_bytes": CPU_PROCESS_BASELINE_BYTES,
            "allocator_static_fraction": ALLOCATOR_STATIC_FRACTION,
            "allocator_dynamic_fraction": ALLOCATOR_DYNAMIC_FRACTION,
            "headroom_target": HEADROOM_TARGET,
        },
    }


# ---------------------------------------------------------------------------------------------
# The ladder
# ---------------------------------------------------------------------------------------------
def _ok(plan: dict, with_eval: bool = True) -> bool:
    """Every device at or under (1 - HEADROOM_TARGET) of its budget (eval phase optional)."""
    return _pressure(plan, with_eval) <= 1 - HEADROOM_TARGET


def _needs_ladder(plan: dict) -> bool:
    return not _ok(plan)


def _device_peak(d: dict, with_eval: bool) -> int:
    if with_eval or "peak_by_phase" not in d:
        return d["peak"]
    return max(v for k, v in d["peak_by_phase"].items() if k != "eval")


def _pressure(plan: dict, with_eval: bool = True) -> float:
    return max(_device_peak(d, with_eval) / d["budget"] if d["budget"] else math.inf for d in plan["devices"])


def _worst_device(plan: dict) -> dict:
    return max(plan["devices"], key=lambda d: d["peak"] / d["budget"] if d["budget"] else math.inf)


def _candidates(kind: str, st: Stack, hw: _dev.Hardware, plan: dict) -> list[tuple[Stack, dict[str, Any]]]:
    """Changes of one kind, mildest first, each as (new stack, override key -> value)."""
    out: list[tuple[Stack, dict[str, Any]]] = []
    if kind == "eval_batch":
        e = st.eval_batch // 2
        while st.evaluates and e >= 1:
            out.append((replace(st, eval_batch=e), {"trainer.eval_batch_size": e}))
            e //= 2
    elif kind == "micro_batch":
        total = st.micro_batch * st.grad_accum
        for m in range(st.micro_batch - 1, 0, -1):
            if total % m == 0:
                out.append(
                    (
                        replace(st, micro_batch=m, grad_accum=total // m),
                        {"trainer.micro_batch_size": m, "trainer.grad_accum": total // m},
                    )
                )
    elif kind == "checkpointing":
        if not st.checkpointing:
            out.append((replace(st, checkpointing=True), {"trainer.gradient_checkpointing": "true"}))
    elif kind == "optimizer":
        if OPTIMIZERS[st.optim] in ("adam32_torch", "adam32_torch_fused", "adam32_bnb_paged"):
            if hw.has_gpu and st.device_map != "cpu":
                out.append((replace(st, optim="paged_adamw_8bit"), {"optim": "paged8bit"}))
            else:
                out.append((replace(st, optim="adamw_bnb_8bit"), {"optim": "adamw8bit"}))
    elif kind == "seq_len":
        s = st.seq_len // 2
        while s >= 128:
            out.append((replace(st, seq_len=s), {"trainer.seq_len": s}))
            s //= 2
    elif kind == "rank":
        r = st.r // 2
        while r >= 4:
            ratio = r / st.r
            alpha = st.alpha * (math.sqrt(ratio) if st.peft == "rslora" else ratio)
            alpha_v = int(alpha) if float(alpha).is_integer() else round(alpha, 4)
            out.append((replace(st, r=r, alpha=alpha), {"peft.r": r, "peft.alpha": alpha_v}))
            r //= 2
    return out


def _offload_stack(st: Stack, option: str, gpu: str | None, cpu: str) -> tuple[Stack, dict[str, Any]]:
    """The stack with layers offloaded (device_map auto) under these budgets, and its overrides."""
    mm = dict(st.max_memory) if st.device_map in DEVICE_MAP_STRATEGIES else {}
    ov: dict[str, Any] = {}
    if st.offload_option != option and not (option == "cpu" and st.offload_option == "disk"):
        ov["offload"] = option  # conf/offload/{cpu,disk}.yaml: device_map auto, gpu and cpu budgets auto
        mm = {"gpu": "auto", "cpu": "auto"}
    present = set(mm)
    changes: dict[str, str] = {}
    if gpu is not None:
        for k in [k for k in mm if k.isdigit()] + ["gpu"]:
            changes[k] = gpu  # an explicit per-GPU budget would win over "gpu"
    if cpu != "auto" or "cpu" not in mm:
        changes["cpu"] = cpu
    for k, v in changes.items():
        mm[k] = v
        # max_memory is a typed dict in struct mode: a key it lacks needs Hydra's ++ (add or override)
        ov[f"{'' if k in present else '++'}offload.max_memory.{k}"] = v
    folder = st.offload_folder or ("offload" if option == "disk" else None)
    if option == "disk" and not st.offload_folder and "offload" not in ov:
        ov["offload.folder"] = folder
    new = replace(
        st,
        device_map="auto",
        max_memory=tuple(mm.items()),
        offload_folder=folder,
        offload_option="disk" if folder else "cpu",
    )
    return new, ov


def _largest(lo: int, hi: int, good) -> int | None:
    """Largest x in [lo, hi] with good(x), assuming good is monotone (true below some x)."""
    if hi < lo or not good(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if good(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _offload_rung(st: Stack, hw: _dev.Hardware, option: str):
    """Largest GPU budget (whole GiB) at which the GPUs fit with headroom; for disk offload then the
    largest CPU budget at which host RAM does too. Each probe is a full re-plan."""
    cache: dict = {}

    def plan_at(gpu: int | None, cpu: int | None):
        key = (gpu, cpu)
        if key not in cache:
            new, ov = _offload_stack(st, option, f"{gpu}GiB" if gpu else None, f"{cpu}GiB" if cpu else "auto")
            cache[key] = (new, ov, _try_plan(new, hw))
        return cache[key]

    def gpus_ok(p) -> bool:
        return p is not None and all(
            _device_peak(d, False) <= d["budget"] * (1 - HEADROOM_TARGET)
            for d in p["devices"]
            if d["device"].startswith("cuda")
        )

    gpu = None
    if hw.has_gpu:
        if st.device_map == "cpu":
            return None
        gpu = _largest(1, int(min(hw.gpus) // GiB), lambda x: gpus_ok(plan_at(x, None)[2]))
        if gpu is None:
            return None
    if option == "cpu":
        new, ov, p = plan_at(gpu, None)
        return (new, ov, p) if p is not None and _ok(p, False) else None
    cpu_top = int(hw.host_ram * _dev.AUTO_CPU_FRACTION // GiB)
    cpu = _largest(1, cpu_top, lambda y: (lambda p: p is not None and _ok(p, False))(plan_at(gpu, y)[2]))
    if cpu is None:
        return None
    return plan_at(gpu, cpu)


LADDER_ORDER = ("micro_batch", "checkpointing", "optimizer", "seq_len", "rank", "cpu_offload", "disk_offload")


def _ladder(st: Stack, hw: _dev.Hardware, plan: dict) -> list[dict]:
    """Cumulative rungs, cheapest first, until every device has HEADROOM_TARGET headroom.

    Training-phase rungs are judged on the training phases (an oversized eval batch must not make
    the ladder shrink the training micro-batch); a too-large eval batch gets its own free rung."""
    rungs: list[dict] = []
    cum: dict[str, Any] = {}
    state = {"st": st, "plan": plan}

    def add(kind: str, new_st: Stack, ov: dict, p: dict, with_eval: bool) -> None:
        if _pressure(p, with_eval) >= _pressure(state["plan"], with_eval) * 0.999:
            return  # costs something, gains nothing
        cum.update(ov)
        cost, why = COSTS[kind]
        worst = _worst_device(p)
        rungs.append(
            {
                "change": kind,
                "adds": " ".join(f"{k}={v}" for k, v in ov.items()),
                "overrides": " ".join(f"{k}={v}" for k, v in cum.items()),
                "peak_gib": p["peak_gib"],
                "worst_device": worst["device"],
                "worst_peak_gib": round(worst["peak"] / GiB, 3),
                "headroom_pct": worst["headroom_pct"],
                "fits": p["fits"],
                "cost": cost,
                "cost_note": why,
            }
        )
        state["st"], state["plan"] = new_st, p

    def eval_rung() -> None:
        if _ok(state["plan"]) or not _ok(state["plan"], with_eval=False):
            return
        chosen = _first_ok(_candidates("eval_batch", state["st"], hw, state["plan"]), hw, True)
        if chosen:
            add("eval_batch", *chosen, with_eval=True)

    eval_rung()
    for kind in LADDER_ORDER:
        if _ok(state["plan"], with_eval=False):
            break
        if kind in ("cpu_offload", "disk_offload"):
            chosen = _offload_rung(state["st"], hw, "cpu" if kind == "cpu_offload" else "disk")
        else:
            chosen = _first_ok(_candidates(kind, state["st"], hw, state["plan"]), hw, False)
            if chosen and kind in ("seq_len", "rank") and not _ok(chosen[2], False):
                continue  # costs quality and still does not fit: leave it to the offload rungs
        if chosen:
            add(kind, *chosen, with_eval=False)
    eval_rung()
    return rungs


def _first_ok(cands: list, hw: _dev.Hardware, with_eval: bool):
    """The mildest candidate that is ok, else the one with the least pressure."""
    tried = []
    for new_st, ov in cands:
        p = _try_plan(new_st, hw)
        if p is None:
            continue
        tried.append((new_st, ov, p))
        if _ok(p, with_eval):
            return tried[-1]
    return min(tried, key=lambda t: _pressure(t[2], with_eval)) if tried else None


def _try_plan(st: Stack, hw: _dev.Hardware) -> dict | None:
    try:
        return _plan(st, hw)
    except UserError:
        return None


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
_LABELS = {
    "quantized_weights": "quantized weights",
    "other_params": "other params",
    "buffers": "buffers",
    "lora_weights": "adapter weights (fp32)",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state",
    "activations": "activations kept",
    "layer_working": "* layer working set",
    "logits_loss": "* logits + loss",
    "dequant_scratch": "* dequant scratch",
    "optimizer_scratch": "* optimizer step",
    "eval_transient": "* eval batch",
    "offload_staging": "offload staging",
    "cuda_context": "CUDA context",
    "process_baseline": "process baseline",
    "allocator_overhead": "allocator overhead",
}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _g(n: float) -> str:
    return f"{n / GiB:.2f}"


def render_table(plan: dict) -> str:
    """The plan as a plain-text table (GiB) for the console."""
    m, st = plan["model"], plan["stack"]
    devs = [d["device"] for d in plan["devices"]]
    width = max(12, *(len(d) + 2 for d in devs))
    lines = []
    lines.append(
        f"memory plan: {m['name_or_path']} ({m['architecture']}, {_count(plan['counts']['params_total'])} params, "
        f"figures from {m['figures_from']})"
    )
    hw = st.get("hardware") or {}
    gpus = hw.get("gpus") or []
    where = (
        ", ".join(f"{n} x {g / GiB:.1f} GiB" for g, n in Counter(gpus).items())
        + " GPU"
        + ("s" if len(gpus) > 1 else "")
        if gpus
        else "no GPU"
    )
    if hw:
        lines.append(
            f"hardware: {where}, host RAM {hw['host_ram'] / GiB:.1f} GiB"
            f" ({'declared' if hw.get('declared') else 'this machine'})"
        )
    target = st["target_modules"] if isinstance(st["target_modules"], str) else ",".join(st["target_modules"])
    lines.append(
        f"stack: {st['quant']} | {st['peft']} r={st['r']} on {target} ({plan['counts']['lora_params']:,} params) | "
        f"{st['optim']} | {st['dtype']} | attention {st['attention']}"
    )
    lines.append(
        f"batch: {st['micro_batch_size']} x {st['seq_len']} tokens, accum {st['grad_accum']}"
        f"{' x ' + str(st['world_size']) + ' ranks' if st['world_size'] > 1 else ''} -> effective batch "
        f"{plan['effective_batch']}, {plan['tokens_per_step']:,} tokens/step | checkpointing "
        f"{'on' if st['gradient_checkpointing'] else 'off'}"
    )
    lines.append("")
    head = f"{'GiB':<26}" + "".join(f"{d:>{width}}" for d in devs)
    lines.append(head)
    lines.append("-" * len(head))
    for key in COMPONENTS:
        row = plan["components"].get(key)
        if not row:
            continue
        lines.append(
            f"{_LABELS[key]:<26}" + "".join(f"{_g(row.get(d, 0)) if row.get(d) else '-':>{width}}" for d in devs)
        )
    lines.append("-" * len(head))
    by = {d["device"]: d for d in plan["devices"]}
    lines.append(f"{'peak':<26}" + "".join(f"{_g(by[d]['peak']):>{width}}" for d in devs))
    lines.append(f"{'budget':<26}" + "".join(f"{_g(by[d]['budget']):>{width}}" for d in devs))
    if any("max_memory" in by[d] for d in devs):
        lines.append(
            f"{'max_memory (weights)':<26}"
            + "".join(f"{_g(by[d]['max_memory']) if 'max_memory' in by[d] else '-':>{width}}" for d in devs)
        )
    lines.append(f"{'headroom %':<26}" + "".join(f"{by[d]['headroom_pct']:>{width}.1f}" for d in devs))
    short = {
        "train: loss": "loss",
        "train: layer backward": "backward",
        "optimizer step": "optim step",
        "eval": "eval",
        "offloaded weights": "weights",
        "static": "weights",
    }
    lines.append(
        f"{'peak phase':<26}"
        + "".join(f"{short.get(by[d]['peak_phase'], by[d]['peak_phase'])[: width - 1]:>{width}}" for d in devs)
    )
    lines.append("* transient: only the largest phase (train / optimizer step / eval) counts toward the peak")
    dm = plan["device_map"]
    if len(dm) > 1:
        spread: dict[str, int] = defaultdict(int)
        for v in dm.values():
            spread[_dev_name(v)] += 1
        lines.append("device map: " + ", ".join(f"{k}: {v} modules" for k, v in spread.items()))
    for note in plan["notes"]:
        lines.append(f"note: {note}")
    worst = max(plan["devices"], key=lambda d: d["peak"] / d["budget"] if d["budget"] else math.inf)
    verdict = "FITS" if plan["fits"] else "DOES NOT FIT"
    lines.append(
        f"{verdict}: peak {plan['peak_gib']:.2f} GiB; tightest {worst['device']} "
        f"{_g(worst['peak'])} of {_g(worst['budget'])} GiB ({worst['headroom_pct']:.1f} % headroom)"
    )
    if plan["ladder"]:
        lines.append("ladder (cumulative, cheapest first):")
        for i, r in enumerate(plan["ladder"], 1):
            lines.append(
                f"  {i}. {r['change']:<14} peak {r['worst_peak_gib']:7.2f} GiB on {r['worst_device']}"
                f" {'fits' if r['fits'] else 'no fit'}  cost {r['cost']:<8} {r['overrides']}"
            )
    return "\n".join(lines)


class DoesNotFit(UserError):
    """The plan says the stack does not fit its devices (a sweep records the job as skipped)."""


def refuse_unless_fits(plan: dict, force: bool) -> None:
    """Raise UserError (one line, with the first fitting rung) unless the plan fits or force is set."""
    if plan["fits"] or force:
        return
    over = [d for d in plan["devices"] if d["peak"] > d["budget"]]
    worst = max(over, key=lambda d: d["peak"] / d["budget"] if d["budget"] else math.inf)
    ladder = plan.get("ladder") or []
    good = next((r for r in ladder if r["fits"]), None)
    if good:
        hint = f"try: {good['overrides']} (see plan.json ladder)"
    elif ladder:
        hint = f"even {ladder[-1]['overrides']} does not fit (see plan.json ladder); use a larger device"
    else:
        hint = "no override makes it fit; use a larger device"
    raise DoesNotFit(
        f"stack does not fit: peak {worst['peak'] / GiB:.1f} GiB > budget {worst['budget'] / GiB:.1f} GiB on "
        f"{worst['device']}; {hint}; force=true to start anyway"
    )


def write_plan(plan: dict, run_dir: str | os.PathLike) -> Path:
    """Write plan.json into run_dir (created if needed); returns its path."""
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2, sort_keys=False) + "\n")
    return path


def loader_device_map(plan: dict) -> dict:
    """The planned device map in from_pretrained's form (GPU indices as ints)."""
    return {k: (int(v) if isinstance(v, int) or str(v).isdigit() else v) for k, v in plan["device_map"].items()}


def loader_max_memory(plan: dict) -> dict | None:
    """The resolved max_memory in from_pretrained's form ({0: bytes, ..., "cpu": bytes}), or None."""
    mm = plan.get("max_memory")
    if not mm:
        return None
    return {(int(k) if k.isdigit() else k): int(v) for k, v in mm.items()}
