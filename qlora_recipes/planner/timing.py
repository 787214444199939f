"""Time in the plan: seconds per optimizer step and tokens/s of a stack on a named GPU (config/gpus.py),
from the work the planner already counts, and with the run's step count the expected wall time.

A roofline-style sum per micro-batch, each term at an efficiency:
  matmuls      2 x active params x tokens per pass of the layers: the forward, checkpointing's
               recompute, and the backward's input gradient (frozen weights get no weight gradient);
               LoRA's two small matmuls per adapted linear, whose backward also makes the weight
               gradient; TRL's fused LM head (forward, the backward's recompute of each tile and the
               input gradient); MoE layers count their top-k experts only
  attention    causal flash kernels: 2 x heads x head_dim x n^2 per row and layer, the backward 2.5x
               (FlashAttention-2's five matmuls to the forward's two); SDPA given a mask (padding)
               runs the whole n^2, padding-free packing under sdpa at its own measured rate, eager
               as plain matmuls
  memory       4-bit dequantization in every pass (packed read, 16-bit write, the matmul's 16-bit
               read), frozen 16/32-bit weights read (and cast by autocast), and the tensors a layer
               keeps for backward (components.layer_saved_bytes) moving ELEMENTWISE_TRAFFIC times
               per pass, at BANDWIDTH_EFFICIENCY of the card's bandwidth
  dispatch     OP_SECONDS per module call the host issues (eager PyTorch: Python, autograd and kernel
               launch), which a small micro-batch cannot hide behind the GPU
  host link    activation offloading's copies (overlapped with compute on their own streams: only the
               excess counts), a device map's offloaded layers (onloaded for every pass)
Per step: grad_accum micro-batches, the optimizer step, data-parallel ranks' all-reduce of the adapter
gradients (FSDP / ZeRO-3: the all-gather of the sharded weights in every pass), and STEP_SECONDS of
trainer bookkeeping. What the model leaves out: evaluation, saving, GRPO's generation.

The efficiency constants are fitted on bench/results/nvidia-h100-80gb-hbm3-2026-11-26.json (every
run of every stack, ours and the baseline) and the warm-up-inclusive tokens/s of
bench/results/long-context-nvidia-h100-80gb-hbm3-2026-11-26.md: `python -m bench.time_fit` reprints
each row's prediction and the search that chose them; the test of this room
(tests/unit/test_the_plan_times_a_step_on_a_named_gpu.py) holds every row within TIME_TOLERANCE. One
card (H100 SXM) and one model shape (8B) set them: other cards scale by their datasheet figures, which
is the model's assumption, not a measurement.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config.gpus import Gpu
from .components import block_bytes as _block_bytes
from .components import eager, layer_saved_bytes, sdpa_masked
from .constants import OPTIMIZERS
from .spec import StackSpec

# Fitted by `python -m bench.time_fit --search` on the two H100 files above (the grid point with the
# smallest worst error over every row, ties broken by the mean error; the ours/baseline pair of one stack,
# 0.756 and 0.589 s/step for the same work, sets that worst error's floor at 13 %):
# the share of the card's dense 16-bit peak the layers' matmuls reach (bitsandbytes dequantizes, then
# cuBLAS multiplies in bf16; large bf16 GEMMs reach 0.6-0.75 of it on H100)...
MATMUL_EFFICIENCY = 0.7
# ... the host's seconds per module call (a linear, its LoRA branch, a norm, attention: each a few kernels
# and Python frames, more in backward), which at 2,048 tokens is about half of a step...
OP_SECONDS = 100e-6
# ... SDPA's flash kernel (FlashAttention-2 reaches 0.3-0.4 of the H100's dense peak at head dim 128:
# FlashAttention-3 paper, Shah et al. 2024, figures 5-6), set by the long-context rows...
ATTENTION_EFFICIENCY = 0.4
# ... padding-free packing under sdpa (one flat row, a block-diagonal mask, no flash kernel), charged to its
# attention: set by the one packed row (8b-mixed-packing), 0.5 s/step slower than the unpacked stack at the
# same tokens; a padded batch's mask instead costs its kernel the causal skip (the whole square)...
PACKED_ATTENTION_EFFICIENCY = 0.02
# ... and the times each tensor a layer keeps for backward moves through memory per pass (written, read
# by the next op and by backward, its gradient written and read), which prices the fp32 residual stream.
ELEMENTWISE_TRAFFIC = 4.0
# Elementwise and dequantization kernels stream at about 80 % of the bandwidth (STREAM-like copies on HBM).
BANDWIDTH_EFFICIENCY = 0.8
# PCIe copies reach about 80 % of the slot's rate (pinned host memory; cudaMemcpy bandwidth tests).
LINK_EFFICIENCY = 0.8
# A device map's disk modules are read at an NVMe SSD's sequential rate (PCIe 4.0 drives' datasheets:
# about 7 GB/s; the page cache can do better when host RAM holds the files).
DISK_GB_S = 7.0
# Trainer bookkeeping per optimizer step (callbacks, logging, the learning-rate step, grad-norm clipping).
STEP_SECONDS = 0.02
# Trainer construction and the first steps' extra seconds (CUDA kernels loaded, autotuning, the paged
# optimizer's state made): the median over the H100 file's runs of train seconds - steps x steady s/step
# (bench.time_fit.warmup_seconds, which the test holds this figure to).
WARMUP_SECONDS = 3.58
# Every committed GPU measurement is within this of the model (the test of this room checks each).
TIME_TOLERANCE = 0.25
# Module calls per decoder layer besides its linears (2 norms, rotary, attention, activation, residuals).
LAYER_OPS = 8
BACKWARD_OPS = 2  # the backward's module calls per forward one (autograd nodes of each op)


@dataclass(frozen=True)
class Work:
    """What one micro-batch's forward and backward ask of the card (one rank)."""

    matmul_flops: float
    attention_flops: float  # flash / SDPA kernels
    packed_attention_flops: float  # padding-free packing under sdpa
    weight_bytes: float  # weights read, dequantized, cast
    kept_bytes: float  # the layers' kept tensors, once per pass (ELEMENTWISE_TRAFFIC times that moves)
    ops: float  # module calls the host issues
    link_bytes: float  # activation offloading's copies, overlapped with compute


