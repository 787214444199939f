"""The parts of a traced step that an objective adds to SFT's (step.py), each as TRL 1.16 runs it.

- DPO (DPOTrainer._compute_loss): one forward over chosen then rejected (2 x micro_batch_size rows),
  then the reference's forward through the same fused head under no_grad with the adapter off
  (phase reference), unless its log-probs are precomputed; the sigmoid loss of the two.
- KTO (KTOTrainer._compute_loss): first the policy's no_grad forward over the KL batch (the
  micro-batch's prompts with their neighbours' completions: as many rows, phase kl), then the
  policy's own forward, then the reference's forwards over the batch and the KL batch (adapter off,
  no_grad, checkpointing off: `compute_ref_log_probs`) unless precomputed.
- GRPO (GRPOTrainer): each optimizer step first samples its generation batch (micro_batch_size x
  grad_accum completions; phases prefill and decode) with transformers `generate` under no_grad, checkpointing
  off (TRL's `unwrap_model_for_generation`), the adapter on; every completion runs to
  max_completion_length (a sampled EOS would stop it sooner: the plan's bound), from prompts of
  trainer.seq_len tokens. Each micro-batch then trains on prompt + completion rows, its fused head
  scoring the completions alone (TRL's labels: -100 over the prompt), and with beta > 0 a reference
  forward as DPO's. The head's boolean selection (kernels.py) is told how many positions are scored.
"""

from __future__ import annotations

import contextlib
from typing import Any

from qlora_recipes.config.objectives import objective


def completion_len(cfg: Any) -> int:
    """grpo: the tokens a sampled completion may have; 0 for the other objectives."""
    return int(cfg.objective.max_completion_length or 0) if cfg.objective.name == "grpo" else 0


def train_rows_and_len(cfg: Any) -> tuple[int, int]:
    """(rows, tokens) of one training forward: the micro-batch's examples times the objective's
    sequences, at trainer.seq_len (grpo: the prompt's bound plus its completion)."""
    rows = int(cfg.trainer.micro_batch_size) * objective(cfg.objective.name).sequences
    return rows, int(cfg.trainer.seq_len) + completion_len(cfg)


def reference_on(cfg: Any) -> bool:
    """A reference forward every micro-batch: the objective has one (grpo: beta > 0) and its
    log-probs are not precomputed."""
    if cfg.objective.name == "grpo":
        return float(cfg.objective.beta or 0) > 0
    return objective(cfg.objective.name).reference and not getattr(cfg.objective, "precompute_ref_log_probs", False)


def score_completions_only(cfg: Any, batch: dict) -> None:
    """grpo: labels on the completion positions alone, and the fused head's boolean selection told
    how many that is (a fake tensor cannot count its true elements)."""
    n = completion_len(cfg)
    if not n:
        return
    from bench.trace import kernels

    labels = batch["labels"]
    labels[:, : labels.shape[1] - n] = -100
    kernels.KNOWN_TRUE[(labels.shape[0], labels.shape[1] - 1)] = labels.shape[0] * n  # the shifted labels' mask


def _reference(model, batches: list[dict], tracker):
    """The reference's no_grad forwards, adapter off: per-token log-probs of each batch."""
    import torch

    tracker.phase = "reference"
    out = []
    with torch.no_grad(), model.disable_adapter():  # no_grad: checkpointing saves nothing either way
        for batch in batches:
            with tracker.second_forward():
                out.append(model(**batch, fused_lm_head=True).log_probs)
    tracker.phase = "loss"  # the policy's head backward comes first, as in SFT
    return out


def kl_forward(cfg: Any, model, batch: dict, tracker):
    """kto: the policy's no_grad forward over the KL batch (its mismatched pairs: as many rows and
    tokens as the batch), before anything of the micro-batch is kept; its per-sequence log-probs."""
    import torch

    if not objective(cfg.objective.name).kl_batch:
        return None
    tracker.phase = "kl"
    with torch.no_grad(), tracker.second_forward():
        kl = model(**batch, fused_lm_head=True).log_probs.sum(dim=1)
    tracker.phase = "forward"
    return kl


