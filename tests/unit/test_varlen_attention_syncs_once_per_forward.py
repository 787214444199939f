"""sdpa_varlen reads where a packed row's sequences start once per forward, not once per layer: a
host read of a device tensor (`.tolist()`, `nonzero`) is a device->host sync on a GPU, so the count
of syncs in a training step (forward and backward, with and without checkpointing) must not grow
with the layers. Counted on a CPU by the per-step counter of `python -m bench syncs`."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.trace.syncs import HOST_READS, _host_read, counting_mode
from qlora_recipes.config.attention import VARLEN
from qlora_recipes.model.packed_attention import register

LENS = [7, 12, 5]  # three sequences packed in one flat row


def _syncs_of_a_step(layers: int, source: str, checkpointing: bool) -> int:
    register()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=VARLEN,
    )  # fmt: skip
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(3, 64, (1, sum(LENS)))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(n) for n in LENS])[None]}
    if source == "cu_seq_lens":  # TRL's padding-free collator hands these on as well
        cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENS), max_length_k=max(LENS))
    mode = counting_mode()
    originals = {m: getattr(torch.Tensor, m) for m in HOST_READS}
    try:
        for m in HOST_READS:
            setattr(torch.Tensor, m, _host_read(originals[m], f"Tensor.{m}", mode))
        with mode:
            mode.active = True
            model(**batch, use_cache=False).loss.backward()
            mode.active = False
    finally:
        for m, original in originals.items():
            setattr(torch.Tensor, m, original)
    return sum(mode.syncs.values())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens"])
def test_a_packed_step_syncs_as_often_with_six_layers_as_with_one(source, checkpointing):
    one, six = (_syncs_of_a_step(n, source, checkpointing) for n in (1, 6))
    assert one > 0  # the bounds are read once (from the device) per forward
    assert six == one, f"{six} syncs with 6 layers, {one} with 1"