@functools.lru_cache(maxsize=16)
def block_bytes(st: StackSpec) -> list[tuple]:
    """components.block_bytes, kept for the few specs a plan times (each is asked several times)."""
    return _block_bytes(st)


@dataclass
class _Layers:
    """The decoder layers' parameters as the time model counts them."""

    active: float = 0.0  # params one token multiplies with (MoE: its top-k experts)
    quantized: int = 0  # 4-bit / 8-bit params, all dequantized in every pass
    frozen_16bit: float = 0.0  # active params kept in 16/32 bits (quant=none, skip_modules, 16-bit experts)
    adapted: int = 0  # adapted linears (a LoRA branch each)
    lora: int = 0  # LoRA params
    linears: int = 0  # linears (module calls) per layer


def _layers(st: StackSpec) -> _Layers:
    out, share = _Layers(), _expert_share(st)
    for blk, bb in block_bytes(st):
        if not blk.is_layer:
            continue
        experts = sum(n for _, n in blk.experts)
        dense = sum(lin.numel for lin in blk.linears)
        out.active += dense + experts * share
        quantized_experts = experts if st.quantized and st.quant in ("nf4", "fp4") and st.experts_4bit else 0
        out.quantized += bb.params_quantized
        out.frozen_16bit += dense - (bb.params_quantized - quantized_experts) + (experts - quantized_experts) * share
        out.adapted += len(bb.lora_tensors) // 2
        out.lora += bb.lora_numel
        out.linears = len(blk.linears) + (1 if experts else 0)
    return out


def recompute_share(st: StackSpec) -> float:
    """The share of decoder layers checkpointing recomputes: all, none, or trainer.gradient_checkpointing=N's."""
    if not st.checkpointing:
        return 0.0
    layers = st.fig.num_layers
    return 1.0 if st.ckpt_layers is None else min(layers, max(0, st.ckpt_layers)) / layers


