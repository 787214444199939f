"""sdpa_varlen: packed (padding-free) sequences through torch's SDPA one sequence at a time, no dense mask.

transformers' sdpa path masks the sequences of a padding-free row apart with a dense [n, n] block-diagonal
mask (masking_utils.sdpa_mask), so every attention computes all n^2 pairs of the flat row and SDPA drops to
a masked kernel. Here the mask interface returns no mask for such a row and the attention cuts the row at
the collator's cu_seq_lens (TRL's DataCollatorForLanguageModeling, padding_free), else where position_ids
restart: each sequence gets causal SDPA of its own (native GQA, flash/efficient kernels on a GPU), and
the work is the sum of the sequences' squares. A padded batch, a cache (generation) or a 2-D padding mask
go through transformers' own sdpa unchanged. A sliding-window layer gets the window inside each sequence.
"""

from __future__ import annotations

import weakref
from itertools import pairwise

from ..config.attention import VARLEN

_registered = False
_last = None  # (weakref to the tensor read, (n, batch, its version), the bounds read from it)


def register() -> None:
    """Make `sdpa_varlen` an attn_implementation transformers can load (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, varlen_mask)
    _registered = True


def varlen_mask(*args, attention_mask=None, q_length=None, kv_length=None, **kwargs):
    """No mask for a row without padding whose queries see exactly its keys (training, packed or not):
    the attention applies causality, the sequences' bounds and any window itself. Anything else
    (padding, a cache) gets sdpa's mask."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and not kwargs.get("q_offset") and not kwargs.get("kv_offset"):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, **kwargs)


def sequence_bounds(n: int, batch: int, cu_seq_lens=None, position_ids=None) -> list[list[int]]:
    """Per row of the batch, the offsets where its sequences start, and n at the end: TRL's cu_seq_lens
    for its one flat row, else the restarts of position_ids, else the whole row. Reading them is a host
    sync, so a forward reads them once: every layer is handed the same tensor, and the bounds read from
    it are kept while it lives unchanged (checkpointing's recomputation hits them too). A packed forward
    makes one more, before any layer, that is transformers' own: create_causal_mask looks for packed rows
    in position_ids (masking_utils.find_packed_sequence_indices, an `.all()`) for every attention that
    registers a mask function, as this one does for padded batches and generation; a padded batch pays
    one or two there instead (sdpa_mask's checks of its padding mask)."""
    global _last
    source = cu_seq_lens if cu_seq_lens is not None and batch == 1 else position_ids
    if source is None:
        return [[0, n]] * batch
    key = None if source.is_inference() else (n, batch, source._version)  # inference tensors keep no version
    if key is not None and _last is not None and _last[0]() is source and _last[1] == key:
        return _last[2]
    bounds = _read_bounds(n, batch, source) if source is position_ids else [[int(x) for x in source.tolist()]]
    if key is not None:
        _last = (weakref.ref(source), key, bounds)
    return bounds


def _read_bounds(n: int, batch: int, position_ids) -> list[list[int]]:
    """Where position_ids restart, every row in one read."""
    pos = position_ids.expand(batch, -1)
    rows: list[list[int]] = [[0] for _ in range(batch)]
    for b, j in (pos[:, 1:] != pos[:, :-1] + 1).nonzero().tolist():
        rows[b].append(j + 1)
    return [[*row, n] for row in rows]


def _window_mask(length: int, window: int, device):
    """Causal within `window` keys (transformers' sliding_window_overlay: kv > q - window)."""
    import torch

    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


def varlen_attention_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, sliding_window=None, **kwargs
):
    """transformers' attention interface: query [b, h, n, d], key/value [b, kv_h, n, d] -> ([b, n, h, d], None)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n = query.shape[2]
    if attention_mask is not None or key.shape[2] != n or n == 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    drop = dropout if module.training else 0.0
    bounds = sequence_bounds(n, query.shape[0], kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"))
    query, key, value = _as_autocast_casts(query, key, value)
    rows = []
    # split, not slices: a split's backward is one cat of its parts' gradients, where every slice's
    # would be a zero tensor the size of the whole row, added up; and no split of one part (its
    # backward would still copy the gradient through a cat)
    for row_bounds, qkv in zip(bounds, _parts((query, key, value), [1] * len(bounds), 0), strict=True):
        lengths = [end - start for start, end in pairwise(row_bounds)]
        outs = [_sequence(q, k, v, drop, scaling, sliding_window) for q, k, v in _parts(qkv, lengths, 2)]
        rows.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return out.transpose(1, 2).contiguous(), None


def _parts(tensors, sizes: list[int], dim: int):
    """Each of `tensors` split into `sizes` along `dim`, grouped by part: [(a0, b0, ..), (a1, b1, ..), ..]."""
    if len(sizes) == 1:
        return [tuple(tensors)]
    return list(zip(*(t.split(sizes, dim=dim) for t in tensors), strict=True))


def _as_autocast_casts(*tensors):
    """The tensors as autocast would hand them to SDPA (one of its lower-precision ops): cast here once for
    the whole row, else autocast casts every sequence's part on its own, and the backward casts every
    part's gradient back (two kernels per sequence, per layer). The values are the same either way."""
    import torch

    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    # autocast leaves float64 and non-float tensors alone
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def _sequence(q, k, v, dropout: float, scaling, sliding_window):
    """Causal SDPA over one packed sequence (native GQA; a window inside it when it is longer)."""
    import torch.nn.functional as F

    length = q.shape[2]
    windowed = sliding_window is not None and length > sliding_window
    mask = _window_mask(length, sliding_window, q.device) if windowed else None
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, enable_gqa=gqa
    )
