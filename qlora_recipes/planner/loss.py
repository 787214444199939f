"""Bytes of the loss path TRL 1.16 really takes, of evaluation and of the exact-match metric.

Training. SFTTrainer.__init__ patches the model with `add_fused_lm_head` (trl/trainer/utils.py) and
SFTTrainer.compute_loss calls `model(..., fused_lm_head=True)`: the backbone runs (final norm
included), its last hidden state is sliced to the positions that have a next token, and
`ChunkedLogProbFunction` (trl/kernels/chunked_logprob.py) projects it through lm_head.weight in
tiles of up to TOKEN_TILE tokens x VOCAB_TILE vocabulary entries, all written into one reused
(min(N, 4096), 32768) buffer in the compute dtype (autocast's, else the hidden states'), folding
each tile into online-logsumexp statistics; backward recomputes every tile, turns it into the
logits gradient in place and accumulates an fp32 gradient of the hidden states. The (b, s, V)
logits never exist. Where Triton runs (CUDA), only the positions whose label is not -100 are
projected (`hidden_states[mask]`, a copy) and the fold is a kernel that allocates nothing; on CPU
(torch ops on the whole tile) every position is projected and each fold allocates fp32
temporaries: FOLD_BYTES per tile element (from the source; tests/unit/test_planner_loss_is_trls_fused_head.py measures it).
The planner does not see the data, so N counts every position of the micro-batch that has a next
token, b*(s-1): exact on CPU, an upper bound on a GPU, where prompt (completion_only_loss) and
padding positions are skipped.

TRL builds full logits only for label_smoothing_factor > 0, a compute_loss_func, or
prediction_step asking for logits (compute_metrics); this repository sets none of them (no key of
conf/ reaches them), so no full-logits term is planned.

Evaluation. Trainer.evaluate without compute_metrics asks prediction_step for the loss only, which
calls the same compute_loss under no_grad: the fused head's forward, nothing saved.

Exact-match metric (metrics.exact_match -> generation.generate): greedy `model.generate` on up to
GEN_METRIC_BATCH prompts at a time and at most eval_batch x seq_len positions (prompt + new
tokens), outside the trainer (no autocast); transformers keeps logits for the last position only
(logits_to_keep=1) plus their fp32 copy, and a KV cache that grows to prompt + max_new_tokens
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from .components import act_dtypes, eval_layer_bytes
from .spec import StackSpec

if TYPE_CHECKING:
    from ..config.schema import DataConfig

TOKEN_TILE = 4096  # trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE
VOCAB_TILE = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE: the buffer's width, whatever V
GEN_METRIC_BATCH = 32  # metrics.exact_match's batch_size (tests/unit/test_planner_loss_is_trls_fused_head.py checks it)
# fp32 temporaries per tile element of the CPU fold (_forward_tile / _backward_tile): forward z, its
# shifted copy and exp, the bool before-target mask (13); backward y, z, log_p, p, grad, the bool
# target mask and two temporaries of the gradient update (29), + tanh for Gemma 2's soft-capping.
FOLD_BYTES = {"forward": 13, "backward": 29, "softcap": 4}
# per position: 7 fp32 running statistics, int64 targets, the outputs and their masked copies
VECTOR_BYTES = 40


@dataclass(frozen=True)
class MetricStack(StackSpec):
    """A StackSpec with the generation figures of the exact-match metric (0: no metric). A subclass
    so that the ladder's `dataclasses.replace` copies keep them."""

    gen_batch: int = 0
    gen_new_tokens: int = 0


def with_metric(st: StackSpec, data: DataConfig) -> StackSpec:
    """`st` with data.metric's generation figures: exact_match on an eval split generates for
    min(GEN_METRIC_BATCH, data.metric_examples) prompts at a time, data.max_new_tokens each."""
    limit = min(GEN_METRIC_BATCH, int(data.metric_examples))
    if data.metric != "exact_match" or not st.evaluates or limit <= 0:
        return st
    base = {f.name: getattr(st, f.name) for f in fields(StackSpec)}
    return MetricStack(**base, gen_batch=limit, gen_new_tokens=int(data.max_new_tokens))


@dataclass(frozen=True)
class _Head:
    """The figures of one fused-head call: N positions, a token tile of n, a vocabulary tile of
    `cols`, bytes c (compute), r (hidden states; lm_head.weight has the same dtype: both follow
    prepare_model_for_kbit_training's upcast)."""

    n_pos: int
    n: int
    cols: int
    c: int
    r: int
    h: int
    triton: bool
    softcap: bool
    vocab: int


