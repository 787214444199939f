"""The OOM ladder's offload rungs re-plan at many GPU and CPU budgets, and its other rungs re-plan stacks
that differ only in what the device map does not read: each distinct map is inferred once (transformers'
inference on a meta model is most of a probe's cost) and the plan is the one inferring every time gives."""

import json

import pytest
from test_memory_planner import LLAMA2_70B, plan_for

from qlora_recipes.planner import placement

GiB = 2**30


def _plan_counting(monkeypatch, cache_size: int, host_ram: int) -> tuple[dict, list]:
    """The 70B plan on a 24 GB card with its ladder, and the inputs of every map transformers inferred."""
    monkeypatch.setattr(placement, "MAP_CACHE_SIZE", cache_size)
    monkeypatch.setattr(placement, "_INFERRED", {})
    inferred, real = [], placement._inferred_map

    def counted(st, max_memory, linears):
        inferred.append((st.fig, st.dtype, st.device_map, st.quant, tuple(max_memory.items())))
        return real(st, max_memory, linears)

    monkeypatch.setattr(placement, "_inferred_map", counted)
    plan = plan_for(*LLAMA2_70B, gpus=[24 * GiB], host_ram=host_ram)
    monkeypatch.setattr(placement, "_inferred_map", real)
    return plan, inferred


@pytest.mark.parametrize("host_ram, offload", [(256 * GiB, "cpu_offload"), (24 * GiB, "disk_offload")])
def test_the_70b_ladder_on_a_24gb_card_infers_each_map_once_and_plans_as_without_the_cache(
    monkeypatch, host_ram, offload
):
    uncached, every = _plan_counting(monkeypatch, 0, host_ram)
    cached, once = _plan_counting(monkeypatch, 64, host_ram)
    assert offload in [r["change"] for r in cached["ladder"]]
    # rungs (overrides, peaks, fits), the devices' peaks and budgets, the device map: all the same
    assert json.dumps(cached, sort_keys=True, default=str) == json.dumps(uncached, sort_keys=True, default=str)
    assert len(once) == len(set(once)) == len(set(every)) < len(every)
