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

import torch


def keep_on_host(model, device: torch.device | str) -> int:
    """Move `model`'s input embeddings to host RAM, look up there, and hand the rows to `device`
    (where the decoder layers run). Returns the bytes moved off `device`."""
    embeddings = model.get_input_embeddings()
    moved = sum(p.numel() * p.element_size() for p in embeddings.parameters())
    moved += sum(b.numel() * b.element_size() for b in embeddings.buffers())
    _to_host(embeddings)
    embeddings.register_forward_pre_hook(_ids_to_host)
    embeddings.register_forward_hook(_rows_to(torch.device(device)))
    return moved


def _to_host(module) -> None:
    """Each parameter and buffer replaced by its host copy (not Module.to: frozen parameters need no
    identity kept, and a tensor subclass - the memory tracer's fake tensors - cannot be swapped in place)."""
    for name, param in list(module.named_parameters(recurse=False)):
        module._parameters[name] = torch.nn.Parameter(param.detach().to("cpu"), requires_grad=param.requires_grad)
    for name, buf in list(module.named_buffers(recurse=False)):
        module._buffers[name] = buf.to("cpu")


def _ids_to_host(module, args):
    return tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)


def _rows_to(device: torch.device):
    def hook(module, args, output):
        return output.to(device, non_blocking=True)

    return hook
