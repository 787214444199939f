"""What a layer's LoRA adapters keep of their inputs for backward: lora_A's matmul saves the tensor it
multiplies, the c-byte input (+ the dropout mask) of each adapted linear, unless that tensor is one
several of them read.

q, k and v read one normed hidden state, gate and up another (Qwen3.5's DeltaNet input projections
too). With peft's dropout at 0 (nn.Identity) each adapter passes that tensor on as it is, unless a
cast makes a copy of it: peft's own cast to the adapters' dtype (`_cast_input_dtype`: plain linears
always, bitsandbytes ones when CUDA autocast is off, so on a CPU), then autocast's to the compute
dtype (its cast cache keeps weights only). Adapters that copy keep one copy each; the others keep the
one tensor, once. o_proj reads the attention's output, which SDPA, flash and flex attention keep for
their backward: where that output is laid out (batch, seq, heads, dim), transformers' transpose to it
copies nothing and o_proj's adapter adds nothing (output_kept). With dropout every adapter keeps its own
dropped copy and mask.
tests/unit/test_lora_inputs_shared_by_adapters_are_kept_once.py holds this to what autograd keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..units import dtype_bytes
from .spec import StackSpec

# sibling linears that read one tensor, by their module names in transformers' layers
_READ_TOGETHER = (
    frozenset({"q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}),
)
_ATTENTION_OUTPUT = "attention output"


@dataclass(frozen=True)
class LoraRead:
    """An adapted linear's input: its width, the tensor it reads (`source`), whether it is in the MLP
    and whether bitsandbytes quantized it (peft's plain linears cast their input even under autocast)."""

    in_features: int
    source: str
    in_mlp: bool
    quantized: bool


def source_of(name: str) -> str:
    """The tensor a linear reads: one name for siblings that read the same one, else its own name.
    mllama's cross-attention q reads the text, its k and v the image features; Qwen's shared-expert
    gate reads what the shared expert's gate and up read."""
    parent, _, leaf = name.rpartition(".")
    if leaf == "shared_expert_gate":
        return f"{parent}.shared_expert:1"
    if leaf == "o_proj" and not parent.endswith("cross_attn"):
        return f"{parent}:{_ATTENTION_OUTPUT}"
    if leaf == "q_proj" and parent.endswith("cross_attn"):
        return name
    for i, group in enumerate(_READ_TOGETHER):
        if leaf in group:
            return f"{parent}:{i}"
    return name


def output_kept(st: StackSpec, eager: bool, on_cpu: bool) -> bool:
    """Whether the attention kernel keeps, as o_proj reads it, the output o_proj reads: not eager's (its
    matmul keeps none), a gated output (Qwen3.5's: o_proj reads the product) nor one that attention sinks
    renormalise into a copy (gpt-oss's). The CPU kernel writes (batch, seq, heads, dim); a CUDA one as q
    is laid out, which rotate_half's RoPE leaves so where the whole head rotates (a partial rotation's
    cat writes q afresh)."""
    traits = st.fig.traits
    if eager or traits.attn_output_gate or traits.attention_sinks:
        return False
    return on_cpu or st.fig.rotary_fraction == 1.0


def kept_per_token(
    st: StackSpec, reads: list[LoraRead], mask: int, on_cpu: bool, in_mlp: bool, output_kept: bool = False
) -> int:
    """Bytes per token the adapted linears (the MLP's or the rest's) keep of their inputs: (c + mask) x
    width per adapter with dropout; without, one c x width per tensor read, plus a copy per adapter
    that casts it. output_kept: the attention kernel keeps the output o_proj reads (SDPA, flash)."""
    c = st.act_bytes
    chosen = [x for x in reads if x.in_mlp == in_mlp]
    if st.lora_dropout > 0:
        return (c + mask) * sum(x.in_features for x in chosen)
    total, shared = 0, set()
    for x in chosen:
        if _copies(st, x, on_cpu):
            total += c * x.in_features
        elif x.source not in shared:
            shared.add(x.source)
            in_kernel = output_kept and x.source.endswith(_ATTENTION_OUTPUT)
            total += 0 if in_kernel else c * x.in_features
    return total


def _copies(st: StackSpec, x: LoraRead, on_cpu: bool) -> bool:
    """Whether the adapter's input reaches lora_A's matmul as a copy of the tensor it reads: o_proj's
    comes in the compute dtype (the attention's output), the others in the residual stream's."""
    autocast = dtype_bytes(st.dtype) < 4
    compute = st.dtype if autocast else "float32"
    arrives = compute if x.source.endswith(_ATTENTION_OUTPUT) else _residual_dtype(st)
    adapters = "bfloat16" if st.adapter_bytes == 2 else "float32"
    peft_casts = on_cpu or not x.quantized or not autocast
    dtype = adapters if peft_casts else arrives
    return dtype != arrives or (autocast and dtype != compute)


def _residual_dtype(st: StackSpec) -> str:
    """The residual stream's dtype: fp32 where k-bit prep upcasts the norms (StackSpec.frozen_bytes)."""
    return "float32" if st.frozen_bytes == 4 else st.dtype
