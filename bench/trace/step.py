"""One traced training step of a composed stack: the model, the batch, the step, the counts.

With gradient accumulation (trainer.grad_accum > 1, every shipped recipe) the traced optimizer step
takes two micro-batches, so the second runs its forward and backward with the gradients of the
first held, as every micro-batch of a run but the first of each step does.

The step is the trainer's, in its parts: TRL's collator makes the micro-batch (micro_batch_size rows
of seq_len tokens, labels on every position; padding-free when the stack is), the forward runs under
CUDA autocast in the precision dtype (what accelerate wraps the model's forward in), inside TRL's
activation-offloading context when the stack offloads, through the fused LM head exactly as
SFTTrainer.compute_loss calls it (`model(**inputs, fused_lm_head=True)`, the loss from the per-token
log-probabilities); backward; the gradient clipping Trainer does; the optimizer Trainer builds
(`Trainer.create_optimizer`: the same class, kwargs and parameter groups, bitsandbytes paged state
traced unpaged - the same bytes); `zero_grad(set_to_none=True)`. Two steps run, so the second starts
with the optimizer state live, as every step of a run but the first; its peaks are the ones reported.

Phases, as the plan names them: forward (the backbone), loss (the fused head's forward and
backward), backward (the decoder layers' backward), optimizer (clipping and the step).

An objective's own parts (DPO's pairs and reference forward, KTO's KL batch, GRPO's sampling phase
and completion-only head) are objectives.py's, each as TRL runs it.

At micro-batch 1 a real batch has no padding and transformers skips the attention mask (SDPA's
is_causal); it cannot tell that from a fake tensor (it treats fake tensors as tracing and always
builds the mask), so at b = 1 the batch goes without `attention_mask`, which is the same decision
made up front. At b > 1 the batch is padded (its last row one token short) and the mask is built,
on fake and real tensors alike; the fused head's boolean selection of the labelled positions is
taken as all of them (kernels.py), one position more than this batch has.
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

from bench.trace import objectives

STEPS = 2


def _batch(cfg: Any, device: str, vocab: int, config=None):
    """A micro-batch as TRL's collator makes it, moved to the device: micro_batch_size rows of
    seq_len tokens, labels on every position. At b > 1 the last row is one token short, so the batch
    is padded as real data makes it (and transformers builds the attention mask on real tensors too;
    on fake ones it always does). Padding-free flattens the rows into one. A vision-language model's
    `config`: image rows (bench/trace/vision.py)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from bench.trace.vision import image_rows, is_vlm
    from qlora_recipes.config.schema import padding_free_on

    b, s = objectives.train_rows_and_len(cfg)
    padding_free = padding_free_on(cfg.data)
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)
    lengths = [s] * b if padding_free or b == 1 else [s] * (b - 1) + [s - 1]
    rows = [{"input_ids": [1 + (i + j) % (vocab - 1) for j in range(n)]} for i, n in enumerate(lengths)]
    with unset_fake_temporarily():  # the collator computes on real values (position ids, padding)
        batch = image_rows(config, b, s) if config is not None and is_vlm(config) else collator(rows)
    if b == 1 and not padding_free:
        batch.pop("attention_mask", None)
    from torch._guards import active_fake_mode

    mode = active_fake_mode()

    def move(v):
        if not isinstance(v, torch.Tensor):
            return v
        return (mode.from_tensor(v) if mode is not None else v).to(device)

    moved = {k: move(v) for k, v in batch.items()}
    objectives.score_completions_only(cfg, moved)
    return moved


def _sft_args(cfg: Any):
    from pathlib import Path

    from qlora_recipes.data.formats import trains_as
    from qlora_recipes.run import trainer_args

    fmt = cfg.data.format if cfg.data.format not in (None, "auto") else "text"
    fmt = trains_as(fmt)
    return trainer_args.sft_config(cfg, Path("/tmp/qlora-trace"), fmt, False, False)


def _optimizer(cfg: Any, model):
    """Trainer.create_optimizer on the model, as the trainer builds it. Built outside the fake mode:
    bitsandbytes computes its quantization maps from Python lists (data), then they are made fake."""
    import torch
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from transformers import Trainer

    mode = active_fake_mode()
    with unset_fake_temporarily():
        optimizer, args = _create_optimizer(cfg, model, Trainer)
    if mode is not None:
        for name, t in list(getattr(optimizer, "name2qmap", {}).items()):
            if isinstance(t, torch.Tensor):
                optimizer.name2qmap[name] = mode.from_tensor(t)
    if getattr(optimizer, "is_paged", False):
        optimizer.is_paged = False  # CUDA managed memory: same bytes, counted on the GPU
    return optimizer, args


def _create_optimizer(cfg: Any, model, Trainer):
    args = _sft_args(cfg)
    shim = SimpleNamespace(
        optimizer=None,
        args=args,
        model=model,
        optimizer_cls_and_kwargs=None,
        get_decay_parameter_names=lambda m: Trainer.get_decay_parameter_names(None, m),
        get_optimizer_cls_and_kwargs=Trainer.get_optimizer_cls_and_kwargs,
    )
    return Trainer.create_optimizer(shim, model), args


