"""objective=orpo is one line saying why not and what to use: TRL 1.16's ORPOTrainer (trl.experimental)
takes the model's full logits, which the planner leaves out. When TRL's ORPO moves to the fused LM head
as its DPO and KTO did, this test fails: ORPO can then be a row of config/objectives.py. The command
line's one line is in tests/unit/test_bad_input_gets_one_line.py."""

import inspect

from qlora_recipes.config.objectives import NOT_OFFERED, OBJECTIVES


def test_trls_orpo_still_builds_the_full_logits():
    from trl.experimental.orpo import orpo_trainer

    source = inspect.getsource(orpo_trainer.ORPOTrainer)
    assert "outputs.logits" in source and "fused_lm_head" not in source


def test_orpo_is_named_with_its_reason_and_the_objectives_to_use():
    assert "orpo" not in OBJECTIVES
    assert "full" in NOT_OFFERED["orpo"]
    assert all(f"objective={name}" in NOT_OFFERED["orpo"] for name in ("dpo", "kto"))
