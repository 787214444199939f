"""The training objectives, one row each: what the objective name picks everywhere else.

`objective=<name>` (conf/objective/) selects a row: the TRL trainer and its config class (run/training.py,
run/trainer_args.py), the data kind its rows must be (data/formats.py: `sft` rows, `preference` pairs or `unpaired` rows),
the shipped sample the embedded default trains on (conf/data/order.yaml), and the planner's terms
(planner/spec.py: sequences per example in a forward, a reference forward under no_grad). A new
objective (GRPO, ORPO) is a row here plus its yaml and its keys in ObjectiveConfig.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Objective:
    name: str
    trainer: str  # the TRL trainer class (trl.<name>)
    args: str  # its config class (trl.<name>)
    data: str  # the rows it reads: "sft" (every SFT format), "preference" (prompt, chosen, rejected) or
    # "unpaired" (prompt, completion, label; preference pairs too, each split into a desirable and an undesirable row)
    sample: str  # the order sample's files under assets/data/order/ (train.jsonl, eval.jsonl)
    sequences: int  # sequences per example in one forward (DPO: chosen and rejected in one batch)
    reference: bool  # a reference forward under no_grad (adapter off) beside the policy's
    keys: tuple[str, ...]  # the objective.* keys that only this objective reads
    # kto: a no_grad forward per step of policy and reference each over mismatched prompt/completion pairs
    # (TRL's KL batch, the KL estimate its loss subtracts)
    kl_batch: bool = False
    trainer_evaluates: bool = True  # the eval split goes to the TRL trainer (grpo: exact match only)


OBJECTIVES = {
    "sft": Objective("sft", "SFTTrainer", "SFTConfig", "sft", "", 1, False, ()),
    "dpo": Objective(
        "dpo",
        "DPOTrainer",
        "DPOConfig",
        "preference",
        "preference/",
        2,
        True,
        ("beta", "loss_type", "precompute_ref_log_probs", "ref_adapter", "sft_weight"),
    ),
    "kto": Objective(
        "kto",
        "KTOTrainer",
        "KTOConfig",
        "unpaired",
        "kto/",
        1,
        True,
        ("beta", "desirable_weight", "undesirable_weight", "precompute_ref_log_probs"),
        kl_batch=True,
    ),
    # grpo: sequences and reference follow the config (planner/spec.py: num_generations, beta > 0)
    "grpo": Objective(
        "grpo",
        "GRPOTrainer",
        "GRPOConfig",
        "prompt",
        "grpo/",
        1,
        True,
        ("beta", "num_generations", "max_completion_length", "temperature", "rewards", "reward_timeout_s"),
        trainer_evaluates=False,  # TRL's evaluate would generate num_generations per eval prompt
    ),
}

# Objectives a user may name that no row trains, and why: the end of the one line `objective=NAME` gets
# (config/loader.py one_line). ORPO runs on a 4-bit + LoRA model (trl.experimental.orpo, tried on the tiny
# model), but its concatenated_forward takes the model's full logits, which nothing here plans.
NOT_OFFERED = {
    "orpo": (
        "TRL 1.16 has ORPO only as trl.experimental's ORPOTrainer, which builds the full (2 x micro-batch, "
        "seq_len, vocab) logits that TRL's fused LM head and this planner leave out, so its memory would go "
        "unplanned; use objective=dpo on an SFT run's data (ORPO's two terms in two runs) or objective=kto"
    ),
}

# grpo's built-in rewards (run/rewards.py), each reading the row's `answer` column; any other name is the
# user's own `module:function`
BUILTIN_REWARDS = ("exact_match", "char_match", "one_line")

# TRL 1.16 DPOConfig.loss_type's values (trl/trainer/dpo_config.py) but exo_pair, which needs a
# label_smoothing this repository does not pass
DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)


def objective(name: str) -> Objective:
    return OBJECTIVES[name]


def sample_file(name: str, split: str) -> str:
    """`${order_sample:${objective.name},train}` in conf/data/order.yaml: the shipped order sample's file
    for this objective (SFT: prompt/completion; DPO: preference pairs of the same prompts; KTO: those pairs unpaired)."""
    from ..resources import shipped_path

    row = OBJECTIVES.get(str(name), OBJECTIVES["sft"])
    return shipped_path(f"assets/data/order/{row.sample}{split}.jsonl")


def by_objective(name: str, values) -> object:
    """`${by_objective:${objective.name},{sft:150,dpo:40}}` in an option file: the value for this
    objective, sft's where the objective has none (conf/trainer/tiny.yaml sizes the embedded default)."""
    return values.get(str(name), values["sft"])
