"""Token efficiency of a run: the real tokens of its training micro-batches over the tokens computed.

A padded micro-batch computes every slot of its [rows, longest] tensors, pads included; a packed
padding-free one computes only real tokens. The count wraps the collator of the training dataloader only
(evaluation batches are not training compute), as the trainer builds it: TRL's collators, padded or
padding-free, for every objective. Counted on the host from the collated batch, so no device sync.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class TokenCount:
    """A collator that counts what it collates: real tokens (attention-mask ones, or for a padding-free
    row its sequences' tokens) and computed tokens (every slot of each *input_ids tensor)."""

    def __init__(self, collator):
        self.collator = collator
        self.real = 0
        self.computed = 0

    def __call__(self, examples: list[dict[str, Any]]):
        batch = self.collator(examples)
        real, computed = batch_tokens(batch)
        self.real += real
        self.computed += computed
        return batch

    def efficiency(self) -> float | None:
        return self.real / self.computed if self.computed else None


def batch_tokens(batch) -> tuple[int, int]:
    """(real, computed) tokens of one collated batch: each `*input_ids` tensor and its `*attention_mask`
    (a padding-free batch has none: its cu_seq_lens end at its real tokens)."""
    real = computed = 0
    if not isinstance(batch, Mapping):  # GRPO's collator hands the rows on as they are: tokenized later
        return 0, 0
    for key, ids in batch.items():
        if not key.endswith("input_ids") or not hasattr(ids, "numel"):
            continue
        computed += ids.numel()
        mask = batch.get(key[: -len("input_ids")] + "attention_mask")
        if mask is not None:
            real += int(mask.sum())
        elif batch.get("cu_seq_lens_q") is not None and key == "input_ids":
            real += int(batch["cu_seq_lens_q"][-1])
        else:
            real += ids.numel()
    return real, computed


def count_train_tokens(trainer) -> TokenCount:
    """Count the tokens of `trainer`'s training dataloader from now on (one TokenCount per trainer)."""
    build = trainer.get_train_dataloader
    count = TokenCount(trainer.data_collator)

    def train_dataloader(*args, **kwargs):
        collator = trainer.data_collator
        trainer.data_collator = count  # the dataloader keeps the collator it is built with
        try:
            return build(*args, **kwargs)
        finally:
            trainer.data_collator = collator

    trainer.get_train_dataloader = train_dataloader
    return count


def efficiency_figures(count: TokenCount | None) -> dict:
    """metrics.json's token figures: real / computed tokens of the training micro-batches."""
    if count is None or not count.computed:
        return {"token_efficiency": None}
    return {"token_efficiency": count.efficiency(), "tokens_real": count.real, "tokens_computed": count.computed}
