"""trainer.tiled_mlp on MoE models: each decoder layer's sparse MoE block (router, routed experts, shared
experts) run over tiles of tokens, in forward and in backward, as model/tiled_mlp.py runs a dense MLP:
forward tile by tile without grad saving only the input, backward recomputing tile by tile, the forward's
autocast and RNG states replayed. Routing is token-wise, so a tile's routing, experts and shared expert
are the untiled block's rows for its tokens, and only one tile's routed rows (tokens x top-k through the
experts) exist at a time.

Two things a dense MLP has not:
- the block's output contract is kept: a tensor, or a tuple whose tensors are all token-major (gpt-oss:
  (hidden, router_scores); Llama 4: (hidden, router_logits)); each output is the tiles' rows concatenated.
- transformers records the router's logits with forward hooks (OutputRecorder, output_router_logits: the
  load-balancing loss). Each tile runs under a collector of its own, and the outer one gets, per hook
  firing, the tiles' records concatenated as an output of the tiled Function: the untiled logits, whose
  gradient (the aux loss's) reaches the router and the block's input through the recompute.
What it costs: each tile dequantizes the block's 4-bit expert weights (model/moe_experts.py) once in
forward and twice in backward (the recompute and the input's gradient), where an untiled block does it
once each: the time grows with the number of tiles (docs/memory-and-planner.md gives a CPU figure).
"""

from __future__ import annotations

import types

import torch
from transformers.utils import output_capturing

from .moe_experts import experts_module
from .tiled_mlp import _rng_as, _same, _tiles, add_grads, autocast_as, param_grads, remember


def _collect(keys: list[str]):
    """The recorder hooks' collector for one tile: a fresh list per key the caller records (none: off)."""
    return {k: [] for k in keys} if keys else None


def _run(forward, keys: list[str], xt: torch.Tensor) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], bool]:
    """The block on one tile: (its outputs, what the recorder hooks recorded per key, whether a tuple)."""
    fresh = _collect(keys)
    token = output_capturing._active_collector.set(fresh)
    try:
        out = forward(xt)
    finally:
        output_capturing._active_collector.reset(token)
    records = [fresh[k] for k in keys] if fresh else []
    return (list(out) if isinstance(out, tuple) else [out]), records, isinstance(out, tuple)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A tile's output as [n tokens, width]: the tile's own shape [1, n, ...] or token rows [n, ...]."""
    lead = 2 if t.dim() >= 2 and t.shape[:2] == (1, n) else 1
    if t.shape[lead - 1] != n:
        raise RuntimeError(f"trainer.tiled_mlp: an MoE block output of shape {tuple(t.shape)} is not {n} token rows")
    return t.reshape(n, -1)


def _whole_shape(t: torch.Tensor, n: int, x: torch.Tensor) -> tuple[int, ...]:
    """The untiled output's shape for a tile output `t` of n tokens: x's leading dims or all rows."""
    if t.dim() >= 2 and t.shape[:2] == (1, n) and t.dim() == x.dim():
        return (*x.shape[:-1], *t.shape[2:])
    return (x.shape[:-1].numel(), *t.shape[1:])


@torch.no_grad()
def tiled_run(forward, tile: int, keys: list[str], x: torch.Tensor, layout: dict) -> list[torch.Tensor]:
    """The block tile by tile: its outputs then its records (one per hook firing), the tiles' rows in one
    tensor each; `layout` gets how many are outputs, whether a tuple and the records per key."""
    whole: list[torch.Tensor] = []
    start = 0
    for t in _tiles(x.detach(), tile):  # no-grad views of x would still claim requires_grad
        n = t.shape[1]
        outs, records, is_tuple = _run(forward, keys, t)
        flat = outs + [r for per_key in records for r in per_key]
        if not whole:
            layout.update(outputs=len(outs), is_tuple=is_tuple, records=[len(r) for r in records])
            whole = [o.new_empty(_whole_shape(o, n, x)) for o in flat]
        for w, o in zip(whole, flat, strict=True):
            w.view(-1, _rows(o, n).shape[-1])[start : start + n] = _rows(o, n)
        start += n
    return whole


class TiledMoEFunction(torch.autograd.Function):
    """The block's outputs and records computed tile by tile; saves x and the trainable params only."""

    @staticmethod
    def forward(ctx, forward, tile: int, keys: list[str], layout: dict, x: torch.Tensor, *params: torch.Tensor):
        remember(ctx, forward, tile, x, params)
        ctx.keys = keys
        ctx.set_materialize_grads(False)  # an output nobody used (router scores) gets no gradient
        whole = tiled_run(forward, tile, keys, x, layout)
        ctx.mark_non_differentiable(*[w for w in whole if not w.is_floating_point()])
        return tuple(whole)

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[4]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[5:], strict=True) if need]
        grad_x = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        tiles_gx = _tiles(grad_x, ctx.tile) if want_x else None
        keep = torch.autograd.graph.saved_tensors_hooks(_same, _same)  # as TiledMLPFunction: no offloading
        start = 0
        with _rng_as(ctx.rng), autocast_as(ctx.device, ctx.autocast), keep, torch.enable_grad():
            for i, xt in enumerate(_tiles(x.detach(), ctx.tile)):
                n = xt.shape[1]
                xt = xt.requires_grad_(want_x)
                outs, records, _ = _run(ctx.forward, ctx.keys, xt)
                flat = outs + [r for per_key in records for r in per_key]
                used = [
                    (o, g.reshape(-1, _rows(o, n).shape[-1])[start : start + n].reshape(o.shape))
                    for o, g in zip(flat, grads, strict=True)
                    if g is not None and o.requires_grad
                ]
                start += n
                inputs = ([xt] if want_x else []) + wanted
                if not used or not inputs:
                    continue
                got = torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used], allow_unused=True)
                if want_x:
                    if got[0] is not None:
                        tiles_gx[i].copy_(got[0])
                    got = got[1:]
                add_grads(sums, got)
        return None, None, None, None, grad_x, *param_grads(sums, ctx.needs_input_grad[5:])