def loss(cfg: Any, model, batch: dict, out, n_labels: int, tracker, kl=None):
    """The objective's loss of the policy's forward `out` (the reference's forwards run here)."""
    import torch
    import torch.nn.functional as F

    name = cfg.objective.name
    if name == "sft":
        return (-out.log_probs).sum() / max(1, n_labels)
    logps = out.log_probs.sum(dim=1)
    on = reference_on(cfg)
    ref = _reference(model, [batch] * (2 if on and kl is not None else 1), tracker) if on else None
    beta = float(cfg.objective.beta if cfg.objective.beta is not None else 0.1)
    if name == "grpo":  # per-token ratio to itself times the (here uniform) advantages
        per_token = out.log_probs[:, -completion_len(cfg) :]
        ratio = torch.exp(per_token - per_token.detach())
        kl_term = beta * (per_token - ref[0][:, -completion_len(cfg) :]) if ref else 0
        return -(ratio - kl_term).sum() / max(1, n_labels)
    base = ref[0].sum(dim=1) if ref else torch.zeros_like(logps.detach())
    if name == "kto":
        kl_est = (kl - (ref[1].sum(dim=1) if ref else 0)).mean().clamp(min=0).detach()
        return (1 - torch.sigmoid(beta * (logps - base - kl_est))).mean()
    chosen, rejected = (logps - base).chunk(2, dim=0)
    return -F.logsigmoid(beta * (chosen - rejected)).mean()


def sample(cfg: Any, model, device: str, tracker, vocab: int) -> None:
    """grpo: the step's generation batch sampled as GRPOTrainer does (transformers generate, no_grad,
    checkpointing off, the adapter on), every completion max_completion_length tokens long."""
    n = completion_len(cfg)
    if not n:
        return
    import torch
    from transformers import GenerationConfig

    rows = int(cfg.trainer.micro_batch_size) * int(cfg.trainer.grad_accum)
    prompt = int(cfg.trainer.seq_len)
    ids = _fake(torch.ones((rows, prompt), dtype=torch.long), device)
    mask = _fake(torch.ones((rows, prompt), dtype=torch.long), device)
    gen = GenerationConfig(
        max_new_tokens=n,
        do_sample=True,
        temperature=float(cfg.objective.temperature or 1.0),
        top_k=0,
        top_p=1.0,
        use_cache=True,
    )
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None  # made on the device
    model.generation_config.pad_token_id = None  # from Python ints: a fake device cannot (no EOS: the bound)
    tracker.phase = "prefill"
    with torch.no_grad(), _checkpointing_off(cfg, model), _generate_on_fake_tensors(n, tracker):
        with tracker.modules_untracked():
            done = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    del done
    tracker.phase = "forward"


@contextlib.contextmanager
def _checkpointing_off(cfg: Any, model):
    """Checkpointing off while generating (transformers would drop the KV cache under it), back on as
    the run's loader enables it after (TRL's `unwrap_model_for_generation`)."""
    on = model.is_activation_checkpointing
    if on:
        model.activation_checkpointing_disable()
    try:
        yield
    finally:
        if on:
            kwargs = {"use_reentrant": cfg.trainer.checkpointing_mode == "reentrant"}
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def _fake(t, device: str):
    from torch._guards import active_fake_mode

    mode = active_fake_mode()
    return (mode.from_tensor(t) if mode is not None else t).to(device)


@contextlib.contextmanager
def _generate_on_fake_tensors(new_tokens: int, tracker):
    """What generate reads from data, answered: its loop runs until every sequence has stopped, read
    from the sampled tokens - here new_tokens steps, as when no completion samples an EOS before its
    last token; its checks of the prompts' mask - answered False (a batch of prompts is padded on the
    left to the longest, as TRL's are: the mask stays). And the cache's first (empty) keys and
    values made by a factory op, not from a Python list (which a fake CUDA device cannot hold). The
    prefill and the decoding steps are phases of their own (their peaks grow with the layers at
    different rates: a model's peak is at one or the other, whatever a slice's is)."""
    import torch
    from transformers import cache_utils
    from transformers.generation import utils

    from bench.trace import kernels

    def lazy_initialization(self, key_states, value_states, *args, **kwargs):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.empty((0,), dtype=self.dtype, device=self.device)
        self.values = torch.empty((0,), dtype=self.dtype, device=self.device)
        self.is_initialized = True

    mixin = utils.GenerationMixin
    saved = mixin._has_unfinished_sequences
    saved_init = cache_utils.DynamicLayer.lazy_initialization
    cache_utils.DynamicLayer.lazy_initialization = lazy_initialization
    steps = {"n": 0}

    def has_unfinished(self, this_peer_finished, synced_gpus, device, *args, **kwargs):
        steps["n"] += 1
        tracker.phase = "decode"  # called after the prefill, before each decoding step
        return steps["n"] <= new_tokens

    mixin._has_unfinished_sequences = has_unfinished
    kernels.BOOL_READS.append(False)
    try:
        yield
    finally:
        mixin._has_unfinished_sequences = saved
        cache_utils.DynamicLayer.lazy_initialization = saved_init
        kernels.BOOL_READS.pop()
