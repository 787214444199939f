"""Cross-attention to image features (mllama): what the language model's cross-attention layers hold.

The row holds one image token an image; the text cross-attends, at the layers figures.cross_attention_layers
lists, to the projector's output: every image's tiles' patches and class tokens (cross_attention_states,
rows x features x hidden, features = images a row x tiles x (patches + 1)). That tensor is every cross-attention layer's input, kept for the whole forward and
backward, beside the cross-attention mask MllamaModel expands to (rows, 1, seq_len, features). Each such
layer projects its k and v from it (kv heads x head_dim a feature), normalizes k in fp32 (its k_norm),
and, with a mask, transformers' sdpa repeats k and v to every query head (repeat_kv: CUDA's masked sdpa
takes no GQA). Checkpointed, one layer's k/v are recomputed at a time in backward; else every layer keeps
them. The text side (q over the row's tokens, the output, the MLP) is planned as a decoder layer's.
"""

from __future__ import annotations

from .components import act_dtypes
from .spec import StackSpec


def kv_bytes(st: StackSpec, rows: int, features: int, a: int) -> int:
    """One cross-attention layer's k and v over `rows` x `features` image features: the projections,
    k's fp32 norm copy and, for grouped heads, their repeats to every query head."""
    fig, n = st.fig, rows * features
    kv = n * fig.num_kv_heads * fig.head_dim
    repeated = 2 * n * fig.num_heads * fig.head_dim * a if fig.num_heads != fig.num_kv_heads else 0
    return 2 * kv * a + kv * 4 + repeated


def _held(st: StackSpec, rows: int, features: int, a: int) -> int:
    """The features every cross-attention layer reads and the mask over them."""
    return rows * features * st.fig.hidden_size * a + rows * st.seq_len * features * a


def eval_bytes(st: StackSpec, device: str, features: int) -> int:
    """The eval forward (no grad) over the eval rows' features: the features, the mask, one layer's k/v."""
    if not (st.fig.cross_attention_layers and features):
        return 0
    c, _, _ = act_dtypes(st, device == "cpu")
    return _held(st, st.eval_rows, features, c) + kv_bytes(st, st.eval_rows, features, c)


def add_cross_attention(st: StackSpec, comp: dict, device: str, features: int, notes: list[str]) -> None:
    """The cross-attention layers' terms over a micro-batch's image features (`features` a row: every
    image's tiles' patches and class tokens)."""
    layers = len(st.fig.cross_attention_layers)
    if not (layers and features):
        return
    c, _, _ = act_dtypes(st, device == "cpu")
    rows = st.train_rows
    states = _held(st, rows, features, c)
    per_layer = kv_bytes(st, rows, features, c)
    comp["activations"][device] += states + (0 if st.checkpointing else layers * per_layer)
    if st.checkpointing:  # recomputed one layer at a time in backward, beside the largest layer's working set
        comp["layer_working"][device] += per_layer
    held = "one layer's at a time (checkpointed)" if st.checkpointing else f"all {layers} layers'"
    notes.append(
        f"cross-attention: {layers} layers of the language model read {features} image features a row "
        f"(images x tiles x (patches + class token)); counted: the features and the mask kept "
        f"({states / 2**20:,.0f} MiB) and the k/v over them, {held} ({per_layer / 2**20:,.0f} MiB a layer)"
    )
