"""What a run reports: the task metric (exact match of greedy generations), memory, throughput."""

import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path

import torch

from ..outputs.generation import generate
from ..outputs.prompts import data_prompt
from . import memory


def memory_figures(measured_gib: float, plan: dict, gpu: bool) -> dict:
    """Measured and planned peak of one quantity, the same on both sides (memory.py): on GPU
    torch.cuda.max_memory_allocated vs plan.json's `peak_allocated_gib`, on CPU the process's RSS
    vs the plan's cpu-device peak; `plan_ratio` = measured / planned."""
    planned = memory.planned_peak_gib(plan, gpu)
    out = {
        "peak_quantity": memory.quantity(gpu),
        "peak_mem_gib": measured_gib,
        "planned_peak_gib": planned,
        "plan_ratio": measured_gib / planned if planned else None,
        "planned_peak_allocated_gib": plan.get("peak_allocated_gib"),
        "planned_device_peak_gib": plan.get("peak_gib"),  # plan.json peak_gib: on GPU + CUDA context, reserve
    }
    if gpu:
        out["measured_peak_allocated_gib"] = measured_gib
    return out


@torch.no_grad()
def exact_match(
    model,
    tokenizer,
    pairs: list,
    max_new_tokens: int,
    batch_size: int = 32,
    max_batch_tokens: int | None = None,
    max_prompt_tokens: int | None = None,
) -> float | None:
    """Fraction of (prompt, reference) pairs whose greedy continuation equals the reference
    (surrounding whitespace ignored). None when there is nothing to score.

    Bounded whatever the eval rows hold: each prompt is cut to its last `max_prompt_tokens` tokens (pass
    trainer.seq_len; without it, to what one batch of `max_batch_tokens` positions leaves beside
    max_new_tokens), at most `max_new_tokens` are generated, and `max_batch_tokens` bounds each
    generation batch's positions (generation.generate). Generation stops on every stop token of the
    model and tokenizer (generation.stop_token_ids)."""
    if not pairs:
        return None
    if max_prompt_tokens is None and max_batch_tokens:
        max_prompt_tokens = max(1, int(max_batch_tokens) - int(max_new_tokens))
    was_training = model.training
    model.eval()
    try:
        prompts = [data_prompt(prompt) for prompt, _ in pairs]  # already formatted: the style is not used
        new = generate(
            model,
            tokenizer,
            prompts,
            "plain",
            max_new_tokens,
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            max_prompt_tokens=max_prompt_tokens,
        )
    finally:
        model.train(was_training)
    return _matched(new, pairs)


@torch.no_grad()
def image_exact_match(
    model,
    processor,
    pairs: list,
    max_new_tokens: int,
    max_prompt_tokens: int | None = None,
    batch_size: int = 32,
    max_batch_tokens: int | None = None,
) -> float | None:
    """exact_match on image rows: each held-out row's turns answered greedily with its images (the one
    image generation helper, outputs.images), scored as text rows are. None when there is nothing to score.
    Batched as exact_match batches text prompts (`batch_size` prompts and at most `max_batch_tokens`
    positions a batch, left-padded), but never cut: `max_prompt_tokens` only names the longer ones."""
    from ..outputs.images import generate_with_images

    if not pairs:
        return None
    was_training = model.training
    model.eval()
    try:
        prompts = [prompt for prompt, _ in pairs]
        new = generate_with_images(
            model,
            processor,
            prompts,
            max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
        )
    finally:
        model.train(was_training)
    return _matched(new, pairs)


def image_pairs(eval_ds, limit: int | None) -> list:
    """(ImagePrompt, reference) of the first `limit` image rows: the turns before the last assistant turn
    with the images of their image parts, and that turn's text."""
    from ..outputs.images import ImagePrompt, image_parts

    if eval_ds is None or (limit is not None and limit <= 0):
        return []
    n = len(eval_ds) if limit is None else min(int(limit), len(eval_ds))
    pairs = []
    for row in eval_ds.select(range(n)):
        messages = row["messages"]
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if not last:
            continue  # no turn before the answer to ask with
        turns = messages[:last]
        answer = "".join(p["text"] or "" for p in messages[last]["content"] if p["type"] == "text")
        pairs.append((ImagePrompt(turns, list(row["images"][: image_parts(turns)])), answer))
    return pairs


