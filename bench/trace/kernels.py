"""The kernels a GPU would run, where a fake CUDA tensor on a CPU build would take another path.

Fake tensors run each op's meta function: the shapes and dtypes of its outputs, no data. That is the
whole story for most ops, but a few choices a GPU makes are made in compiled CUDA code a CPU build
does not have, or allocate inside the kernel where a meta function shows nothing. Each is restated
here from its source, in the ops it runs, so the tracer sees the tensors the GPU allocates:

- SDPA backend (torch `_fused_sdp_choice` for CUDA, sdp_utils.cpp): with no mask and fp16/bf16
  inputs, head_dim <= 256, the flash kernel (`_scaled_dot_product_flash_attention`; K/V with fewer
  heads go in as they are, flash runs GQA natively); with a mask, memory-efficient attention after
  the composite's `convert_boolean_attn_mask` (a float copy of a boolean mask in the query's dtype)
  and `preprocess_mask` (aligned, expanded: a view). A CPU build has no CUDA backend choice and takes
  the math path, which keeps the full attention matrix. `gpu_dispatch()` registers the CUDA
  composite for the AutogradCUDA key with torch.library.
- Ops a CPU-only build has no CUDA kernel for, but a CPU kernel and a decomposition: the dispatcher
  would decompose them for CUDA tensors (silu_backward into five MLP-sized fp32 temporaries);
  `gpu_dispatch()` registers placeholder CUDA kernels so autograd keeps them whole, as a CUDA build.
- bitsandbytes `gemm_4bit` on CUDA (backends/cuda/ops.py): for more than 1536 rows it is the
  `_dequant_linear_fallback`, which dequantizes the nested absmax (an fp32 copy, then + offset) and
  the whole weight into a fresh tensor of the compute dtype, then F.linear; for fewer rows a fused
  kernel that allocates only its output. On the CPU it is always that (backends/default/ops.py,
  `_gemm_4bit_default_impl`). The fake kernel allocates only the output, and a kernel's own ops are
  below the tracker (a dispatch mode does not see what runs inside an op it handles), so the
  dequantize-then-linear path is replayed in ops above it (dequantizations tagged
  `dequant_scratch`), for fake and real tensors alike.
- Boolean-mask indexing (TRL's fused head scores `hidden_states[labels != -100]` on Triton devices):
  nonzero's output size is data, which a fake tensor has none of. The trace's labels are all valid
  (every position with a next token: the planner's own bound), so a boolean index selects every
  element: nonzero's int64 (N, ndim) indices and the gathered rows, as on the GPU. GRPO labels its
  completions alone, and registers their count for the mask's shape (`KNOWN_TRUE`).
- transformers' mask decisions read the batch (padding, packed sequences); on fake tensors it
  assumes the worst and builds an explicit mask. At micro-batch 1 the step passes no attention mask
  (step.py) and `known_sequences` answers the packed-sequence check from the batch the tracer made.
- TRL's activation offloading deduplicates saved tensors by their storage's address, which fake
  tensors do not have (all 0): the key uses the storage's identity instead (`trl_offload_keys`).
- TRL's Triton fold kernels (trl/kernels/chunked_logprob.py): they write into their arguments and
  allocate nothing; a GPU runs them where Triton is installed (`_use_triton`). The module's
  `_TRITON_AVAILABLE` and kernel handles are swapped for launchers that do nothing, for the trace.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Boolean masks whose true elements are fewer than all of them, by shape: the count (objectives.py:
# grpo's fused head scores the completions alone)
KNOWN_TRUE: dict[tuple[int, ...], int] = {}
# While set: the answer to a boolean tensor read as a Python bool (data a fake tensor has none of);
# objectives.py sets False while it samples (prompts padded, no right padding)
BOOL_READS: list[bool] = []
GEMM_4BIT_CUSTOM_MAX_M = 1536
DEQUANTIZE = (
    "bitsandbytes.dequantize_4bit",
    "bitsandbytes.dequantize_blockwise",
)  # bitsandbytes backends/cuda/ops.py _gemm_4bit_custom_max_m (CUDA)


def _sdpa_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """torch's scaled_dot_product_attention composite as a CUDA build runs it (attention.cpp, with
    the backend sdp_utils.cpp picks), for the AutogradCUDA key: under autocast the inputs arrive
    cast (the AutocastCUDA kernel runs first and excludes itself)."""
    half = query.dtype in (torch.float16, torch.bfloat16)
    d = query.shape[-1]
    if attn_mask is None and half and d <= 256 and d % 8 == 0 and ATTENTION["flash"]:
        ATTENTION["calls"]["flash"] = ATTENTION["calls"].get("flash", 0) + 1
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        ATTENTION["calls"]["math"] = ATTENTION["calls"].get("math", 0) + 1
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]
    ATTENTION["calls"]["efficient"] = ATTENTION["calls"].get("efficient", 0) + 1
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # convert_boolean_attn_mask
        bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(bias.logical_not(), float("-inf"))
    if bias is not None:  # preprocess_mask: pad_bias to a multiple of 8 if needed, then expand (a view)
        if bias.shape[-1] % 8:
            pad = 8 - bias.shape[-1] % 8
            bias = torch.nn.functional.pad(bias, (0, pad))[..., : bias.shape[-1]]
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    needs_lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    return aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, needs_lse, dropout_p, is_causal, scale=scale
    )[0]


ATTENTION: dict = {"flash": True, "calls": {}}
_LIBRARY = None
CUDA_PLACEHOLDERS: list[str] = []


def _never_called(*args, **kwargs):
    raise RuntimeError("a placeholder CUDA kernel ran: bench/trace registers them for fake tensors only")


def gpu_dispatch(flash: bool = True) -> dict:
    """The dispatch table of a CUDA build, for this process (idempotent); returns the SDPA call counts.

    1. The CUDA SDPA composite (`_sdpa_cuda`) for the AutogradCUDA key: it wins over the
       CompositeImplicitAutograd kernel for CUDA tensors only, and reaches every call (the backward's
       device thread and checkpoint recomputes included).
    2. A placeholder CUDA kernel for each aten op that has a CPU kernel and a CompositeImplicitAutograd
       one but, in a CPU-only build, no CUDA kernel (silu_backward, mish_backward, ...). Without a
       kernel for the backend, the dispatcher gives the backend's autograd slot to the op's
       decomposition, so a fake CUDA tensor would run `math_silu_backward` (five fp32 temporaries the
       size of the MLP) where a CUDA build runs its one kernel. With a CUDA kernel registered, autograd
       takes its derivative formula and the fake mode (the Python key, ahead of the backend) answers
       the op as one; the placeholder itself is never called."""
    global _LIBRARY
    ATTENTION["flash"] = flash
    if _LIBRARY is None:
        import warnings

        _LIBRARY = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _LIBRARY.impl("scaled_dot_product_attention", _sdpa_cuda, "AutogradCUDA")
            has = torch._C._dispatch_has_kernel_for_dispatch_key
            for name in torch._C._dispatch_get_all_op_names():
                if (
                    name.startswith("aten::")
                    and has(name, "CompositeImplicitAutograd")
                    and has(name, "CPU")
                    and not has(name, "CUDA")
                ):
                    _LIBRARY.impl(name.split("::", 1)[1], _never_called, "CUDA")
                    CUDA_PLACEHOLDERS.append(name)
    return ATTENTION["calls"]


class GpuKernels(TorchDispatchMode):
    """Ops whose CUDA kernel allocates what their fake kernel does not show, replayed in ops that do.
    Enter it after (above) the MemTracker so the replayed ops are counted. `tracker.tag` names the
    replay's tensors while it runs."""

    calls: dict[str, int] = {}  # of the traced step (the last GpuKernels entered)
    # flex attention (gpt-oss's sinks) is a higher-order op: passed on whole to the modes below, the
    # fake mode's rule gives its outputs (and its backward's)
    supports_higher_order_operators = True

    def __init__(self, tracker=None):
        super().__init__()
        self.tracker = tracker
        if tracker is not None:
            GpuKernels.calls = {}
            ATTENTION["calls"].clear()

    def _count(self, name: str) -> None:
        if self.tracker is not None:
            GpuKernels.calls[name] = GpuKernels.calls.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        name = str(packet) if packet is not None else ""
        if name == "bitsandbytes.gemm_4bit":
            a = args[0]
            if a.device.type == "cpu" or a.numel() // a.shape[-1] > GEMM_4BIT_CUSTOM_MAX_M:
                self._count("gemm_4bit dequant+linear")
                return self._dequant_linear(*args, **kwargs)
            self._count("gemm_4bit fused")
        if name in DEQUANTIZE and self.tracker is not None:
            return self._tagged(func, args, kwargs)
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._count("bool index")
            return self._bool_index(args[0], args[1])
        if func is aten._local_scalar_dense.default and BOOL_READS and args[0].dtype == torch.bool:
            self._count("bool read")
            return BOOL_READS[-1]
        if func is aten.bincount.default and isinstance(args[0], FakeTensor):
            # tokens per expert (model/moe_experts.routed_forward): every id is below minlength, the
            # number of experts, so that is the length a GPU returns; the counts are data
            self._count("bincount")
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.zeros(max(int(minlength), 1), dtype=torch.long, device=args[0].device)
        if func is aten.nonzero.default:
            self._count("nonzero")
            return torch.empty((_true_count(args[0]), args[0].dim()), dtype=torch.long, device=args[0].device)
        return func(*args, **kwargs)

    def _tagged(self, func, args, kwargs):
        """A dequantization wherever it runs (MatMul4Bit's backward calls it directly): its output is
        dequant_scratch."""
        tag, self.tracker.tag = self.tracker.tag, "dequant_scratch"
        try:
            return func(*args, **kwargs)
        finally:
            self.tracker.tag = tag

    def _dequant_linear(
        self,
        A,
        B,
        shapeB,
        absmax,
        blocksize,
        quant_type,
        bias=None,
        absmax_8bit=None,
        absmax_code=None,
        absmax_offset=None,
    ):
        tag = self.tracker.tag if self.tracker is not None else None
        if self.tracker is not None:
            self.tracker.tag = "dequant_scratch"
        try:
            if absmax_8bit is not None:
                absmax_dq = torch.ops.bitsandbytes.dequantize_blockwise(
                    absmax_8bit, absmax, absmax_code, 256, torch.float32
                )
                absmax = absmax_dq + absmax_offset
                del absmax_dq
            b_dq = torch.ops.bitsandbytes.dequantize_4bit(B, absmax, blocksize, quant_type, list(shapeB), A.dtype)
            del absmax
        finally:
            if self.tracker is not None:
                self.tracker.tag = tag
        return torch.nn.functional.linear(A, b_dq, bias)

    def _bool_index(self, x, indices):
        """x[mask] with an all-true mask: nonzero's indices, then the gather (as aten.index does)."""
        out_idx = []
        for i in indices:
            if i is not None and i.dtype == torch.bool:
                nz = torch.empty((_true_count(i), i.dim()), dtype=torch.long, device=i.device)
                out_idx += list(nz.unbind(1))
            else:
                out_idx.append(i)
        return aten.index.Tensor(x, out_idx)


