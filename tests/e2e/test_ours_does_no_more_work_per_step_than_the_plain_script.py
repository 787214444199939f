"""Per optimizer step our trainer (train.py's, with its guards and callbacks) makes no more
device->host syncs and launches no more kernels than the plain TRL script (bench/baseline.py) on the
same tiny model, data and settings, counted by `python -m bench syncs` (bench/trace/syncs.py). With
float32 adapters (peft.adapter_dtype=float32: master weights that keep updates bf16 would round away;
the default under this bf16 job is bf16, as the baseline's) the only extra kernels are casts to the
compute dtype in the LoRA layers. The trainers' arguments
differ only where ARGS_DIFFER gives a reason. Three training processes: about 4 minutes on 2 cores."""

import pytest

from bench.trace.syncs import ARGS_DIFFER, JOB, count


def _above(ours: dict, base: dict) -> dict:
    return {op: n - base.get(op, 0) for op, n in ours.items() if n > base.get(op, 0)}


@pytest.mark.slow
def test_ours_makes_no_more_syncs_or_kernels_per_step_than_the_plain_script():
    counted = count(JOB, warmup=1, steps=2)
    sides = counted["sides"]
    assert set(counted["args_differ"]) <= set(ARGS_DIFFER), counted["args_differ"]
    base, same_dtype, fp32 = sides["baseline"], sides["ours"], sides["ours-fp32-adapters"]
    for ours in (same_dtype, fp32):
        assert ours["syncs_per_step"] <= base["syncs_per_step"], _above(
            ours["sync_ops_per_step"], base["sync_ops_per_step"]
        )
    assert same_dtype["kernels_per_step"] <= base["kernels_per_step"], _above(
        same_dtype["kernel_ops_per_step"], base["kernel_ops_per_step"]
    )
    extra = _above(fp32["kernel_ops_per_step"], base["kernel_ops_per_step"])
    assert set(extra) <= {"aten._to_copy.default"}, extra
