"""`trainer.seq_len`: the model's positions bound it, and `auto` picks it from the data.

`auto` is the train rows' longest tokenized length (or `trainer.seq_len_percentile` of their lengths),
rounded up to a multiple of ROUND, capped by the model's positions (`positions`) and by the longest
sequence whose plan fits the hardware. Before the data is read (`qlora plan`, and a run's first
plan) auto stands for that cap alone: the most it can resolve to, so the plan is an upper bound.

Once the data is tokenized a run plans the batches it really makes: a micro-batch is padded to its
longest row (padding-free: no longer than that many tokens per row), so rows all shorter than
seq_len are planned at the longest of them. Packed rows are filled to seq_len and stay planned there.
A plan without the data (`qlora plan`) assumes every row is seq_len long and says so.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import UserError
from ..units import GiB
from .figures import model_figures
from .peaks import worst_device

if TYPE_CHECKING:
    from ..config.schema import ModelConfig, TrainConfig

AUTO = "auto"
ROUND = 64  # the search's granularity too; the shipped sample (22 tokens at most) stays at 64


def is_auto(cfg: TrainConfig) -> bool:
    return cfg.trainer.seq_len == AUTO


def positions(model: ModelConfig) -> int:
    """The positions a run may use: max_position_embeddings times model.rope_scaling's factor when set,
    else what the model's own config.json scaling reaches (planner/figures.own_positions)."""
    fig = model_figures(model)
    scaling = model.rope_scaling
    if scaling:
        return int(fig.max_position_embeddings * float(scaling["factor"]))
    return max(fig.positions, fig.max_position_embeddings)


def _positions_word(model: ModelConfig) -> str:
    """What the positions are: the native count, scaled by model.rope_scaling or by the config's own."""
    if model.rope_scaling:
        return "max_position_embeddings with model.rope_scaling"
    fig = model_figures(model)
    if fig.positions > fig.max_position_embeddings:
        return f"max_position_embeddings={fig.max_position_embeddings:,} with its config.json's RoPE scaling"
    return "max_position_embeddings"


def refuse_past_positions(cfg: TrainConfig) -> None:
    """A numeric seq_len past the model's positions: the model has no position for those tokens."""
    most = positions(cfg.model)
    seq_len = cfg.trainer.seq_len
    if not is_auto(cfg) and most and int(seq_len) > most:
        further = (
            "raise model.rope_scaling.factor"
            if cfg.model.rope_scaling
            else "set model.rope_scaling={rope_type:linear,factor:F} for F times more"
        )
        raise UserError(
            f"trainer.seq_len={seq_len} is past {cfg.model.name_or_path}'s {most:,} positions "
            f"({_positions_word(cfg.model)}): use trainer.seq_len={most} or less, or trainer.seq_len=auto, "
            f"or {further}"
        )


def completion_room(cfg: TrainConfig) -> int:
    """Positions objective=grpo keeps for a sampled completion after its prompt (0 for the others)."""
    return int(cfg.objective.max_completion_length or 0) if cfg.objective.name == "grpo" else 0


def refuse_completions_past_positions(cfg: TrainConfig) -> None:
    """objective=grpo trains on a prompt of up to trainer.seq_len tokens and its sampled completion:
    both need the model's positions, as seq_len alone does."""
    most, completion = positions(cfg.model), completion_room(cfg)
    if is_auto(cfg) or not most or not completion or int(cfg.trainer.seq_len) + completion <= most:
        return
    seq_len = int(cfg.trainer.seq_len)
    raise UserError(
        f"trainer.seq_len={seq_len} + objective.max_completion_length={completion} = {seq_len + completion} is "
        f"past {cfg.model.name_or_path}'s {most:,} positions (a prompt and its sampled completion): use "
        f"trainer.seq_len={max(most - completion, 1)} or less, lower objective.max_completion_length, or "
        f"{rope_hint(cfg.model)}"
    )


