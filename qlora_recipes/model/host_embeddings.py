"""offload.embeddings: the frozen input embeddings live in host RAM and the lookup runs there; only
the looked-up rows (batch x seq x hidden) cross to the GPU. For an 8B Llama that is the 1 GiB
(bf16) embedding table off the GPU for a few MiB of copies per step; the table is frozen under
LoRA, so no gradient needs it on the GPU. accelerate's own "cpu" placement would instead move the
whole table to the GPU for every forward (its offload hook onloads weights to the execution device),
generation step included.

The model is loaded whole on its GPU and the table moved afterwards (the loading peak holds it:
the plan counts it in the load phase); the caller hands the freed block back to the driver.
"""

from __future__ import annotations

from functools import partial
from itertools import chain

import torch


def keep_on_host(model, device: torch.device | str) -> int:
    """Move `model`'s input embeddings to host RAM, look up there, and hand the rows to `device`
    (where the decoder layers run). Returns the bytes moved off `device`."""
    embeddings = model.get_input_embeddings()
    moved = sum(p.numel() * p.element_size() for p in embeddings.parameters())
    moved += sum(b.numel() * b.element_size() for b in embeddings.buffers())
    _to_host(embeddings)
    embeddings.rows_device = torch.device(device)
    # The model is moved whole after this: accelerate's prepare_model calls model.to(its device) on a
    # 4-bit model loaded on one GPU (transformers 5 sets no hf_device_map for it), the Trainer on an
    # unquantized one. Module.to reaches the table through its parents' _apply: its own keeps it here
    # (a partial, not a bound method: the model still pickles and deep-copies).
    embeddings._apply = partial(_apply_on_host, embeddings)
    embeddings.register_forward_pre_hook(_ids_to_table)
    embeddings.register_forward_hook(_rows_to_layers)
    # generate() moves its inputs to model.device, the first parameter's: this table's host RAM. The
    # decoder the table belongs to takes its masks and positions where its layers run instead.
    parent = next((m for m in model.modules() if any(c is embeddings for c in m.children())), None)
    if parent is not None:
        parent.register_forward_pre_hook(partial(_inputs_to_layers, embeddings), with_kwargs=True)
    return moved


def left_alone_by_ddp(model) -> list[str]:
    """Name the host tables' tensors for DDP to leave alone (it reads them off the module it wraps:
    `model`, peft's, as the trainer hands it over). DDP refuses a module whose parameters sit on two
    device types, and would broadcast the table over NCCL, which sends GPU tensors only; the frozen
    table loads alike on every rank."""
    names = [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if "rows_device" in vars(module)
        for name, _ in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    ]
    if names:
        model._ddp_params_and_buffers_to_ignore = names
    return names


def _to_host(module) -> None:
    """Each parameter and buffer replaced by its host copy (not Module.to: frozen parameters need no
    identity kept, and a tensor subclass - the memory tracer's fake tensors - cannot be swapped in place)."""
    for name, param in list(module.named_parameters(recurse=False)):
        module._parameters[name] = torch.nn.Parameter(param.detach().to("cpu"), requires_grad=param.requires_grad)
    for name, buf in list(module.named_buffers(recurse=False)):
        module._buffers[name] = buf.to("cpu")


def _apply_on_host(module, fn, recurse: bool = True):
    """Module._apply for the host table: `fn`'s dtype cast is made here (the plan counts the table in
    the dtype the model trains in), its device move only redirects the rows (the layers went there)."""
    target = _target_device(fn)
    if target is not None:
        module.rows_device = target
    return type(module)._apply(module, lambda t: t.to(fn(_empty(t.dtype)).dtype), recurse)


def _target_device(fn) -> torch.device | None:
    """Where `fn` moves a host tensor, or None when it only casts. Told on empty tensors (no copy of
    the table): a move to the host itself shows on a meta tensor, which a cast leaves on meta."""
    on_host = fn(_empty(torch.float32)).device
    if on_host.type != "cpu":
        return on_host
    try:
        return None if fn(_empty(torch.float32, "meta")).device.type == "meta" else on_host
    except NotImplementedError:  # "Cannot copy out of meta tensor": a move to the host
        return on_host


def _empty(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)  # the device named: a torch.device context may be set


def _ids_to_table(module, args):
    device = module.weight.device
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _inputs_to_layers(embeddings, module, args, kwargs):
    """Every tensor input but the ids (which the table's own hook takes to the table) to the rows' device."""
    device = embeddings.rows_device

    def move(a):
        return a.to(device) if isinstance(a, torch.Tensor) and a.device != device else a

    kwargs = {k: v if k == "input_ids" else move(v) for k, v in kwargs.items()}
    return (*args[:1], *map(move, args[1:])), kwargs


def _rows_to_layers(module, args, output):
    return output.to(module.rows_device, non_blocking=True)
