"""Every optimizer the config accepts has a byte figure in the planner: a plan never meets a name
its state table lacks."""

import dataclasses

from qlora_recipes.config.schema import OPTIMIZERS as SCHEMA_OPTIMIZERS
from qlora_recipes.config.schema import OptimConfig
from qlora_recipes.planner.components import optimizer_bytes
from qlora_recipes.planner.constants import OPTIMIZERS

KINDS = {"adam32_torch", "adam32_torch_fused", "adam8_bnb", "adam8_bnb_paged", "adam32_bnb_paged", "adafactor", "sgd"}


def test_every_accepted_optimizer_has_a_byte_figure():
    field = {f.name: f for f in dataclasses.fields(OptimConfig)}["name"]
    accepted = field.metadata["choices"]
    assert accepted == SCHEMA_OPTIMIZERS and OptimConfig().name in accepted
    assert set(OPTIMIZERS) == set(accepted), "planner/constants.py OPTIMIZERS: one kind per accepted name"
    assert set(OPTIMIZERS.values()) <= KINDS


def test_every_optimizer_is_sized():
    """A 1024 x 1024 adapter matrix: state bytes for all but plain SGD (no momentum, no state)."""
    for name, kind in OPTIMIZERS.items():
        total, paged = optimizer_bytes(name, [(1024, 1024)])
        assert (total > 0) is (kind != "sgd") and paged <= total, name
