"""trainer.lean_rmsnorm: each Llama-form RMSNorm keeps its 16-bit input and the per-token rsqrt for
backward, and recomputes the fp32 pass there, instead of keeping the fp32 copy of its input that
autograd saves for `x.float().pow(2)` and `x * rsqrt` (twice the bytes of a 16-bit residual).

Llama's RMSNorm (transformers' LlamaRMSNorm, and Mistral's and Qwen2's, the same code):
    y = weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)
The forward here runs those ops, so y is the same bits; backward is the analytic gradient
    dx = rstd * (g - xhat * mean(g * xhat)),  g = d(xhat) in fp32, xhat = x * rstd
in fp32, as autograd's composite backward computes it (up to fp32 rounding). The norm's input is
usually alive anyway (a decoder layer's input, or the residual sum the MLP's norm reads), so what
the norm adds to a layer's saved bytes per token drops from 4h + 4 to 4 for the first norm (its
input is the layer's) and to 2h + 4 for the second (the 16-bit residual sum it reads). Unsloth's
Triton RMSNorm keeps the same two tensors.
Gemma 2's norm is (1 + weight) and computes in fp32 to the end: not this form, not patched.
"""

from __future__ import annotations

import types

import torch


def llama_form(module: torch.nn.Module) -> bool:
    """Its forward is LlamaRMSNorm's code (transformers' modular copies: Mistral, Qwen2, Qwen3, Qwen3-MoE,
    SmolLM3 in 5.23): decided by the code, not the class name, so a new family's copy is found too."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    forward = getattr(type(module).forward, "__code__", None)
    ref = LlamaRMSNorm.forward.__code__
    # the docstring (co_consts[0]) may differ between copies
    same = forward is not None and (forward.co_code, forward.co_names) == (ref.co_code, ref.co_names)
    return same and forward.co_consts[1:] == ref.co_consts[1:] and hasattr(module, "variance_epsilon")


class LeanRMSNormFunction(torch.autograd.Function):
    """y = weight * (x * rstd).to(x.dtype) in fp32 as Llama's RMSNorm; saves x, weight and rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None
        # the gradient reaching `.to(x.dtype)` is computed in the product's dtype and cast to x's
        g = (grad_y * weight).to(x.dtype).float()
        dot = torch.linalg.vecdot(g, xhat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        grad_x = g.sub_(xhat.mul_(dot)).mul_(rstd)
        return grad_x.to(x.dtype), grad_w, None


def lean_rmsnorm(norm: torch.nn.Module) -> None:
    """Run `norm` (a Llama-form RMSNorm) through LeanRMSNormFunction from now on."""
    if getattr(norm, "_lean_rmsnorm", False):
        return
    norm._lean_rmsnorm = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # without grad (evaluation, generation) nothing is kept either way: the same bits
        return LeanRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)

    norm.forward = types.MethodType(forward, norm)


def lean_rmsnorms(model: torch.nn.Module) -> int:
    """Patch every Llama-form RMSNorm of `model` (the decoder layers' and the final one); the count."""
    count = 0
    for module in model.modules():
        if llama_form(module):
            lean_rmsnorm(module)
            count += 1
    return count