def rope_hint(model: ModelConfig) -> str:
    """How to get more positions than the model has."""
    if model.rope_scaling:
        return "raise model.rope_scaling.factor"
    return "set model.rope_scaling={rope_type:linear,factor:F} for F times more"


def with_seq_len(cfg: TrainConfig, seq_len: int) -> TrainConfig:
    out = copy.deepcopy(cfg)
    out.trainer.seq_len = seq_len
    return out


def auto_cap(cfg: TrainConfig, plan_fn: Callable[..., dict], longest_fit: Callable[[], int | None]) -> tuple[int, str]:
    """(the most auto may resolve to, why): the model's positions, or the longest length that fits
    when the plan at the positions does not. Not even ROUND tokens fitting: ROUND, which its plan refuses."""
    most = positions(cfg.model) - completion_room(cfg)  # grpo: a prompt leaves room for its completion
    if plan_fn(with_seq_len(cfg, most))["fits"]:
        if cfg.model.rope_scaling:
            scaled = f" x model.rope_scaling.factor={cfg.model.rope_scaling['factor']}"
        else:
            own = model_figures(cfg.model)
            scaled = " x its config.json's RoPE scaling" if own.positions > own.max_position_embeddings else ""
        less = f" less objective.max_completion_length={completion_room(cfg)}" if completion_room(cfg) else ""
        return most, f"the model's positions (max_position_embeddings{scaled}={positions(cfg.model):,}){less}"
    fit = longest_fit() or ROUND
    worst = worst_device(plan_fn(with_seq_len(cfg, fit))["devices"])
    return fit, f"the longest sequence that fits {worst['device']}'s {worst['budget'] / GiB:.1f} GiB"


def plan_note(cap: int, why: str) -> str:
    """What `qlora plan` and a run's first plan say they planned auto for (no data read yet)."""
    return f"trainer.seq_len=auto planned at {cap:,}, {why}: the most it resolves to once the data's rows are read"


def resolve_auto(lengths: Sequence[int], percentile: float, cap: int, why: str, source: str) -> tuple[int, str]:
    """(seq_len, the one line saying why) from the train rows' token lengths."""
    ordered = sorted(int(n) for n in lengths)
    if not ordered:
        return cap, f"trainer.seq_len=auto -> {cap} ({source} has no train rows: {why})"
    if percentile >= 100:
        want, what = ordered[-1], f"the longest tokenized train row of {source}, {ordered[-1]} tokens"
    else:  # nearest rank: at least `percentile` % of the rows fit whole
        want = ordered[max(0, math.ceil(percentile / 100 * len(ordered)) - 1)]
        what = (
            f"trainer.seq_len_percentile={percentile:g} of the tokenized train rows of {source}, {want} tokens "
            f"(longest {ordered[-1]})"
        )
    rounded = -(-want // ROUND) * ROUND
    if rounded > cap:
        return cap, f"trainer.seq_len=auto -> {cap} ({what}; capped at {cap}: {why})"
    return rounded, f"trainer.seq_len=auto -> {rounded} ({what}, rounded up to a multiple of {ROUND})"


def data_length(cfg: TrainConfig, max_tokens: dict | None) -> int | None:
    """The length a run's batches reach, when its data makes them shorter than trainer.seq_len: the
    longest tokenized row of the train and eval splits. None when rows are packed (filled to seq_len)
    or some row reaches seq_len."""
    if cfg.data.packing or not max_tokens:
        return None
    longest = max(int(n or 0) for n in max_tokens.values())
    return longest if 0 < longest < int(cfg.trainer.seq_len) else None


def data_note(longest: int, seq_len: int) -> str:
    return (
        f"planned for the batches the data makes: its longest tokenized row is {longest} tokens "
        f"(trainer.seq_len={seq_len} bounds it; a plan without the data assumes every row is seq_len long)"
    )


def upper_bound_note(seq_len: int) -> str:
    return (
        f"planned as if every row were trainer.seq_len={seq_len:,} tokens long: an upper bound; "
        "a run plans the batches its data makes"
    )
