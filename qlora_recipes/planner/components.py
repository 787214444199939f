"""Bytes per component of a QLoRA stack, per model block and per micro-batch: quantized weights
and their quantization state, the other parameters, buffers, adapter weights (fp32), optimizer
state, and the activations, backward working set, evaluation and dequantization temporaries of
one step (the loss, through TRL's fused LM head, and the generation metric: loss.py). Pure arithmetic on a `StackSpec`; each figure is what the real objects
hold (bitsandbytes `Params4bit`/`Int8Params`, peft adapters, torch/bitsandbytes optimizers, the
tensors autograd saves), and tests/unit/test_memory_planner.py checks them against those objects on CPU.
The MoE experts' terms are moe.py's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..config.attention import unmasked_packing
from ..errors import UserError
from ..families import V4_EXPERT_NAMES
from ..units import dtype_bytes
from . import family_layers, linear_attention, lora_inputs, moe, tiled_moe
from .blocks import OUTPUT_HEAD
from .constants import (
    BNB_4BIT_BLOCKSIZE,
    BNB_4BIT_CODE_ELEMENTS,
    BNB_DQ_BLOCKSIZE,
    BNB_DYNAMIC_CODE_ELEMENTS,
    BNB_MIN_8BIT_SIZE,
    BNB_OPTIM_BLOCKSIZE,
    BNB_PAGED_MIN_ELEMENTS,
    OPTIMIZERS,
    TRL_OFFLOAD_MIN_BYTES,
)
from .figures import Block, inventory
from .lora_inputs import LoraRead, source_of
from .spec import StackSpec


def should_convert(full_name: str, patterns: Iterable[str] | None) -> bool:
    """transformers.quantizers.quantizers_utils.should_convert_module (5.x), same three rules."""
    if patterns is None:
        return True
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", full_name) or full_name.endswith(key) for key in patterns)


def skip_patterns(st: StackSpec, blocks: tuple[Block, ...]) -> list[str]:
    """What stays unquantized: the output embeddings (and what is tied to them), as transformers
    keeps them, plus the user's quant.skip_modules (stack.skip_modules adds to that default)."""
    skip = [OUTPUT_HEAD, *st.skip_modules]
    for b in blocks:
        if b.tied_to:
            skip += [b.name, b.tied_to]
    return skip


