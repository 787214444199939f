"""The DPO recipes: the stacks of the SFT recipes beside them with objective=dpo and preference pairs,
planned for chosen and rejected in one forward and the reference forward (adapter off), and still
fitting their cards."""

from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.config import devices

GiB = 2**30


def _plan(*overrides: str) -> dict:
    cfg = compose_cfg(*overrides)
    return planner.plan(cfg, gpus=devices.declared_gpus(cfg), host_ram=devices.declared_host_ram(cfg))


def test_the_8b_dpo_recipe_is_the_24gb_stack_with_pairs_and_plans_more_than_sft():
    dpo, sft = compose_cfg("recipe=llama3.1-8b-24gb-dpo"), compose_cfg("recipe=llama3.1-8b-24gb")
    assert dpo.objective.name == "dpo" and dpo.data.format == "preference"
    for group in ("model", "quant", "peft", "optim", "offload", "precision", "trainer", "hardware"):
        assert getattr(dpo, group) == getattr(sft, group), group
    planned, as_sft = _plan("recipe=llama3.1-8b-24gb-dpo"), _plan("recipe=llama3.1-8b-24gb")
    assert planned["peak_gib"] == _plan("recipe=llama3.1-8b-24gb", "objective=dpo")["peak_gib"]
    assert planned["fits"] and planned["peak_gib"] > as_sft["peak_gib"] + 1  # two answers per pair, a reference
    assert planned["components"]["reference_forward"]["cuda:0"] > 0


def test_the_70b_dpo_recipe_fits_one_80gb_card_with_every_layer_on_it():
    cfg = compose_cfg("recipe=llama3.1-70b-80gb-dpo")
    assert cfg.objective.name == "dpo" and cfg.hardware.gpus == 1 and cfg.hardware.gpu_memory_gib == 79
    planned = _plan("recipe=llama3.1-70b-80gb-dpo")
    assert planned["fits"] and planned["devices"][0]["peak"] / GiB < 79
    assert "cpu" not in set(map(str, planned["device_map"].values()))  # no layer in host RAM: no offload slowdown
    assert planned["components"]["reference_forward"]["cuda:0"] > 0