def _expert_share(st: StackSpec) -> float:
    fig = st.fig
    return fig.experts_per_token / fig.num_experts if fig.num_experts else 1.0


def _attention_flops(st: StackSpec, rows: int, n: int) -> float:
    """One forward of every layer's attention scores and weighted sum: 4 x heads x head_dim per pair of
    positions, causal kernels computing half the pairs (a sliding layer: its window)."""
    fig = st.fig
    per_pair = 4 * fig.num_heads * fig.head_dim
    total = 0.0
    for i in range(fig.num_layers):
        local = i < len(fig.layer_types) and fig.layer_types[i] == "sliding_attention" and fig.sliding_window
        pairs = n * min(n, fig.sliding_window) if local else n * n / 2
        total += rows * per_pair * pairs
    return total


@functools.lru_cache(maxsize=16)
def micro_batch_work(st: StackSpec) -> Work:
    """The work of one micro-batch's forward and backward on one rank."""
    fig = st.fig
    rows, n = (1, st.train_rows * st.seq_len) if st.padding_free else (st.train_rows, st.seq_len)
    extra = (1 if st.reference in ("adapter_off", "init_adapter") else 0) + (1 if st.kl_batch else 0)
    share = recompute_share(st)
    forwards = 1 + share + extra  # the recompute is another forward (of the checkpointed layers)
    lay = _layers(st)
    head = 2 * fig.vocab_size * fig.hidden_size * rows * (n - 1)
    matmul = 2 * lay.active * rows * n * (forwards + 1)  # + the backward's input gradient
    matmul += 2 * lay.lora * rows * n * (forwards + 2)  # the backward: input and weight gradients
    head_passes = 3 + extra  # forward, backward's tile recompute, input gradient; + the no-grad forwards'
    matmul += head * head_passes
    attention = _attention_flops(st, rows, n) * (forwards + 2.5)
    flash = packed = 0.0
    if eager(st):
        matmul += 2 * attention  # scores and weighted sum as plain matmuls, the whole square
    elif st.padding_free and st.attn == "sdpa":  # the measured case: a dense block-diagonal mask
        packed = 2 * attention  # no causal skip in a masked kernel
    elif sdpa_masked(st, st.train_rows):
        flash = 2 * attention
    else:
        flash = attention
    c = st.act_bytes
    q_bytes = 0.5 if st.quant in ("nf4", "fp4") else 1.0
    cast = 2 * c if st.frozen_bytes != c else 0  # autocast's 16-bit copy of an upcast weight, written and read
    weights = (forwards + 1) * (lay.quantized * (q_bytes + 2 * c) + lay.frozen_16bit * (st.frozen_bytes + cast))
    weights += head_passes * fig.vocab_size * fig.hidden_size * (st.frozen_bytes + cast)
    saved = sum(layer_saved_bytes(st, bb, st.train_rows) for blk, bb in block_bytes(st) if blk.is_layer)
    link = 0.0
    if st.activation_offloading:  # each kept layer input to host RAM and back
        inputs = rows * n * fig.hidden_size * st.frozen_bytes * fig.num_layers  # a checkpointed layer's
        link = 2 * (share * inputs + (1 - share) * saved)
    layer_ops = LAYER_OPS + lay.linears + lay.adapted / fig.num_layers
    return Work(
        matmul_flops=matmul,
        attention_flops=flash,
        packed_attention_flops=packed,
        weight_bytes=weights,
        kept_bytes=saved * (forwards + BACKWARD_OPS),
        ops=fig.num_layers * layer_ops * (forwards + BACKWARD_OPS),
        link_bytes=link,
    )