def quantized_linear_bytes(
    numel: int, out_features: int, method: str, double_quant: bool, storage_bytes: int = 1
) -> tuple[int, int]:
    """(bytes of the weight tensor, bytes of its quantization state) for one bitsandbytes linear:
    exactly what `Params4bit`/`Int8Params` hold (tests/unit/test_memory_planner.py checks it).

    NF4/FP4: the packed data ((n+1)//2 bytes) plus its QuantState: fp32 absmax per 64-block, or
    with double quantization a uint8 absmax per block + fp32 absmax per 256 of those + the fp32
    offset + the 256-entry fp32 code of the second level; + the 16-entry fp32 code. With double
    quantization that is 0.5159 B/param, 0.5625 without (QLoRA paper, section 3: 0.127 bits/param
    of overhead with DQ). int8: n bytes + fp32 SCB per output row.
    """
    if method in ("nf4", "fp4"):
        mod = storage_bytes * 2
        data = ((numel + 1) // mod) * storage_bytes
        blocks = -(-numel // BNB_4BIT_BLOCKSIZE)
        code = BNB_4BIT_CODE_ELEMENTS * 4
        if double_quant:
            # uint8 absmax, fp32 absmax of the absmax per 256, fp32 offset, fp32 code of the 2nd level
            state = blocks + 4 * -(-blocks // BNB_DQ_BLOCKSIZE) + 4 + 4 * BNB_DYNAMIC_CODE_ELEMENTS + code
        else:
            state = 4 * blocks + code
        return data, state
    if method == "int8":
        return numel, 4 * out_features  # int8 weight + fp32 SCB per output row
    raise ValueError(method)


def _lora_targets(st: StackSpec, blocks: tuple[Block, ...]) -> tuple[set[str], set[str]]:
    """(targeted linear names, targeted embedding names), following peft's matching rules."""
    linear_names = [lin.name for b in blocks for lin in b.linears]
    embed_names = [e[0] for b in blocks for e in b.embeddings]
    tm = st.target_modules
    if isinstance(tm, str) and tm == "all-linear":
        # peft: every linear except the output layer (lm_head); beside fused experts, not the names peft
        # maps onto them (moe_experts.linear_targets spells the list out so)
        skip = V4_EXPERT_NAMES if any(b.experts for b in blocks) else frozenset()
        return {n for n in linear_names if n != OUTPUT_HEAD and n.rsplit(".", 1)[-1] not in skip}, set()

    def match(name: str) -> bool:
        if isinstance(tm, str):
            return re.fullmatch(tm, name) is not None
        return any(name == t or name.endswith("." + t) for t in tm)

    lin, emb = {n for n in linear_names if match(n)}, {n for n in embed_names if match(n)}
    if not lin and not emb:
        raise UserError(
            f"peft.target_modules={tm!r} matches no module of {st.fig.architecture} "
            "(names like q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj); fix the list or use all-linear"
        )
    return lin, emb


@dataclass
class BlockBytes:
    """Static bytes and element counts of one block.

    quant_data/quant_state: its bitsandbytes Linear4bit / Linear8bitLt weights (quantized_linear_bytes).
    other: embeddings, norms, biases, lm_head and any linear left unquantized, at the dtype they have
    after `prepare_model_for_kbit_training` (it casts fp16/bf16 params that are not Params4bit to
    fp32; peft/utils/other.py); without quantization, or with precision.upcast_frozen=false, they
    keep the precision dtype (StackSpec.frozen_bytes).
    buffers: rotary inv_freq tables and the like (counted by `get_memory_footprint`).
    lora_tensors: r*(in+out) per targeted linear (+ out for DoRA's magnitude), kept in fp32 (peft
    upcasts adapters: autocast_adapter_dtype=True); r*(V+h) per targeted embedding; modules_to_save
    copies.
    """

    quant_data: int = 0
    quant_state: int = 0
    other: int = 0  # after prepare_model_for_kbit_training
    other_at_load: int = 0
    buffers: int = 0
    params_total: int = 0
    params_quantized: int = 0
    lora_numel: int = 0
    lora_tensors: list = field(default_factory=list)  # shapes of trainable tensors
    max_dequant: int = 0  # elements of the largest quantized weight
    max_dora: int = 0  # bytes of DoRA's weight-norm temporaries for the largest adapted linear
    lora_in: int = 0  # sum of in_features of adapted linears (dropout copies)
    mlp_lora_in: int = 0  # of which the MLP's (gate/up/down): what trainer.tiled_mlp runs per tile
    lora_reads: list = field(default_factory=list)  # each adapted linear's input (lora_inputs.LoraRead)
    expert_lora_in: int = 0  # sum of in_features of LoRA-adapted expert weights (per routed row)
    dora_out: int = 0  # sum of out_features of DoRA-adapted linears
    dora_in: int = 0  # sum of in_features of DoRA-adapted linears
    dora_weight: int = 0  # sum of out*in of DoRA-adapted linears
    mlp_dora_out: int = 0  # of which the MLP's
    mlp_dora_in: int = 0
    placed_bytes: int = 0  # what the loader counts when placing (quantized at 0.5/1 byte/elem)
    max_cast: int = 0  # load bytes of its largest tensor that k-bit prep upcasts (0: none is)
    mixer: str = ""  # a decoder layer's token mixer (Block.mixer): "linear_attention" is a Gated DeltaNet
    head_dim: int = 0  # its attention's head_dim and kv heads (0: the model's)
    kv_heads: int = 0
    head_norms: int = 0  # bytes a token its per-head q/k norms keep for backward (family_layers)


def block_bytes(st: StackSpec) -> list[tuple[Block, BlockBytes]]:
    """Every block of the model with its static bytes under this stack."""
    blocks = inventory(st.fig)
    load = dtype_bytes(st.dtype)
    # prepare_model_for_kbit_training upcasts fp16/bf16 non-quantized params to fp32 (quantized
    # models, unless precision.upcast_frozen=false)
    after = st.frozen_bytes
    patterns = skip_patterns(st, blocks)
    lora_lin, lora_emb = _lora_targets(st, blocks)
    mts = st.modules_to_save
    out = []
    for blk in blocks:
        bb = BlockBytes(mixer=blk.mixer, head_dim=blk.head_dim, kv_heads=blk.kv_heads)
        for lin in blk.linears:
            n = lin.numel
            bb.params_total += n + (lin.out_features if lin.bias else 0)
            quantized = st.quantized and should_convert(lin.name, patterns)
            _add_weight(st, bb, n, lin.out_features, quantized)
            if lin.bias:
                bb.other += lin.out_features * after
                bb.other_at_load += lin.out_features * load
                bb.placed_bytes += lin.out_features * load
            if lin.name in lora_lin:
                r = st.r
                bb.lora_tensors += [(r, lin.in_features), (lin.out_features, r)]
                bb.lora_in += lin.in_features
                in_mlp = ".mlp." in lin.name or ".feed_forward." in lin.name  # Llama 4's
                bb.mlp_lora_in += lin.in_features if in_mlp else 0
                bb.lora_reads.append(LoraRead(lin.in_features, source_of(lin.name), in_mlp, quantized))
                if st.peft == "dora":
                    bb.lora_tensors.append((lin.out_features,))
                    bb.dora_out += lin.out_features
                    bb.dora_in += lin.in_features
                    bb.mlp_dora_out += lin.out_features if in_mlp else 0
                    bb.mlp_dora_in += lin.in_features if in_mlp else 0
                    bb.dora_weight += lin.numel
                    # eye(in) fp32, lora weight in x out fp32, dequantized weight (c), W + s*BA and s*BA fp32
                    bb.max_dora = max(bb.max_dora, 4 * lin.in_features**2 + lin.numel * (load + 12))
        _add_experts(st, blk, bb)
        heads = (blk.head_dim or st.fig.head_dim, st.fig.num_heads, blk.kv_heads or st.fig.num_kv_heads)
        bb.head_norms = family_layers.head_norms_saved_per_token(st.fig, blk, heads, st.frozen_bytes, st.lean_norms)
        bias_names = {f"{lin.name}.bias" for lin in blk.linears}
        for pname, numel in blk.params:
            if pname in bias_names:
                continue
            bb.params_total += numel
            bb.other += numel * after
            bb.other_at_load += numel * load
            bb.placed_bytes += numel * load
            bb.max_cast = max(bb.max_cast, numel * load if after > load else 0)
        for _, numel, size in blk.buffers:
            bb.buffers += numel * (size or load)
            bb.placed_bytes += numel * (size or load)
        for ename, num, dim in blk.embeddings:
            if ename in lora_emb:
                bb.lora_tensors += [(st.r, num), (dim, st.r)]
                if st.peft == "dora":
                    bb.lora_tensors.append((dim,))
        if mts and any(blk.name == m or blk.name.endswith("." + m) for m in mts):
            bb.lora_tensors += saved_copy_shapes(blk, blocks)
        bb.lora_numel = sum(math.prod(s) for s in bb.lora_tensors)
        out.append((blk, bb))
    return out


def _add_experts(st: StackSpec, blk: Block, bb: BlockBytes) -> None:
    """A block's fused 3-D MoE expert weights (moe.py says how they are held) and their LoRA."""
    for name, n in blk.experts:
        bb.params_total += n
        shapes, fan_in = moe.expert_lora(st, name, n)
        bb.lora_tensors += shapes
        bb.expert_lora_in += fan_in
        _add_weight(st, bb, n, 0, moe.experts_quantized(st))


def _add_weight(st: StackSpec, bb: BlockBytes, n: int, out_features: int, quantized: bool) -> None:
    """One frozen weight of n elements: a bitsandbytes one (quantized_linear_bytes), else a parameter
    at the dtype k-bit prep leaves it (StackSpec.frozen_bytes)."""
    load, after = dtype_bytes(st.dtype), st.frozen_bytes
    if quantized:
        data, state = quantized_linear_bytes(n, out_features, st.quant, st.double_quant, st.quant_storage_bytes)
        bb.quant_data += data
        bb.quant_state += state
        bb.params_quantized += n
        bb.max_dequant = max(bb.max_dequant, n)
        bb.placed_bytes += int(n * (0.5 if st.quant in ("nf4", "fp4") else 1))
    else:
        bb.other += n * after
        bb.other_at_load += n * load
        bb.placed_bytes += n * load
        bb.max_cast = max(bb.max_cast, n * load if after > load else 0)


def saved_copy_shapes(blk: Block, blocks: tuple[Block, ...]) -> list[tuple[int, ...]]:
    """The trainable tensors of peft.modules_to_save's copy of a block: peft's ModulesToSaveWrapper
    deep-copies the module, tied or not. A tied lm_head holds no weight of its own here, but its copy
    is the whole V x h table it shares with the input embeddings, trained apart from them."""
    if blk.tied_to:
        table = [(num, dim) for b in blocks for name, num, dim in b.embeddings if blk.tied_to in (b.name, name)]
        return table[:1]
    shapes: list[tuple[int, ...]] = [(numel,) for _, numel in blk.params]
    for lin in blk.linears:
        shapes += [(lin.out_features, lin.in_features)] + ([(lin.out_features,)] if lin.bias else [])
    return shapes


def unquantized_bytes(st: StackSpec, bb: BlockBytes) -> tuple[int, int, int, int]:
    """A block the loader keeps unquantized: transformers' bitsandbytes quantizer adds every module
    the device map puts on "cpu" or "disk" to modules_to_not_convert under
    llm_int8_enable_fp32_cpu_offload (quantizer_bnb_4bit._process_model_before_weight_loading), so
    its linears are plain nn.Linear in the load dtype (precision.dtype), like its norms.
    (bytes as loaded, bytes after k-bit prep's upcast of real tensors, what the loader's placement
    counts, load bytes of its largest tensor that k-bit prep upcasts or 0)."""
    load, after = dtype_bytes(st.dtype), st.frozen_bytes
    at_load = bb.other_at_load + bb.params_quantized * load
    upcast = bb.other + bb.params_quantized * after
    largest = max(bb.max_cast, bb.max_dequant * load if after > load else 0)
    return at_load, upcast, at_load + bb.buffers, largest


def checkpoint_bytes(st: StackSpec, params_total: int, params_quantized: int, quantized_bytes: int) -> int:
    """The checkpoint's bytes as from_pretrained maps them: its safetensors tensors when the files are
    here, else its parameters at the dtype they are stored in (the load dtype when unknown), the
    quantized ones as stored when the checkpoint is."""
    if st.stored_bytes is not None:
        return st.stored_bytes
    stored = dtype_bytes(st.stored_dtype or st.dtype)
    if st.prequantized:
        return (params_total - params_quantized) * stored + quantized_bytes
    return params_total * stored


def keeps_views(st: StackSpec) -> bool:
    """from_pretrained keeps the checkpoint's tensors as views of its mapping when they are stored in
    the load dtype; stored in another, each is converted (a copy) as it is read."""
    return st.stored_dtype in (None, st.dtype)


def optimizer_bytes(optim: str, shapes: Iterable[tuple[int, ...]]) -> tuple[int, int]:
    """(state bytes, of which paged) the optimizer holds for these trainable tensors after a step.

    torch AdamW: exp_avg + exp_avg_sq fp32 + a 4-byte step. bnb 8-bit AdamW (adamw_bnb_8bit,
    paged_adamw_8bit): uint8 state1/state2 + fp32 absmax per 256 for tensors of >= 4096 elements
    (`min_8bit_size`), fp32 states below that. bnb 32-bit: 8 bytes/element. transformers Adafactor
    (beta1=None): factored second moment, rows + columns for matrices, full for vectors, + a 4-byte
    RMS per tensor. Paged optimizers allocate tensors of >= 1e5 elements in CUDA managed memory
    that can spill to host RAM; they are counted on the GPU.
    """
    kind = OPTIMIZERS[optim]
    total = paged = 0
    for shape in shapes:
        n = math.prod(shape)
        pageable = 0
        if kind in ("adam32_torch", "adam32_torch_fused"):
            b = 8 * n + 4  # exp_avg, exp_avg_sq (fp32) and the fp32 `step` tensor
        elif kind in ("adam8_bnb", "adam8_bnb_paged"):
            if n >= BNB_MIN_8BIT_SIZE:  # uint8 state1/state2 + fp32 absmax1/absmax2 per 256-block
                pageable = 2 * n
                b = pageable + 2 * 4 * -(-n // BNB_OPTIM_BLOCKSIZE)
            else:  # bitsandbytes keeps small tensors' state in fp32
                b = pageable = 8 * n
        elif kind == "adam32_bnb_paged":
            b = pageable = 8 * n
        elif kind == "adafactor":  # exp_avg_sq_row + exp_avg_sq_col (or exp_avg_sq for vectors) + RMS
            if len(shape) >= 2:
                b = 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) + 4
            else:
                b = 4 * n + 4
        else:  # sgd without momentum
            b = 0
        total += b
        if kind.endswith("_paged") and n >= BNB_PAGED_MIN_ELEMENTS:
            paged += pageable
    return total, paged


def optimizer_shared_bytes(optim: str) -> int:
    # bnb 8-bit optimizers share one signed and one unsigned 256-entry fp32 qmap per device
    return 2 * 4 * BNB_DYNAMIC_CODE_ELEMENTS if OPTIMIZERS[optim] in ("adam8_bnb", "adam8_bnb_paged") else 0


EAGER = ("eager", "paged|eager")


def eager(st: StackSpec) -> bool:
    """model.attn_implementation as the loader applies it (model/loading.attention_for): eager as
    asked, or the sdpa default of a family sdpa cannot run (Gemma 2's soft-capped logits: transformers
    5.23 keeps `_supports_sdpa = False` for it); flash and flex kernels apply the soft-cap themselves."""
    return st.attn in EAGER or (st.attn == "sdpa" and st.fig.traits.attention == "eager")


def attention_fix(st: StackSpec, has_gpu: bool) -> str | None:
    """The attention that runs an eager stack without its seq^2 scores: sdpa where the family has an
    sdpa path, else flash-attention 2 on a GPU (it soft-caps in the kernel); None on a CPU then."""
    if not eager(st):
        return None
    if st.fig.traits.attention != "eager":
        return "sdpa"
    return "flash_attention_2" if has_gpu else None


def eager_scores_bytes(st: StackSpec, b: int, on_cpu: bool = False) -> int:
    """The seq^2 tensors eager attention keeps for backward in one layer (transformers'
    eager_attention_forward: softmax in fp32, cast back to the compute dtype; Gemma 2's tanh
    soft-cap output too): rows x heads x n^2 x (4 + c [+ c]). Its backward adds the fp32 gradient of
    the softmax (backward_working_bytes); with checkpointing the recompute holds them again, one
    layer at a time. No dropout mask: attention_dropout is 0 in every family we know (transformers
    passes dropout=0.0 and F.dropout returns its input). sdpa and flash keep none of this: linear
    in seq (the log-sum-exp)."""
    if not eager(st):
        return 0
    c, _, _ = act_dtypes(st, on_cpu)
    rows, n = attention_rows(st, b)
    return rows * st.fig.num_heads * n * n * (4 + c + (c if st.fig.traits.attn_logit_softcap else 0))


def attention_rows(st: StackSpec, b: int) -> tuple[int, int]:
    """(rows, row length) attention runs over: b rows of seq_len, or padding-free (TRL's collator
    flattens the micro-batch) one row of b*seq_len tokens whose sequences position_ids keep apart."""
    return (1, b * st.seq_len) if st.padding_free else (b, st.seq_len)


def sdpa_masked(st: StackSpec, b: int) -> bool:
    """SDPA gets a mask (and K/V repeated to all heads, no native GQA): padding at b > 1, or
    padding-free's block-diagonal mask; flash kernels and sdpa_varlen take cu_seq_lens instead."""
    return not unmasked_packing(st.attn) if st.padding_free else b > 1


def act_dtypes(st: StackSpec, on_cpu: bool) -> tuple[int, int, int]:
    """(c, r, mask): compute dtype bytes; bytes of the residual stream and of the quantized
    linears' outputs; bytes per element of a LoRA dropout mask.

    prepare_model_for_kbit_training leaves embeddings and norm weights in fp32, so in a quantized
    model the hidden states are fp32 end to end (bitsandbytes linears return their input's dtype);
    without quantization, or with precision.upcast_frozen=false (frozen parts in the precision
    dtype), they stay in the precision dtype: r is StackSpec.frozen_bytes. On CUDA dropout keeps a
    bool mask; on CPU peft casts the LoRA input to the adapters' dtype (CUDA autocast is off) and
    dropout keeps a noise of that dtype (fp32, or bf16 for bf16 adapters).
    """
    c = st.act_bytes
    r = st.frozen_bytes
    return c, r, (st.adapter_bytes if on_cpu else 1)


def layer_saved_bytes(st: StackSpec, bb: BlockBytes, b: int, on_cpu: bool = False) -> int:
    """Bytes one decoder layer keeps for backward (no checkpointing), micro-batch b, T = b*s tokens.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    Eq. 1: a 16-bit GPT layer keeps s*b*h*(34 + 5*a*s/h) bytes. The same accounting, term by term,
    for a Llama-family QLoRA layer as autograd runs it (c compute, r residual bytes, see act_dtypes):
      RMSNorms: fp32 input + rsqrt                          (4h + 4) per norm (2; Gemma 2: 4)
        lean (trainer.lean_rmsnorm): the rsqrts and the second norm's r-byte input   r*h + 8
      per-head q/k norms (Qwen3, Gemma 3/4): fp32 input + rsqrt per head (lean: r-byte input)
                                                            4*(a + kv)*d + 4*(a + kv)
      attention, SDPA: Q, K, V as cast for the kernel (K/V repeated to all heads when a padding
        mask stops SDPA's native GQA), the output, the fp32 log-sum-exp
                                                            c*(2*a*d + 2*kv*d) + 4a
        eager instead: Q and the repeated K, V; and Korthikanti's 5*a*s/h term without dropout:
        the fp32 softmax and its c-byte cast (+ the tanh output of Gemma 2's soft-capping)
                                                            3c*a*d + b*a*s^2*(4 + c [+ c]) / T
      gated MLP: gate and up outputs, act(gate)             3*r*f
        tiled (trainer.tiled_mlp, more tokens than a tile): only the MLP's input, h*r; its gate/up/act
        and LoRA terms exist for one tile, in the recompute (backward_working_bytes)
        (bitsandbytes linears save no input: bnb 0.50 MatMul4Bit keeps only the packed weight)
      LoRA, per adapted linear: the c-byte input of lora_A (autocast cast) + dropout mask
        (without dropout, once per tensor siblings read uncast: lora_inputs.py)   (c + mask) * in
      LoRA weights cast to c for autocast, kept by each matmul      c * adapter elements (c < 4)
      DoRA: base and LoRA results kept for the magnitude    2c*out
        and with dropout, F.linear(dropout(x), dequantized W) keeps its input and W
                                                            c*in + c*out*in / T
    Frozen 4-bit linears keep no inputs (Korthikanti's 2sbh terms), but the fp32 residual stream and
    MLP outputs and the LoRA input copies make a QLoRA layer keep about twice 34*s*b*h (Llama-2-7B,
    s=2048: 74*s*b*h). tests/unit/test_memory_planner.py checks the tally against what autograd keeps on CPU.
    """
    fig, s = st.fig, st.seq_len
    c, r, mask = act_dtypes(st, on_cpu)
    h, a, d, kv = fig.hidden_size, fig.num_heads, bb.head_dim or fig.head_dim, bb.kv_heads or fig.num_kv_heads
    qd, kvd = a * d, kv * d
    per_token = norms_saved_per_token(st, r) + family_layers.saved_per_token(fig, bb.mixer, qd, kvd, r) + bb.head_norms
    mixer = 0
    if bb.mixer == "linear_attention":  # a Gated DeltaNet in place of attention (planner/linear_attention.py)
        rows, n = attention_rows(st, b)
        mixer = linear_attention.saved_bytes(fig, rows, n, c, r, on_cpu)
    elif eager(st):
        per_token += 3 * c * qd
    else:
        kv_saved = 2 * qd if kv < a and sdpa_masked(st, b) else 2 * kvd
        per_token += c * (2 * qd + kv_saved) + 4 * a + family_layers.sink_renorm_per_token(fig, c)
    kept = lora_inputs.output_kept(st, eager(st), on_cpu)  # the attention kernel keeps what o_proj reads
    per_token += lora_inputs.kept_per_token(st, bb.lora_reads, mask, on_cpu, False, kept)
    per_token += 2 * c * (bb.dora_out - bb.mlp_dora_out)
    # the MLP's; tiled (trainer.tiled_mlp), only its input: its tiles are recomputed in backward
    total = b * s * (per_token + (h * r if mlp_tiled(st, b) else mlp_saved_per_token(st, bb, on_cpu)))
    if c < st.adapter_bytes:  # autocast's c-byte copies of fp32 adapters (bf16 ones are used as they are)
        total += c * sum(math.prod(t) for t in bb.lora_tensors)
    if bb.dora_out and st.lora_dropout > 0:
        # DoRA with dropout recomputes the base output as F.linear(dropout(x), dequantized W):
        # that matmul keeps the c-byte input and the whole dequantized weight of each linear
        total += b * s * c * (bb.dora_in - bb.mlp_dora_in) + c * bb.dora_weight
    return total + mixer + (0 if bb.mixer == "linear_attention" else eager_scores_bytes(st, b, on_cpu))


def norms_saved_per_token(st: StackSpec, r: int) -> int:
    """What a layer's RMSNorms keep per token: each its fp32 input and rsqrt (4h + 4); with
    trainer.lean_rmsnorm (model/lean_rmsnorm.py) the rsqrt and its r-byte input, which for the first
    norm is the layer's input, kept anyway: 4 + (r*h + 4)."""
    h = st.fig.hidden_size
    if st.lean_norms:
        return 4 + r * h + 4
    return (4 if st.fig.traits.sandwich_norms else 2) * (4 * h + 4)


def mlp_tiled(st: StackSpec, b: int) -> bool:
    """trainer.tiled_mlp runs the MLP over tiles when a micro-batch has more tokens than one tile."""
    return bool(st.mlp_tile) and b * st.seq_len > st.mlp_tile


def mlp_tokens(st: StackSpec, b: int) -> int:
    """Tokens whose MLP intermediates exist at once: the micro-batch's, or one tile's."""
    return min(b * st.seq_len, st.mlp_tile) if mlp_tiled(st, b) else b * st.seq_len


def mlp_saved_per_token(st: StackSpec, bb: BlockBytes, on_cpu: bool = False) -> int:
    """What autograd keeps per token for the MLP (layer_saved_bytes' MLP terms): gate and up outputs
    and act(gate), the LoRA inputs (+ dropout masks) of its adapted linears, DoRA's kept results
    (and with dropout its inputs)."""
    c, r, mask = act_dtypes(st, on_cpu)
    fig = st.fig
    per_token = 3 * r * fig.active_intermediate + lora_inputs.kept_per_token(st, bb.lora_reads, mask, on_cpu, True)
    per_token += moe.saved_per_token(st, bb.expert_lora_in, c, r)
    per_token += 2 * c * bb.mlp_dora_out
    if bb.dora_out and st.lora_dropout > 0:
        per_token += c * bb.mlp_dora_in
    return per_token


def backward_working_bytes(st: StackSpec, b: int, on_cpu: bool = False, bb: BlockBytes | None = None) -> int:
    """Gradient buffers alive while one layer runs backward: hidden-state and MLP gradients; or, if
    larger, what recomputing a plain (not bitsandbytes) adapted linear holds on a GPU: peft's LoRA
    Linear.forward casts its input to the adapters' fp32 on every device (lora/layer.py,
    `_cast_input_dtype`; its bitsandbytes layers skip that under CUDA autocast), so with a 16-bit
    residual the adapted linear with the widest input holds that input, its fp32 copy and the fp32
    dropout output at once (bench/trace shows them at the layer-backward peak of quant=none stacks,
    beside the layer's saved tensors). A tiled MLP (trainer.tiled_mlp, layer `bb`) recomputes one tile
    at a time: that tile's saved tensors, its gate/up gradients and its input's gradient."""
    fig, s = st.fig, st.seq_len
    _, r, _ = act_dtypes(st, on_cpu)
    w = b * s * r * (2 * fig.hidden_size + 2 * fig.active_intermediate)
    if mlp_tiled(st, b) and bb is not None:
        # the larger of the MLP's backward (one tile) and the rest of the layer's, which the MLP's
        # tokens x 2f gradients no longer cover: fp32 RMSNorm-backward temporaries and the q and
        # attention-output gradients (bench trace, 8B at 32k and 64k tokens: the peak is there). The
        # lean norm's backward (trainer.lean_rmsnorm) holds 6h bytes a token there, 2h less than autograd's
        # (bench trace, 8B and 70B at 6k to 481k tokens with the shared LoRA input counted once)
        c, h, f = act_dtypes(st, on_cpu)[0], fig.hidden_size, fig.active_intermediate
        tile = mlp_tokens(st, b)
        mlp = tiled_moe.block_tile_bytes(st, tile, mlp_saved_per_token(st, bb, on_cpu), r * (2 * f + h), c, r)
        norm_temps = 6 * h if st.lean_norms else 4 * 2 * h
        rest = b * s * (norm_temps + c * 2 * fig.num_heads * fig.head_dim)
        w = b * s * r * 2 * h + max(mlp, rest)
    if not mlp_tiled(st, b):  # a routed layer's backward or its recompute, its MLP not run a tile at a time
        c = act_dtypes(st, on_cpu)[0]
        saved, dequant = (mlp_saved_per_token(st, bb, on_cpu), bb.max_dequant * c) if bb else (0, 0)
        w = max(w, moe.routed_working_bytes(st, b * s, c, r, saved, dequant))
    if eager(st):
        rows, n = attention_rows(st, b)
        w += rows * fig.num_heads * n * n * 4  # fp32 gradient of the softmax
    if not on_cpu and not st.quantized and r < 4:
        widest = _widest_lora_input(st)
        w = max(w, b * s * (r + 4 + (4 if st.lora_dropout > 0 else 0)) * widest)
    if bb is not None and bb.mixer == "linear_attention":  # its kernel's backward transients beside them
        rows, n = attention_rows(st, b)
        w += linear_attention.working_bytes(fig, rows, n, act_dtypes(st, on_cpu)[0], on_cpu)
    return w


def _widest_lora_input(st: StackSpec) -> int:
    """The largest in_features of an adapted linear of a decoder layer (0 without one)."""
    blocks = inventory(st.fig)
    targets, _ = _lora_targets(st, blocks)
    return max(
        (lin.in_features for blk in blocks if blk.is_layer for lin in blk.linears if lin.name in targets), default=0
    )


def shared_per_device_bytes(st: StackSpec, b: int, on_cpu: bool = False) -> int:
    """RoPE cos/sin (shared by the batch, in the residual dtype) and the attention mask every layer
    reads (none for SDPA without padding at b=1; padding-free: one row of b*s positions)."""
    _, r, _ = act_dtypes(st, on_cpu)
    rows, n = attention_rows(st, b)
    rope = 2 * (b * st.seq_len if st.padding_free else st.seq_len) * st.fig.head_dim * r
    if eager(st):  # a float mask in inputs_embeds' dtype (masking_utils.create_causal_mask): the residual's
        mask = rows * n * n * r
    else:  # Llama 4's chunked layers take a bool mask whatever the batch
        mask = rows * n * n if sdpa_masked(st, b) or st.fig.traits.local_attention == "chunked" else 0
    return rope + mask + family_layers.shared_bytes(st.fig, b * st.seq_len, r)


def offloaded_activations(st: StackSpec, per_layer: list[int]) -> tuple[int, int]:
    """(bytes left on the GPU, bytes in pinned host RAM) of what the decoder layers keep for
    backward (`per_layer`: one figure per layer) under TRL's activation offloading (SFTConfig
    activation_offloading=True, trl/models/activation_offloading.py, torchtune's OffloadActivations).

    Every saved tensor of >= 1 KiB that is not a parameter is copied to pinned host RAM in forward
    and back in backward. With checkpointing that is one tensor per layer, its input: non-reentrant
    torch.utils.checkpoint saves the layer's positional inputs under the outer saved-tensor hooks,
    while the recompute's tensors stay inside the checkpoint (RoPE cos/sin and the mask are keyword
    arguments, kept; shared_per_device_bytes). Left on the GPU: the forward stash, the last
    `st.offload_stash` offloaded tensors, alive until their copy completes and the newest until
    backward starts - the inputs of the last trainer.activation_offload_stash layers (TRL's default 5;
    without checkpointing, at most the last layer's tensors). Pinned blocks come from torch's CachingHostAllocator, which rounds each to a
    power of two and caches it; pageable ones (trainer.activation_offload_pinned=false) are exact; without
    checkpointing the sum is unrounded (tensor sizes not tallied).
    The saved tensors of the final norm and the loss move too; they stay counted on the GPU.
    """
    if not per_layer:
        return 0, 0
    if not st.checkpointing:
        return max(per_layer), sum(per_layer)
    moved = [x for x in per_layer if x >= TRL_OFFLOAD_MIN_BYTES]
    kept = sum(per_layer) - sum(moved) + sum(sorted(moved)[-st.offload_stash :])
    return kept, sum(1 << (x - 1).bit_length() if st.offload_pinned else x for x in moved)


def eval_layer_bytes(st: StackSpec, b: int, on_cpu: bool = False, s: int | None = None, autocast: bool = True) -> int:
    """One layer's forward without grad over b x s tokens (s: seq_len unless given): residual,
    normed input, Q/K/V/out, gate/up/act. Without autocast (generation outside the trainer) the
    projections come out in the residual dtype."""
    fig, s = st.fig, s or st.seq_len
    c, r, _ = act_dtypes(st, on_cpu)
    c = c if autocast else r
    h, f, a, d = fig.hidden_size, fig.active_intermediate, fig.num_heads, fig.head_dim
    mlp = min(b * s, st.mlp_tile) if st.mlp_tile else b * s  # trainer.tiled_mlp: one tile's intermediates
    w = b * s * (2 * r * h + 4 * h + c * (4 * a * d)) + mlp * 3 * r * f
    if fig.linear_v_heads:  # a Gated DeltaNet layer's kernel where it holds more than attention
        w += max(0, linear_attention.forward_bytes(fig, b, s, c, on_cpu) - b * s * c * 4 * a * d)
    if eager(st):
        rows, n = attention_rows(st, b) if s == st.seq_len and autocast else (b, s)  # generation: padded
        w += rows * a * n * n * (4 + c)
    return w