def _head(st: StackSpec, b: int, on_cpu: bool) -> _Head:
    c, r, _ = act_dtypes(st, on_cpu)
    # grpo: the fused head over the completions alone (TRL's labels), not the prompts - where Triton
    # runs it compact; on the CPU TRL scores every position (fixed tile shapes) and masks after
    completion = getattr(st, "completion_len", 0) if not on_cpu else 0
    n_pos = b * (completion or st.seq_len - 1)
    fig = st.fig
    return _Head(
        n_pos, min(n_pos, TOKEN_TILE), min(fig.vocab_size, VOCAB_TILE), c, r, fig.hidden_size,
        triton=not on_cpu, softcap=fig.softcapped_logits, vocab=fig.vocab_size,
    )  # fmt: skip


def _tile_bytes(k: _Head, backward: bool) -> int:
    """The reused projection buffer, the compute-dtype copies of a token chunk and a vocabulary
    chunk of lm_head.weight (when the dtypes differ), and on CPU the fold's fp32 temporaries. In
    forward the weight chunk is a temporary of the matmul, gone before the fold; in backward it
    lives through the fold and the gradient GEMMs."""
    hidden_chunk = k.n * k.h * k.c if k.r != k.c else 0
    if not k.triton:
        return hidden_chunk + max(_cpu_tile_bytes(k, w, backward) for w in _tile_widths(k.vocab))
    buf = k.n * VOCAB_TILE * k.c
    weight_chunk = k.cols * k.h * k.c if k.r != k.c else 0
    if backward and weight_chunk and k.vocab > VOCAB_TILE:
        # ChunkedLogProbFunction.backward rebinds `w_chunk = weight[start:end].to(compute_dtype)`:
        # the next tile's copy is made while the previous one is still referenced, so two coexist
        # (bench/trace shows both at the loss phase's peak)
        weight_chunk += min(VOCAB_TILE, k.vocab - VOCAB_TILE) * k.h * k.c
    return buf + hidden_chunk + weight_chunk  # the Triton fold allocates nothing


def _tile_widths(vocab: int) -> set[int]:
    """The widths of the vocabulary tiles: VOCAB_TILE, and the remainder's."""
    return {w for w in (min(vocab, VOCAB_TILE), vocab % VOCAB_TILE) if w}


def _cpu_tile_bytes(k: _Head, width: int, backward: bool) -> int:
    """One tile on CPU, as the process's RSS sees it: the buffer's pages that tiles have written
    (torch.empty pages count once touched: n x min(V, VOCAB_TILE) of its n x VOCAB_TILE), the
    result of torch.mm into a tile narrower than the buffer (a strided `out`: mm computes into a
    contiguous temporary and copies), the fold's fp32 temporaries (FOLD_BYTES per element) and the
    compute-dtype copy of the weight chunk (when the dtypes differ), alive through the backward's
    fold but only through the forward's matmul. After the backward's fold, the fp32 accumulation of
    the hidden states' gradient (_addmm_fp32: `acc.addmm_(a.float(), b.float())` off CUDA) takes fp32
    copies of the tile and of the weight chunk when the compute dtype is 16-bit: that weight copy
    does not shrink with the tokens, so over few positions it outgrows the fold. (On CUDA, torch >= 2.8
    - requirements.txt pins 2.13 - accumulates in fp32 without copies.)
    tests/unit/test_planner_loss_is_trls_fused_head.py measures these."""
    touched = k.n * k.cols * k.c
    strided = k.n * width * k.c if width < VOCAB_TILE else 0
    weight_chunk = width * k.h * k.c if k.r != k.c else 0
    per = FOLD_BYTES["backward"] + FOLD_BYTES["softcap"] * k.softcap if backward else FOLD_BYTES["forward"]
    fold = per * k.n * width
    if backward:
        upcast = 4 * width * (k.n + k.h) if k.c != 4 else 0
        return touched + weight_chunk + max(strided, fold, upcast)
    return touched + max(weight_chunk + strided, fold)


def _head_input(k: _Head, b: int, s: int) -> tuple[int, int]:
    """(backbone output, extra copy of the head's input). The backbone's last hidden state (b, s, h)
    is held through the head's forward; the head takes `hidden_states[mask]` on CUDA (a copy) and
    the [:, :-1] slice reshaped on CPU (a copy for b > 1, a view of the backbone output at b = 1)."""
    out = b * s * k.h * k.r
    return out, (k.n_pos * k.h * k.r if k.triton or b > 1 else 0)


def train_loss_bytes(st: StackSpec, b: int, on_cpu: bool = False) -> int:
    """The loss of one training micro-batch: the final norm's saved fp32 input (trainer.lean_rmsnorm:
    its 16-bit input) and rsqrt, the head's saved input and per-position vectors, and the larger of
    its forward (backbone output still held) and its backward (fp32 gradient of the head's input,
    tiles)."""
    k = _head(st, b, on_cpu)
    s = st.seq_len
    norm = b * s * ((st.frozen_bytes if st.lean_norms else 4) * k.h + 4)  # lean: the norm's 16-bit input
    out, copy = _head_input(k, b, s)
    saved = (copy or out) + 16 * k.n_pos
    forward = out + copy + VECTOR_BYTES * k.n_pos + _tile_bytes(k, backward=False)
    backward = saved + 4 * k.n_pos * k.h + 8 * k.n_pos + _tile_bytes(k, backward=True)
    return norm + max(forward, backward)