def step_seconds(st: StackSpec, gpu: Gpu, offloaded_bytes: int = 0, sharded: bool = False, disk_bytes: int = 0) -> dict:
    """Seconds per optimizer step of `st` on `gpu` (one rank of st.world_size), by term, and tokens/s.

    offloaded_bytes: the weights a device map keeps in host RAM, onloaded for every pass; disk_bytes:
    those it reads from disk for every pass (at DISK_GB_S, then over the link); sharded: FSDP / ZeRO-3,
    whose ranks all-gather the (quantized) weights in every pass."""
    w = micro_batch_work(st)
    peak, bw = gpu.tflops_16bit * 1e12, gpu.memory_tb_s * 1e12 * BANDWIDTH_EFFICIENCY
    passes = 2 + recompute_share(st)
    compute = (
        w.matmul_flops / (peak * MATMUL_EFFICIENCY)
        + w.attention_flops / (peak * ATTENTION_EFFICIENCY)
        + w.packed_attention_flops / (peak * PACKED_ATTENTION_EFFICIENCY)
    )
    memory = (w.weight_bytes + ELEMENTWISE_TRAFFIC * w.kept_bytes) / bw
    dispatch = w.ops * OP_SECONDS
    link = gpu.host_link_gb_s * 1e9 * LINK_EFFICIENCY
    offload = max(0.0, w.link_bytes / link - (compute + memory))  # copies on their own streams
    onload = (offloaded_bytes + disk_bytes) * passes / link + disk_bytes * passes / (DISK_GB_S * 1e9)
    micro = compute + memory + dispatch + offload + onload
    ws = max(1, st.world_size)
    peer = gpu.peer_link_gb_s * 1e9 * LINK_EFFICIENCY
    trainable = sum(bb.lora_numel for _, bb in block_bytes(st))
    collectives = 2 * (ws - 1) / ws * trainable * st.adapter_bytes / peer if ws > 1 else 0.0
    if sharded and ws > 1:
        weights = sum(bb.quant_data + bb.quant_state + bb.other for _, bb in block_bytes(st))
        collectives += st.grad_accum * passes * (ws - 1) / ws * weights / peer
    optimizer = _optimizer_seconds(st, trainable, bw)
    per_step = st.grad_accum * micro + optimizer + collectives + STEP_SECONDS
    tokens = st.micro_batch * st.seq_len * st.grad_accum * ws
    return {
        "gpu": gpu.name,
        "s_per_step": per_step,
        "tokens_per_s": tokens / per_step,
        "terms_s": {
            "matmul_and_attention": st.grad_accum * compute,
            "memory": st.grad_accum * memory,
            "dispatch": st.grad_accum * dispatch,
            "host_link": st.grad_accum * (offload + onload),
            "optimizer": optimizer,
            "collectives": collectives,
            "step_bookkeeping": STEP_SECONDS,
        },
    }


def _optimizer_seconds(st: StackSpec, trainable: int, bandwidth: float) -> float:
    """The optimizer step: each trainable tensor's parameter, gradient and states read and written, one
    kernel per tensor (bitsandbytes' and torch's foreach / fused steps)."""
    state = 2 if OPTIMIZERS[st.optim].startswith("adam8") else 8
    per_element = 2 * st.adapter_bytes + st.adapter_bytes + 2 * state
    tensors = sum(len(bb.lora_tensors) for _, bb in block_bytes(st))
    return trainable * per_element / bandwidth + tensors * OP_SECONDS


def wall_seconds(per_step: float, steps: int) -> float:
    """A run of `steps` optimizer steps, its warm-up included (loading the model is not)."""
    return steps * per_step + WARMUP_SECONDS


FITTED_ON = (
    "bench/results/nvidia-h100-80gb-hbm3-2026-11-26.json, "
    "bench/results/long-context-nvidia-h100-80gb-hbm3-2026-11-26.md"
)


def constants() -> dict:
    """The model's constants as plan.json records them, with where the fitted ones come from."""
    fitted = ("MATMUL_EFFICIENCY", "OP_SECONDS", "ATTENTION_EFFICIENCY", "PACKED_ATTENTION_EFFICIENCY")
    fitted += ("ELEMENTWISE_TRAFFIC", "WARMUP_SECONDS")
    stated = ("BANDWIDTH_EFFICIENCY", "LINK_EFFICIENCY", "DISK_GB_S", "STEP_SECONDS", "LAYER_OPS", "BACKWARD_OPS")
    return {
        "fitted": {k.lower(): globals()[k] for k in fitted},
        "fitted_on": FITTED_ON + " (python -m bench.time_fit --search)",
        "stated": {k.lower(): globals()[k] for k in stated},
    }