def _matched(answers: list[str], pairs: list) -> float:
    """The share of answers equal to their pair's reference, surrounding whitespace aside."""
    return sum(g.strip() == ref.strip() for g, (_, ref) in zip(answers, pairs, strict=True)) / len(pairs)


def perplexity(loss: float | None) -> float | None:
    return math.exp(min(loss, 50.0)) if loss is not None else None


def lm_eval_available() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def lm_eval_scores(model, tokenizer, tasks: list[str], limit: int | None, batch_size: int) -> dict:
    """Optional lm-eval-harness run on the trained model (base + adapter), for users who have it."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    result = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size), tasks=list(tasks), limit=limit
    )
    return {task: scores for task, scores in result["results"].items()}


def losses(log_history: list[dict]) -> list[float]:
    return [entry["loss"] for entry in log_history if "loss" in entry]


def trainable_digest(model) -> str:
    """sha256 over the trainable weights: identical across DDP ranks when gradients were averaged."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if param.requires_grad:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().contiguous().numpy())  # its buffer: no bytes copy
    return digest.hexdigest()


def write_metrics(run_dir: Path, metrics: dict, name: str = "metrics.json") -> None:
    """`name` written whole (never a half-written file), through a temporary name of this process's
    own: a writer elsewhere (another rank, a second run refused by the lock) never renames it away."""
    tmp = run_dir / f".{name}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        tmp.replace(run_dir / name)
    finally:
        tmp.unlink(missing_ok=True)


def drop_rank_metrics(run_dir: Path, world_size: int) -> list[str]:
    """Remove metrics.rankN.json of ranks N >= world_size: an earlier run's, on more ranks, that this
    run (a resume on fewer) would leave beside its own figures. Their names."""
    stale = [p for p in run_dir.glob("metrics.rank*.json") if _rank_of(p.name) >= world_size]
    for path in stale:
        path.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def _rank_of(name: str) -> int:
    rank = name.removeprefix("metrics.rank").removesuffix(".json")
    return int(rank) if rank.isdigit() else -1  # not a rank's file: kept


def objective_figures(objective: str, before: dict | None, after: dict | None) -> dict:
    """metrics.json's objective figures: its name, and for dpo TRL's eval rewards/accuracies (the share
    of eval pairs whose chosen answer the policy rewards above the rejected one, relative to the
    reference) before and after training, and rewards/margins after. Before training the policy is the
    reference, so every reward is 0 and the accuracy 0 (TRL counts chosen > rejected, strictly). For kto
    the accuracy is the share of eval rows whose reward has their label's sign (GuardedKTOTrainer; TRL
    logs none) and the margin TRL's: the desirable rows' mean reward minus the undesirable rows'."""
    out: dict = {"objective": objective}
    if objective in ("dpo", "kto"):
        pick = lambda figures, key: None if figures is None else figures.get(f"eval_rewards/{key}")  # noqa: E731
        out["eval_reward_accuracy_before"] = pick(before, "accuracies")
        out["eval_reward_accuracy"] = pick(after, "accuracies")
        out["eval_reward_margin_before"] = pick(before, "margins")
        out["eval_reward_margin"] = pick(after, "margins")
    return out


def reward_figures(history: list[dict]) -> dict:
    """grpo: the mean reward (TRL's `reward`, the sum of objective.rewards averaged over the completions
    of a logging window: trainer.logging_steps steps) at the first and the last logged step, and each
    one logged, in order. A logged value that is no finite number (None, NaN, inf: a window no completion
    of which a reward scored) is null in the curve and skipped for first and last, so metrics.json stays
    JSON and the run is recorded whatever the rewards logged."""
    curve = [_finite(e["reward"]) for e in history if "reward" in e]
    scored = [r for r in curve if r is not None]
    return {
        "reward_first": scored[0] if scored else None,
        "reward_last": scored[-1] if scored else None,
        "rewards": curve,
    }


def _finite(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