def _true_count(mask: torch.Tensor) -> int:
    """The true elements of a boolean mask: all of them (the trace's labels are all valid) but where
    the step registered fewer for its shape (KNOWN_TRUE)."""
    return KNOWN_TRUE.get(tuple(mask.shape), mask.numel())


def _storage_key(tensor: torch.Tensor) -> tuple:
    """TRL's deduplication key of a saved tensor, (address + offset, dtype), with the storage's
    identity standing in for its address: a fake tensor has none (data_ptr() is 0 for all of them,
    so every saved tensor would look like the first and stay on the GPU)."""
    actual = getattr(tensor, "_local_tensor", tensor)
    return (id(actual.untyped_storage()), actual.storage_offset(), actual.dtype)


@contextlib.contextmanager
def trl_offload_keys():
    """TRL's activation offloading (trl/models/activation_offloading.py) on fake tensors: its
    storage keys by identity (`_storage_key`)."""
    from trl.models import activation_offloading as ao

    saved = ao._get_unique_tensor_key
    ao._get_unique_tensor_key = _storage_key
    try:
        yield
    finally:
        ao._get_unique_tensor_key = saved


@contextlib.contextmanager
def known_sequences(one_per_row: bool):
    """transformers' packed-sequence check (masking_utils.find_packed_sequence_indices) answered from
    the tracer's own batch. It reads position_ids to find several sequences in a row and, on a fake
    tensor, cannot, so it reports packing and an explicit mask gets built; a real batch with one
    sequence per row (every micro-batch but padding-free ones of several rows) gets None, and SDPA
    runs causal without a mask. With `one_per_row` the check returns that None."""
    from transformers import masking_utils

    saved = masking_utils.find_packed_sequence_indices
    if one_per_row:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


