"""trainer.tiled_mlp on an MoE model (model/tiled_moe.py): the sparse MoE block runs over tiles of tokens,
so what its routed experts hold at once in backward is one tile's: the tile's routed rows (tokens x top-k
through the experts), their top-k weights' product and the recompute at the down projection, at the tile's
tokens instead of the micro-batch's (planner/moe.py's figures at `tile` tokens). The dequantized expert
weights (the layer's dequant scratch) are as large per tile as untiled: each tile dequantizes them again."""

from __future__ import annotations

from . import moe
from .spec import StackSpec


def tile_routed_bytes(st: StackSpec, tile: int, c: int, r: int) -> int:
    """The routed experts' backward or their recompute for one tile of `tile` tokens, whichever holds more
    (0 for a dense model and for Llama 4's batched experts)."""
    return max(moe.routed_backward_bytes(st, tile, r), moe.routed_recompute_bytes(st, tile, c, r))


def block_tile_bytes(st: StackSpec, tile: int, saved: int, grads: int, c: int, r: int) -> int:
    """A tiled MLP's backward for one tile of `tile` tokens: the tile's recomputed saved tensors (`saved`
    bytes a token) beside its gate/up and input gradients (`grads` a token), or, in an MoE block, beside
    its routed experts' backward or recompute at the tile's tokens, whichever holds more. Untiled, the
    saved tensors are the layer's, counted apart; tiled they exist only in the tile's backward (bench
    trace, 4 of 8 experts at 4,096 tokens in 2 tiles: the routed backward's peak with them)."""
    return tile * saved + max(tile * grads, tile_routed_bytes(st, tile, c, r))
