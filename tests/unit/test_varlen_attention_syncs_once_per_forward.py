"""sdpa_varlen reads where a packed row's sequences start once per forward, not once per layer: a
host read of a device tensor (`.tolist()`, `nonzero`) is a device->host sync on a GPU, so the count
of syncs in a training step (forward and backward, with and without checkpointing) must not grow
with the layers. Nor does its backward grow a whole-row tensor per packed sequence (a slice's
backward would), nor autocast's casts of q/k/v (and of their gradients) grow with the sequences.
Counted on a CPU by the per-step counter of `python -m bench syncs`."""

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from bench.trace.syncs import HOST_READS, _host_read, counting_mode
from qlora_recipes.config.attention import VARLEN
from qlora_recipes.model.packed_attention import register, varlen_attention_forward

LENS = [7, 12, 5]  # three sequences packed in one flat row


def _count_a_step(layers: int, source: str, checkpointing: bool, lens=LENS, autocast: bool = False):
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
        with mode, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
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


def test_under_bf16_autocast_a_packed_row_casts_as_often_for_six_sequences_as_for_three():
    three, six = (
        _count_a_step(2, "cu_seq_lens", False, lens, autocast=True).kernels["aten._to_copy.default"]
        for lens in ([8, 8, 8], [4, 4, 4, 4, 4, 4])
    )
    assert three > 0  # the fp32 model's linears and SDPA run in bf16
    assert six == three, f"{six} casts for six sequences, {three} for three"


def test_under_bf16_autocast_the_packed_attention_and_its_gradients_equal_each_sequence_autocast_alone():
    """The row cast once gives bit for bit what SDPA under autocast gives each sequence cast on its own."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, sum(LENS), 16, requires_grad=True) for h in (4, 2, 2))
    bounds = [0, *torch.tensor(LENS).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32)
    with torch.autocast("cpu", torch.bfloat16):
        out, _ = varlen_attention_forward(SimpleNamespace(training=True), q, k, v, None, cu_seq_lens_q=cu)
        parts = [
            F.scaled_dot_product_attention(*(t[:, :, s:e] for t in (q, k, v)), is_causal=True, enable_gqa=True)
            for s, e in pairwise(bounds)
        ]
        ref = torch.cat(parts, dim=2).transpose(1, 2)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    grad = torch.randn_like(out, dtype=torch.float32)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize(("lens", "cats"), [([24], 0), ([8, 8, 8], 3)], ids=["one-sequence", "three-sequences"])
def test_the_backward_of_one_flat_row_cats_only_its_sequences_gradients(lens, cats):
    """One cat per q/k/v where a row holds several sequences; none for the batch's one row or one sequence."""
    q, k, v = (torch.randn(1, h, sum(lens), 16, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = varlen_attention_forward(SimpleNamespace(training=True), q, k, v, None, cu_seq_lens_q=cu)
    mode = counting_mode()
    with mode:
        mode.active = True
        out.sum().backward()
    assert mode.kernels["aten.cat.default"] == cats, dict(mode.kernels)
