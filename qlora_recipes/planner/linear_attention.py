"""What a Qwen3.5 Gated DeltaNet layer (linear attention) keeps for backward and holds while it runs,
in place of attention's Q/K/V/out and log-sum-exp: per token of a row padded to the kernel's 64-token
chunks, plus the recurrent state [value heads, k_dim, v_dim] of each chunk.

On a CPU (and on a GPU without flash-linear-attention) transformers runs `torch_chunk_gated_delta_rule`
(models/qwen3_5/modeling_qwen3_5.py) in fp32 under autograd: the causal conv's input and output, the q/k
copies its l2norm keeps, the padded q/k/v, k*beta, the five [chunk x chunk] matrices per value head
(pairwise decay, the UT system before and after its mask, the intra-chunk scores before and after
theirs), the triangular solves' outputs, the decayed q/k, each chunk's v_new and the state it starts
from; the gated RMSNorm keeps four value-width tensors and z. Measured against what autograd keeps on
CPU (tests/unit/test_moe_and_new_families_are_planned_from_their_figures.py).

On a GPU with flash-linear-attention (`fla`) installed the kernel is fla's `chunk_gated_delta_rule`. An
assumption, from its autograd Function as published (not run here): it saves the l2-normalised q and k
(key heads, compute dtype) with their fp32 rstd, v, the fp32 decay cumsum, beta and the solved chunk
matrix A [value heads x chunk] per token, and recomputes the per-chunk states in backward, where they
are transient (counted in the layer working set).
"""

from __future__ import annotations

import importlib.util
from typing import Any

CHUNK = 64  # torch_chunk_gated_delta_rule's and fla's chunk size


def fla_kernel(on_cpu: bool) -> bool:
    """The GPU kernel is fla's where the package is installed (transformers' hub fallback picks it)."""
    return not on_cpu and importlib.util.find_spec("fla") is not None


def padded(s: int) -> int:
    """A row's tokens as the kernel pads them: up to a multiple of its chunk."""
    return -(-s // CHUNK) * CHUNK


def _dims(fig: Any) -> tuple[int, int, int, int, int]:
    """(key width, value width, key width repeated to the value heads, value heads, state per head)."""
    hv = fig.linear_v_heads
    kd, vd = fig.linear_k_heads * fig.linear_k_dim, hv * fig.linear_v_dim
    return kd, vd, hv * fig.linear_k_dim, hv, fig.linear_k_dim * fig.linear_v_dim


def saved_bytes(fig: Any, rows: int, s: int, c: int, r: int, on_cpu: bool) -> int:
    """Bytes one Gated DeltaNet layer keeps for backward over `rows` rows of s tokens (c: compute, r:
    residual bytes), its projections' LoRA terms aside (counted per adapted linear)."""
    kd, vd, kr, hv, state = _dims(fig)
    conv = 2 * kd + vd
    t, tp = rows * s, rows * padded(s)
    # the conv's input and its activation's input (autocast runs the conv in c), z, beta; the gated
    # norm's x, normed, weighted, silu(z)
    outer = t * (c * 2 * conv + r * (vd + hv) + 4 * (4 * vd + 3 * hv))
    if fla_kernel(on_cpu):
        return outer + t * (c * (2 * kd + vd + hv + hv * CHUNK) + 4 * (2 * fig.linear_k_heads + hv))
    # q/k kept by l2norm, padded q/k/v, k*beta, k_cumdecay, decayed q/k: 8 key-width, 3 value-width
    # tensors (padded v, the solve's new values, v_new); five chunk x chunk matrices; a state per chunk
    inner = tp * 4 * (8 * kr + 3 * vd + 5 * hv * CHUNK + 8 * hv)
    return outer + inner + rows * (tp // rows // CHUNK + 1) * hv * state * 4


def working_bytes(fig: Any, rows: int, s: int, c: int, on_cpu: bool) -> int:
    """The transients of its backward: the per-chunk states' gradients (fla: the recomputed states) and
    the chunk matrices' gradients, fp32 on the torch kernel."""
    _, vd, kr, hv, state = _dims(fig)
    tp = rows * padded(s)
    chunks = tp // CHUNK
    if fla_kernel(on_cpu):
        return chunks * hv * state * c + tp * c * (2 * kr + 2 * vd)
    return 2 * chunks * hv * state * 4 + tp * 4 * (2 * hv * CHUNK + 2 * kr + 2 * vd)


def forward_bytes(fig: Any, rows: int, s: int, c: int, on_cpu: bool) -> int:
    """What its forward without grad holds at once (evaluation, the reference model): the kernel's
    intermediates, held as locals until it returns."""
    kd, vd, kr, hv, state = _dims(fig)
    tp = rows * padded(s)
    if fla_kernel(on_cpu):
        return tp * c * (2 * kd + 2 * vd + hv * CHUNK) + tp // CHUNK * hv * state * c
    return tp * 4 * (6 * kr + 4 * vd + 3 * hv * CHUNK) + rows * hv * state * 4
