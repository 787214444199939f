"""`trainer.gradient_checkpointing` on the model: every decoder layer, none, or the first N.

transformers 5.23 marks each decoder layer a `GradientCheckpointingLayer` with a `gradient_checkpointing`
flag of its own, set by `_set_gradient_checkpointing` (modeling_utils.py), which
`activation_checkpointing_enable` calls: the Trainer calls it again when training starts and TRL calls it
after each reference forward, each time for every layer. So a partial N is kept by the model itself: its
`_set_gradient_checkpointing` becomes the same call followed by turning the flag off past the first N
layers. The first N, not every n-th: backward reaches them last, when the other layers have freed what
they kept, so one recomputed layer never stacks on them (planner/single.py plans it so).
"""

from __future__ import annotations

from typing import Any


def layers_to_checkpoint(value: Any, num_layers: int) -> int:
    """How many decoder layers trainer.gradient_checkpointing checkpoints (resolved: not auto)."""
    if isinstance(value, bool):
        return num_layers if value else 0
    return min(int(value), num_layers)


def decoder_layers(model) -> list:
    """The model's decoder layers, in forward order (transformers' GradientCheckpointingLayer instances).
    A vision-language model's tower layers come first in module order: its language model's layers only,
    as the planner counts N (the tower keeps transformers' own setting)."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    root = decoder if isinstance(decoder, torch.nn.Module) else model
    return [m for m in root.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_checkpointing(model, value: Any, kwargs: dict) -> int:
    """Checkpoint the first N decoder layers of `model` (value: trainer.gradient_checkpointing, resolved)
    with torch.utils.checkpoint `kwargs`; returns N. N equal to the layer count is transformers' own
    call, untouched."""
    layers = decoder_layers(model)
    n = layers_to_checkpoint(value, len(layers))
    if n == 0:
        return 0
    if n < len(layers):
        own = model._set_gradient_checkpointing

        def first_layers_only(enable: bool = True, gradient_checkpointing_func=None, every_n_layers: int = 1):
            extra = (
                {}
                if gradient_checkpointing_func is None
                else {"gradient_checkpointing_func": gradient_checkpointing_func}
            )
            own(enable=enable, every_n_layers=every_n_layers, **extra)
            if enable:
                for layer in decoder_layers(model)[n:]:
                    layer.gradient_checkpointing = False

        model._set_gradient_checkpointing = first_layers_only  # an instance attribute: every later call too
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    return n


def checkpoint_every_layer(model, kwargs: dict) -> None:
    """Every decoder layer checkpointed, a partial N's hold dropped (the in-process OOM rung: `model` may be
    the peft wrapper; the hold is on the transformers model inside it)."""
    for module in model.modules():
        module.__dict__.pop("_set_gradient_checkpointing", None)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