@contextlib.contextmanager
def flex_uncompiled():
    """Flex attention (gpt-oss's recipe) without torch.compile: dynamo refuses to compile under the
    tracer's dispatch modes, and the compiled kernel's tensors are its op's outputs, which the
    uncompiled op gives as well (out and log-sum-exp forward, the q/k/v gradients backward, by the
    fake mode's rules). transformers' compiled wrapper is skipped and its block mask built in bands
    (banded_block_mask), as the compiled builder holds no dense mask either."""
    from torch.nn.attention import flex_attention as torch_flex
    from transformers import masking_utils
    from transformers.integrations import flex_attention as hf_flex

    saved = (torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, hf_flex.WrappedFlexAttention.__call__)
    saved_mask = masking_utils.create_block_mask
    torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    hf_flex.WrappedFlexAttention.__call__ = lambda self: torch_flex.flex_attention
    masking_utils.create_block_mask = banded_block_mask
    try:
        yield
    finally:
        torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, hf_flex.WrappedFlexAttention.__call__ = saved
        masking_utils.create_block_mask = saved_mask


def banded_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False, band=1 << 27):
    """create_block_mask uncompiled, a band of query blocks at a time: the eager builder would hold the
    dense Q x KV mask (three seq^2 bool tensors: 48 GiB at 131k tokens), the compiled one transformers
    runs on a GPU never does. The same BlockMask, each band's dense mask at most `band` elements."""
    from torch.nn.attention import flex_attention as flex

    B, H = B or 1, H or 1
    q_block, kv_block = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    rows = q_block * max(1, band // (B * H * KV_LEN * q_block))
    partial, full = [], []
    for start in range(0, Q_LEN, rows):
        dense = flex.create_mask(_shifted(mask_mod, start), B, H, min(rows, Q_LEN - start), KV_LEN, device)
        blocks = flex._convert_mask_to_block_mask(dense, q_block, kv_block, separate_full_blocks=True)
        partial.append(blocks[0])
        full.append(blocks[1])
        del dense
    blocks = (torch.cat(partial, dim=2), torch.cat(full, dim=2))
    return flex._create_sparse_block_from_block_mask(blocks, mask_mod, (Q_LEN, KV_LEN), q_block, kv_block)


def _shifted(mask_mod, start: int):
    """mask_mod of the query rows from `start` on (four arguments: flex tells mask_mod by its arity)."""

    def shifted(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx + start, kv_idx)

    return shifted


class _NoLaunch:
    """A Triton kernel handle whose launches do nothing (the kernel writes into its arguments)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def trl_triton_folds():
    """TRL's fused head as a GPU with Triton runs it: the compact path and the Triton folds."""
    from trl.kernels import chunked_logprob as cl

    saved = {k: getattr(cl, k, None) for k in ("_TRITON_AVAILABLE", "_forward_kernel", "_backward_kernel", "triton")}
    cl._TRITON_AVAILABLE = True
    cl._forward_kernel = _NoLaunch()
    cl._backward_kernel = _NoLaunch()
    cl.triton = SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None and hasattr(cl, k) and k == "triton":
                delattr(cl, k)
            else:
                setattr(cl, k, v)
