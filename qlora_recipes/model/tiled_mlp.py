"""trainer.tiled_mlp: each decoder layer's MLP run over tiles of tokens, in forward and in backward,
so its (tokens x intermediate_size) intermediates exist for one tile at a time.

The technique of Snowflake's ALST (DeepSpeed 0.19.8 `deepspeed.runtime.sequence_parallel.ulysses_sp.
TiledMLP`): forward over sequence chunks under no_grad saving only the input, backward recomputing
chunk by chunk with grad enabled; tiles of about hidden_size tokens (its LlamaMLP example:
ceil(seqlen / hidden) shards). DeepSpeed is an optional requirement here, and its backward lets each
chunk's backward accumulate into the parameters' .grad (its own note: DDP/FSDP need care), so this is
our own Function: the trainable parameters are inputs whose gradients it returns once, summed over
the tiles, as any autograd node does. The forward's autocast state and RNG state (LoRA dropout) are
replayed in the recompute, as torch.utils.checkpoint does, so each tile's gradient is that of the
forward that ran. An MLP is token-wise, so running its own forward on a slice of tokens is exact.
"""

from __future__ import annotations

import contextlib
import types

import torch


@contextlib.contextmanager
def autocast_as(device: str, state: tuple[bool, torch.dtype] | None):
    """The forward's autocast state again (backward runs outside it). Set through the low-level
    calls, as accelerate's state is, so a device autocast would not accept still gets it."""
    if state is None:
        yield
        return
    prev = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    torch.set_autocast_enabled(device, state[0])
    torch.set_autocast_dtype(device, state[1])
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device, prev[0])
        torch.set_autocast_dtype(device, prev[1])


def _rng_state(x: torch.Tensor):
    cuda = x.is_cuda and torch.cuda.is_initialized()
    return torch.get_rng_state(), (x.device, torch.cuda.get_rng_state(x.device)) if cuda else None


@contextlib.contextmanager
def _rng_as(state):
    """The forward's RNG state for the recompute, the caller's restored after (fork_rng)."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[cuda[0]] if cuda else [], device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state(cuda[1], cuda[0])
        yield


class TiledMLPFunction(torch.autograd.Function):
    """out = forward(x) computed tile by tile; saves x only; params: the MLP's trainable tensors."""

    @staticmethod
    def forward(ctx, forward, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        remember(ctx, forward, tile, x, params)
        return tiled_forward(forward, tile, x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:], strict=True) if need]
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        tiles_x = _tiles(x.detach(), ctx.tile)
        tiles_g = _tiles(grad_out, ctx.tile)
        tiles_gx = _tiles(grad_x, ctx.tile) if want_x else [None] * len(tiles_x)
        # The tile's saved tensors stay where they are, used at once: saved-tensor hooks still active
        # around backward (TRL's activation offloading wraps the whole training step) would copy
        # each tile's intermediates to host RAM and stash them.
        keep = torch.autograd.graph.saved_tensors_hooks(_same, _same)
        with _rng_as(ctx.rng), autocast_as(ctx.device, ctx.autocast), keep, torch.enable_grad():
            for xt, gt, gxt in zip(tiles_x, tiles_g, tiles_gx, strict=True):
                xt = xt.requires_grad_(want_x)
                out = ctx.forward(xt)
                inputs = ([xt] if want_x else []) + wanted
                grads = torch.autograd.grad(out, inputs, gt, allow_unused=True)
                if want_x:
                    gxt.copy_(grads[0])
                    grads = grads[1:]
                add_grads(sums, grads)
        return None, None, grad_x, *param_grads(sums, ctx.needs_input_grad[3:])


def remember(ctx, forward, tile: int, x: torch.Tensor, params) -> None:
    """What a tiled backward replays: the forward, the tile, autocast and RNG as they were; x and params."""
    device = x.device.type
    ctx.forward, ctx.tile, ctx.device = forward, tile, device
    ctx.autocast = (
        (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        if torch.amp.is_autocast_available(device)
        else None
    )
    ctx.rng = _rng_state(x)
    ctx.save_for_backward(x, *params)


def add_grads(sums: list, grads) -> None:
    """A tile's parameter gradients added into the running sums (None: the tile did not reach it)."""
    for i, g in enumerate(grads):
        if g is not None:
            sums[i] = g if sums[i] is None else sums[i].add_(g)


def param_grads(sums: list, needs) -> list:
    """The summed gradients in the autograd function's parameter slots, None where none was wanted."""
    it = iter(sums)
    return [next(it) if need else None for need in needs]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@torch.no_grad()
def tiled_forward(forward, tile: int, x: torch.Tensor) -> torch.Tensor:
    """forward(x) tile by tile into one output: one tile's intermediates and output at a time."""
    out = None
    start = 0
    for t in _tiles(x.detach(), tile):  # no-grad views of x would still claim requires_grad
        y = forward(t)
        if out is None:
            out = y.new_empty((1, x.shape[:-1].numel(), y.shape[-1]))
        out[:, start : start + t.shape[1]] = y
        start += t.shape[1]
    return out.view(*x.shape[:-1], -1)


def _tiles(x: torch.Tensor, tile: int) -> list[torch.Tensor]:
    """Tiles of `tile` tokens over all rows of the micro-batch: x as one row of b*s tokens, split."""
    return list(x.reshape(1, -1, x.shape[-1]).split(tile, dim=1))


def tile_mlp(mlp: torch.nn.Module, tile: int) -> None:
    """Run `mlp` over tiles of `tile` tokens from now on (a micro-batch of at most one tile: as before)."""
    if getattr(mlp, "_tiled_mlp_tile", None) is not None:
        mlp._tiled_mlp_tile = tile
        return
    plain = mlp.forward
    mlp._tiled_mlp_tile = tile

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        size = self._tiled_mlp_tile
        if args or kwargs or x.shape[:-1].numel() <= size:
            return plain(x, *args, **kwargs)
        if not torch.is_grad_enabled():  # evaluation, generation: nothing to recompute
            return tiled_forward(plain, size, x)
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLPFunction.apply(plain, size, x, *params)

    mlp.forward = types.MethodType(forward, mlp)


def tile_mlps(model: torch.nn.Module, tile: int) -> int:
    """Tile every decoder layer's `mlp` (Llama, Mistral, Qwen2, Gemma 2: gate/up/down + act); the count."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith(".mlp") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            tile_mlp(module, tile)
            count += 1
    return count