def reference_head_bytes(st: StackSpec, b: int, on_cpu: bool = False) -> int:
    """DPO's reference forward where the LM head computes (TRL 1.16 DPOTrainer._compute_loss): the policy's
    forward is done and holds what its backward needs - the final norm's saved input, the head's saved
    input and per-position vectors - while the reference's forward, under no_grad with the adapter off,
    runs the fused head's forward tiles over the same 2b sequences (eval_loss_bytes). Its layers' no_grad
    forward is one layer's at a time (components.eval_layer_bytes), planned beside it. With
    precompute_ref_log_probs it runs before training instead, an eval-sized pass."""
    k = _head(st, b, on_cpu)
    s = st.seq_len
    out, copy = _head_input(k, b, s)
    held = b * s * (4 * k.h + 4) + (copy or out) + 16 * k.n_pos
    return held + eval_loss_bytes(st, b, on_cpu)


def sampling_bytes(st: StackSpec, layers: int, with_head: bool, on_cpu: bool = False) -> int:
    """grpo's generation on one device computing `layers` decoder layers (and the LM head when
    `with_head`): TRL 1.16 samples a generation batch (micro-batch x grad_accum completions) with
    transformers generate under no_grad, the adapter on, outside autocast (the projections come out in
    the residual dtype, the KV cache too). The larger of two moments: the prefill, when every layer's
    KV cache holds the prompts (padded to the longest, trainer.seq_len positions) and one layer's
    forward runs over them; and the last decoding step, when it holds every position (prompt plus
    max_completion_length) and one layer's keys are grown by torch.cat (old and new alive at once).
    The last position's logits with their fp32 copy (sampling at the temperature) beside either."""
    batch = st.sample_rows
    if not batch or not (layers or with_head):
        return 0
    fig = st.fig
    _, r, _ = act_dtypes(st, on_cpu)
    position = 2 * fig.num_kv_heads * fig.head_dim * r * batch  # keys and values of one position, one layer
    prompt = st.seq_len - st.completion_len
    total = 0
    if layers:
        prefill = layers * position * prompt + eval_layer_bytes(st, batch, on_cpu, s=prompt, autocast=False)
        decode = layers * position * st.seq_len + position * st.seq_len // 2
        total = max(prefill, decode)
    if with_head:
        total += batch * fig.vocab_size * (r + 4)
    return total


def eval_loss_bytes(st: StackSpec, b: int, on_cpu: bool = False) -> int:
    """The loss of one evaluation batch (no grad): the backbone output, the head's input and the
    forward tiles."""
    k = _head(st, b, on_cpu)
    out, copy = _head_input(k, b, st.seq_len)
    return out + copy + VECTOR_BYTES * k.n_pos + _tile_bytes(k, backward=False)


def generation_bytes(st: StackSpec, layers: int, with_head: bool, on_cpu: bool = False) -> int:
    """The exact-match metric on one device that computes `layers` decoder layers (and the LM head
    when `with_head`). Its batches hold at most eval_batch x seq_len positions, prompts padded to
    the longest plus the new tokens (training passes that to generation.generate as
    max_batch_tokens), so whatever the prompt lengths: the KV cache of every layer for that many
    positions, in the residual dtype (no autocast: bitsandbytes linears return their input's
    dtype); the larger of the prefill - one layer's forward over at most as many tokens as an eval
    batch, with its padding mask - and one layer's keys being grown by torch.cat; the last
    position's logits and their fp32 copy for up to GEN_METRIC_BATCH prompts. A single prompt
    longer than that budget goes alone and is not bounded by it. No MoE router logits: generate would
    keep the prefill's of every layer where TRL turned them on for the load-balancing loss, but
    generation turns them off (outputs/generation.no_router_logits)."""
    batch = getattr(st, "gen_batch", 0)
    if not batch or not (layers or with_head):
        return 0
    fig, budget = st.fig, st.eval_batch * st.seq_len
    new = getattr(st, "gen_new_tokens", 0)
    _, r, _ = act_dtypes(st, on_cpu)
    kv_position = 2 * fig.num_kv_heads * fig.head_dim * r  # keys and values of one position, one layer
    total = 0
    if layers:
        prefill = eval_layer_bytes(st, st.eval_batch, on_cpu, autocast=False) + budget * st.seq_len
        total = layers * kv_position * budget + max(prefill, kv_position * budget // 2)
    if with_head:
        total += min(batch, max(1, budget // (new + 1))) * fig.vocab_size * (r + 4)
    return total