def _recording() -> list[str]:
    """The keys transformers' recorder hooks collect in this forward (router_logits, hidden_states...)."""
    collector = output_capturing._active_collector.get()
    return [k for k, v in (collector or {}).items() if isinstance(v, list)]


def _hand_over(records: list[torch.Tensor], keys: list[str], counts: list[int]) -> None:
    """The tiles' concatenated records into the outer collector, as the untiled block's hooks would."""
    collector = output_capturing._active_collector.get()
    it = iter(records)
    for key, count in zip(keys, counts, strict=True):
        collector[key].extend(next(it) for _ in range(count))


def tile_moe_block(block: torch.nn.Module, tile: int) -> None:
    """Run the MoE `block` over tiles of `tile` tokens from now on (a micro-batch of at most one tile: as before)."""
    if getattr(block, "_tiled_mlp_tile", None) is not None:
        block._tiled_mlp_tile = tile
        return
    plain = block.forward
    block._tiled_mlp_tile = tile

    def forward(self, x: torch.Tensor, *args, **kwargs):
        size = self._tiled_mlp_tile
        if args or kwargs or x.shape[:-1].numel() <= size:
            return plain(x, *args, **kwargs)
        keys, layout = _recording(), {}
        if torch.is_grad_enabled():
            params = [p for p in self.parameters() if p.requires_grad]
            whole = TiledMoEFunction.apply(plain, size, keys, layout, x, *params)
        else:  # evaluation, generation: nothing to recompute
            whole = tiled_run(plain, size, keys, x, layout)
        outs, records = list(whole[: layout["outputs"]]), list(whole[layout["outputs"] :])
        if keys:
            _hand_over(records, keys, layout["records"])
        return tuple(outs) if layout["is_tuple"] else outs[0]

    block.forward = types.MethodType(forward, block)


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """An experts module under peft's parameter wrappers (peft.experts=lora): the wrapped module."""
    base = getattr(module, "get_base_layer", None)
    return base() if callable(base) else module


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks: modules whose `experts` is a fused experts module (under LoRA or not)."""
    blocks = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, torch.nn.Module) and experts_module(_unwrapped(experts)):
            blocks.append(module)
    return blocks


def tile_moe_blocks(model: torch.nn.Module, tile: int) -> int:
    """Tile every sparse MoE block (gpt-oss, Qwen3-MoE, Qwen3.5-MoE, Llama 4, Mixtral); the count."""
    blocks = moe_blocks(model)
    for block in blocks:
        tile_moe_block(block, tile)
    return len(blocks)
