"""model.attn_implementation=auto: the attention a stack runs, picked once when the config is typed.

A padding-free micro-batch (data.padding_free, or packing with a best-fit strategy: schema.padding_free_on)
is one flat row whose sequences restart their position_ids. transformers 5.23 keeps them apart per backend:
sdpa and eager build a dense [n, n] block-diagonal mask over the row (masking_utils.sdpa_mask, fed by
find_packed_sequence_indices), which costs n^2 memory and computes every masked pair; flash kernels read
the collator's cu_seq_lens (no mask); flex_attention builds a block mask but has no backward on a CPU
(torch 2.13: "FlexAttention does not support backward on CPU"). So auto picks, for padding-free batches,
flash_attention_2 where flash-attn is installed beside a CUDA GPU, else sdpa_varlen (model/packed_attention.py:
SDPA per sequence from cu_seq_lens, no mask, on any device); plain sdpa otherwise. Torch-free (the
planner's one-device path imports this): flash-attn is looked for, torch only imported when it is there.
"""

from __future__ import annotations

import importlib.util

from ..families import traits

AUTO = "auto"
VARLEN = "sdpa_varlen"  # model/packed_attention.py registers it with transformers
# families whose attention sdpa_varlen cannot apply: soft-capped logits and sinks (no sdpa path at all),
# chunked local attention (Llama 4: chunks of the flat row that the varlen path does not cut)
VARLEN_BLOCKERS = {
    "attn_logit_softcap": "soft-caps its attention logits",
    "attention_sinks": "has attention sinks",
}


def varlen_blocker(architecture: str) -> str | None:
    """Why sdpa_varlen cannot run `architecture`'s attention (None: it can)."""
    t = traits(architecture)
    for trait, why in VARLEN_BLOCKERS.items():
        if getattr(t, trait):
            return why
    if t.local_attention == "chunked":
        return "attends within fixed chunks"
    return None


def unmasked_packing(attn: str) -> bool:
    """Whether `attn` keeps packed sequences apart without a dense mask (cu_seq_lens instead)."""
    return "flash" in attn or attn == VARLEN


def flash_installed() -> bool:
    """flash-attn importable and a CUDA GPU here (torch is imported only once flash-attn is found)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pick_for(architecture: str, padding_free: bool) -> str:
    """What model.attn_implementation=auto runs for a family, padding-free (schema.padding_free_on) or not."""
    if not padding_free:
        return "sdpa"  # the loader turns it into eager for a family without an sdpa path
    if flash_installed():
        return "flash_attention_2"
    return "sdpa" if varlen_blocker(architecture) else VARLEN


# The schema's default: `${auto_attention:...}` resolves with the rest of the composed config, so the
# config.yaml a run writes and the config Hydra composed say the same; `auto` typed on the command line
# is picked when the config is typed (config/loader.to_typed), after a model dir's family is known. The
# resolver (loader.auto_attention) lives beside the schema it reads.
DEFAULT = "${auto_attention:${model.architecture},${data.packing},${data.packing_strategy},${data.padding_free}}"


def why_picked(attn: str) -> str:
    """The words of the one line the loader logs about a padding-free run's attention."""
    if attn == VARLEN:
        return "SDPA per packed sequence from the collator's cu_seq_lens, no [n, n] mask"
    if "flash" in attn:
        return "flash-attention over the collator's cu_seq_lens, no [n, n] mask"
    return "a dense [n, n] block-diagonal mask over each flat micro-batch (transformers' position_ids masking)"
