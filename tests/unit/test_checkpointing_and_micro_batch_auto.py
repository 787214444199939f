"""trainer.gradient_checkpointing=auto: the fewest checkpointed layers that fit; trainer.micro_batch_size=auto:
the largest micro-batch that fits and divides trainer.grad_accum's rows per step, accumulation adjusted so the
effective batch stays; both resolved by the plan, which records what they resolved to and why."""

import pytest
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.planner.fastest import fits_training, with_batch

GiB = 2**30
EIGHT_B = ("recipe=llama3.1-8b-24gb",)


def _plan(cfg, gpu_gib: float):
    return planner.plan(cfg, gpus=[int(gpu_gib * GiB)], host_ram=128 * GiB, world_size=1, ladder=False)


@pytest.mark.parametrize("gpu_gib", [16, 24])
def test_checkpointing_auto_takes_the_fewest_layers_that_fit(gpu_gib):
    cfg = compose_cfg(*EIGHT_B, "trainer.micro_batch_size=1", "trainer.gradient_checkpointing=auto")
    p = _plan(cfg, gpu_gib)
    n = p["batch_auto"]["trainer.gradient_checkpointing"]
    assert isinstance(n, int) and not isinstance(n, bool) and 0 < n < 32
    assert p["stack"]["gradient_checkpointing"] == n and p["fits"]
    one_less = with_batch(cfg, n - 1)
    assert not fits_training(_plan(one_less, gpu_gib))
    assert any(f"trainer.gradient_checkpointing=auto -> {n} (the first {n} of 32" in x for x in p["notes"])


def test_micro_batch_auto_takes_the_largest_that_fits_and_keeps_the_effective_batch():
    cfg = compose_cfg(*EIGHT_B, "trainer.micro_batch_size=auto", "trainer.grad_accum=16")
    p = _plan(cfg, 40)
    micro, accum = p["stack"]["micro_batch_size"], p["stack"]["grad_accum"]
    assert micro > 1 and micro * accum == 16 == p["effective_batch"]
    next_divisor = min(d for d in (2, 4, 8, 16) if d > micro)
    assert not fits_training(_plan(with_batch(cfg, None, next_divisor, 16 // next_divisor), 40))


def test_a_micro_batch_that_fits_but_does_not_divide_the_rows_is_one_line_and_the_divisor_below():
    cfg = compose_cfg(*EIGHT_B, "trainer.micro_batch_size=auto", "trainer.grad_accum=6")
    peaks = {m: _plan(with_batch(cfg, None, m, 1), 80)["devices"][0]["peak"] for m in (4, 5)}
    gpu = (peaks[4] + peaks[5]) / 2 / GiB / 0.95  # between the two: 4 fits, 5 does not, 4 does not divide 6
    for _ in range(40):
        p = _plan(cfg, gpu)
        line = next(x for x in p["notes"] if x.startswith("trainer.micro_batch_size=auto"))
        if "does not divide" in line:
            break
        gpu *= 1.01 if "-> 3" not in line and "-> 2" in line else 0.99
    assert "does not divide 6 rows" in line, line
    assert p["stack"]["micro_batch_size"] == 3 and p["stack"]["grad_accum"] == 2


def test_both_auto_recompute_fewer_layers_before_a_larger_micro_batch():
    cfg = compose_cfg(
        *EIGHT_B, "trainer.micro_batch_size=auto", "trainer.gradient_checkpointing=auto", "trainer.grad_accum=8"
    )
    p = _plan(cfg, 24)
    auto = p["batch_auto"]
    alone = _plan(compose_cfg(*EIGHT_B, "trainer.micro_batch_size=1", "trainer.gradient_checkpointing=auto"), 24)
    assert auto["trainer.gradient_checkpointing"] == alone["batch_auto"]["trainer.gradient_checkpointing"]
    assert auto["trainer.micro_batch_size"] * auto["trainer.grad_accum"] == 8 and p["fits"]


def test_a_run_takes_the_resolved_values():
    cfg = compose_cfg(
        *EIGHT_B, "trainer.micro_batch_size=auto", "trainer.gradient_checkpointing=auto", "trainer.grad_accum=8"
    )
    p = _plan(cfg, 24)
    settled = planner.settle_batch(cfg, p)
    t = settled.trainer
    assert (t.gradient_checkpointing, t.micro_batch_size, t.grad_accum) == tuple(
        p["batch_auto"][k] for k in ("trainer.gradient_checkpointing", "trainer.micro_batch_size", "trainer.grad_accum")
    )


@pytest.mark.parametrize(
    "overrides,words",
    [
        (("trainer.micro_batch_size=0",), "trainer.micro_batch_size=0 must be a positive number of rows, or auto"),
        (("trainer.micro_batch_size=some",), "trainer.micro_batch_size=some must be a positive number"),
        (("objective=grpo", "trainer.micro_batch_size=auto"), "does not apply to objective=grpo"),
    ],
)
def test_a_micro_batch_that_is_no_count_is_one_line(overrides, words):
    with pytest.raises(UserError) as err:
        check_stack(compose_cfg(*overrides))
    assert words in str(err.value)


def test_plan_fastest_prints_a_stack_that_fits_and_the_line_that_makes_it(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "--fastest", *EIGHT_B, "--gpus", "8GB",
         f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    head = next(x for x in lines if x.startswith("fastest stack that fits --gpus 7.6 GiB: checkpointing"))
    overrides = next(x for x in lines if x.startswith("overrides: ")).split()[1:]
    cfg = compose_cfg(*EIGHT_B, *overrides)
    t = cfg.trainer
    assert t.micro_batch_size * t.grad_accum == 16  # the recipe's 2 x 8 kept
    assert not isinstance(t.gradient_checkpointing, bool) and 0 < t.gradient_checkpointing < 32
    assert "trainer.seq_len" not in " ".join(overrides) and "offload.embeddings=true" in overrides
    assert fits_training(_plan(cfg, 7.6)) and f"the first {t.gradient_checkpointing} of 32 layers" in head
    # one checkpointed layer fewer, with the same options, does not fit
    assert not fits_training(_plan(with_batch(cfg, t.gradient_checkpointing - 1), 7.6))


def test_a_run_resolved_from_the_autos_resumes_with_the_same_autos():
    from qlora_recipes.config.adapters import settled
    from qlora_recipes.run.resume import stack_changes

    saved = settled(  # a run saves its config with every auto resolved
        compose_cfg(*EIGHT_B, "trainer.gradient_checkpointing=14", "trainer.micro_batch_size=2", "trainer.grad_accum=8")
    )
    again = compose_cfg(
        *EIGHT_B, "trainer.gradient_checkpointing=auto", "trainer.micro_batch_size=auto", "trainer.grad_accum=16"
    )
    assert stack_changes(saved, again) == []
    other = compose_cfg(*EIGHT_B, "trainer.micro_batch_size=auto", "trainer.grad_accum=8")  # 8 rows a step, not 16
    assert stack_changes(saved, other) == ["trainer.micro_batch_size"]
