"""objective.precompute_ref_log_probs under several ranks is refused in one line before anything loads:
TRL 1.16 caches the reference log-probs of an in-memory dataset in a file each rank names for itself
(seen on 2 FSDP CPU ranks: rank 1 "Failed to open local file .../cache-....arrow"). The default
reference, the adapter off, runs on every rank (tests/e2e/test_dpo_on_sharded_cpu_ranks.py)."""

import pytest
from conftest import compose_cfg

from qlora_recipes.errors import UserError
from qlora_recipes.run.validate import validate


def test_precomputed_reference_log_probs_on_two_ranks_get_one_line():
    cfg = compose_cfg("objective=dpo", "objective.precompute_ref_log_probs=true", "dist=fsdp")
    with pytest.raises(UserError, match=r"precompute_ref_log_probs=true cannot run under 2 processes.*drop it"):
        validate(cfg, gpu_available=False, world_size=2)
    validate(cfg, gpu_available=False, world_size=1)  # one process precomputes
    validate(compose_cfg("objective=dpo", "dist=fsdp"), gpu_available=False, world_size=2)  # adapter off
