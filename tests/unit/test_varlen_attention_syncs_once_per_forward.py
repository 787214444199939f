"""sdpa_varlen reads where a packed row's sequences start once per forward, not once per layer: a
host read of a device tensor (`.tolist()`, `nonzero`) is a device->host sync on a GPU, so the count
of syncs in a training step (forward and backward, with and without checkpointing) must not grow
with the layers. Nor does its backward grow a whole-row tensor per packed sequence (a slice's
backward would). Counted on a CPU by the per-step counter of `python -m bench syncs`."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.trace.syncs import HOST_READS, _host_read, counting_mode
from qlora_recipes.config.attention import VARLEN
from qlora_recipes.model.packed_attention import register

LENS = [7, 12, 5]  # three sequences packed in one flat row


def _count_a_step(layers: int, source: str, checkpointing: bool, lens=LENS):
    register()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=VARLEN,
    )  # fmt: skip
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(3, 64, (1, sum(lens)))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(n) for n in lens])[None]}
    if source == "cu_seq_lens":  # TRL's padding-free collator hands these on as well
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
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
    return mode


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens"])
def test_a_packed_step_syncs_as_often_with_six_layers_as_with_one(source, checkpointing):
    one, six = (sum(_count_a_step(n, source, checkpointing).syncs.values()) for n in (1, 6))
    assert one > 0  # the bounds are read once (from the device) per forward
    assert six == one, f"{six} syncs with 6 layers, {one} with 1"


def test_the_backward_of_a_packed_row_costs_the_same_kernels_for_three_sequences_as_for_six():
    three, six = (_count_a_step(2, "cu_seq_lens", False, lens).kernels for lens in ([8, 8, 8], [4, 4, 4, 4, 4, 4]))
    grown = {op: (three[op], six[op]) for op in set(three) | set(six) if "backward" in op and six[op] > three[op]}
    assert set(grown) <= {"aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}, grown