def _autocast(cfg: Any, device: str):
    """What accelerate wraps the forward in: autocast in the precision dtype (none for fp32)."""
    import torch

    from qlora_recipes.units import torch_dtype

    dtype = torch_dtype(cfg.precision.dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()

    from qlora_recipes.model.tiled_mlp import autocast_as

    return autocast_as(device, (True, dtype))


def _offload_ctx(cfg: Any, model):
    if not cfg.trainer.activation_offloading or cfg.objective.name == "grpo":  # GRPOTrainer has no such path
        return contextlib.nullcontext
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    ctx = get_act_offloading_ctx_manager(model=model, max_fwd_stash_size=cfg.trainer.activation_offload_stash)
    return lambda: ctx


def label_static(tracker, model) -> dict[str, int]:
    """Label every parameter, buffer and quantization state with its plan row; returns the bytes."""
    import torch

    from bench.trace.model import quant_state_tensors

    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                tracker.label(p, "lora_weights")
            elif p.dtype in (torch.uint8, torch.int8) or hasattr(p, "quant_state"):
                tracker.label(p, "quantized_weights")
                for t in quant_state_tensors(p.quant_state) if hasattr(p, "quant_state") else ():
                    tracker.label(t, "quantized_weights")
            else:
                tracker.label(p, "other_params")
        for buf in module.buffers(recurse=False):
            tracker.label(buf, "buffers")
    return tracker.current()


def _label_live(tracker, model, optimizer, inputs: dict, device: str) -> dict:
    """Register what lives before the traced step with the tracker and label it: the model's tensors
    (`label_static`, returned), the optimizer's state and quantization maps, the batch."""
    import torch

    tracker.track_external(model, optimizer)
    static = label_static(tracker, model)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                tracker.label(v, "optimizer_state")
    for v in getattr(optimizer, "name2qmap", {}).values():
        if isinstance(v, torch.Tensor) and v.device.type == torch.device(device).type:
            tracker.label(v, "optimizer_state")
    for v in inputs.values():
        tracker.label(v, "inputs")
    return static


def _loss_phase_hook(tracker):
    """A forward hook on the backbone: its output starts the loss phase, the gradient reaching it the backward."""

    def to_loss(module, inputs, output):
        if tracker.phase == "reference":  # the reference's head: still its no_grad forward
            return
        tracker.phase = "loss"
        hidden = output.last_hidden_state
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: setattr(tracker, "phase", "backward"))

    return to_loss


def run_step(cfg: Any, model, device: str, tracker, kernel_mode=None) -> dict:
    """STEPS training steps; the last under the tracker (entered here, with `kernel_mode(tracker)`
    above it). The earlier steps run untracked: they leave what a run leaves (the optimizer state),
    and MemTracker's own backward hooks from a tracked step keep a few of that step's tensors alive
    across steps (a cycle through autograd nodes), which a real run does not have."""
    import torch

    from bench.trace.vision import checks_hold, phase_hooks

    backbone = model.get_base_model().model
    vocab = model.config.get_text_config().vocab_size
    batch = _batch(cfg, device, vocab, model.config)
    optimizer, args = _optimizer(cfg, model)
    offload = _offload_ctx(cfg, model)
    # every label valid (the tracer's batch), grpo's completions alone
    n_labels = int(batch["labels"].shape[0]) * (objectives.completion_len(cfg) or int(batch["labels"].shape[1]))
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    accumulate = 2 if int(cfg.trainer.grad_accum) > 1 else 1
    times = []
    held_bytes: list[int] = []
    tracker_on = False

    def micro_batch() -> None:
        tracker.reset_mod_stats()  # MemTracker's module stats are per forward (the last micro-batch's)
        tracker.phase = "forward"
        with offload():
            with _autocast(cfg, device):
                kl = objectives.kl_forward(cfg, model, batch, tracker)  # kto: before anything is kept
                out = model(**batch, fused_lm_head=True)
                loss = objectives.loss(cfg, model, batch, out, n_labels, tracker, kl)
            del out, kl
            loss.backward()
        del loss
        held = tracker.release_transients() if tracker_on else 0
        held_bytes.append(held)

    def one_step(micro_batches: int) -> None:
        objectives.sample(cfg, model, device, tracker, vocab)  # grpo: the step's completions
        for _ in range(micro_batches):
            micro_batch()
        tracker.phase = "optimizer"
        if args.max_grad_norm and args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.max_grad_norm)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        tracker.phase = "idle"

    handles = [backbone.register_forward_hook(_loss_phase_hook(tracker)), *phase_hooks(model, tracker)]
    with checks_hold(model.config):  # a VLM's image-token check, on fake tensors
        try:
            for _ in range(STEPS - 1):
                started = time.perf_counter()
                with kernel_mode(None) if kernel_mode else contextlib.nullcontext():
                    one_step(1)
                times.append(time.perf_counter() - started)
            started = time.perf_counter()
            static = _label_live(tracker, model, optimizer, tensors, device)
            before = tracker.current()
            tracker_on = True
            with tracker:
                with kernel_mode(tracker) if kernel_mode else contextlib.nullcontext():
                    one_step(accumulate)
            times.append(time.perf_counter() - started)
        finally:
            for handle in handles:
                handle.remove()
    return {
        "optimizer": type(optimizer).__name__,
        "step_s": [round(t, 2) for t in times],
        "tokens": int(batch["input_ids"].numel()),
        "micro_batches": accumulate,
        "held_by_tracker": held_bytes[-accumulate:],
        "static": static,
        "before_step": before,
    }
