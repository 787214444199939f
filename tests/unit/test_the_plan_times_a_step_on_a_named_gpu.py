"""Time in the plan: `qlora plan --gpus H100` gives seconds per step, tokens/s and, with the run's step
count, its wall time, from a time model (planner/timing.py) whose fitted constants hold every committed
GPU measurement (bench/results, read here, not copied) within TIME_TOLERANCE."""

import json
import math
import subprocess
import sys

import pytest
from conftest import REPO, compose_cfg

from bench import time_fit
from qlora_recipes import planner
from qlora_recipes.config import devices, gpus
from qlora_recipes.errors import UserError
from qlora_recipes.planner import timeplan, timing
from qlora_recipes.planner.spec import spec_from_cfg

GiB = 2**30


@pytest.fixture(scope="module")
def measured_rows():
    return time_fit.all_rows()


def test_every_committed_h100_measurement_is_within_the_tolerance(measured_rows):
    suite, long = measured_rows
    assert len(suite) >= 5 and len(long) >= 5  # every run of the suite file, every long-context row
    rows = time_fit.predictions(suite, long)
    off = [(name, measured, round(predicted, 3)) for name, measured, predicted in rows]
    off = [r for r in off if abs(r[2] / r[1] - 1) > timing.TIME_TOLERANCE]
    assert not off, f"outside {timing.TIME_TOLERANCE:.0%}: {off}"


def test_the_fitted_constants_are_the_searchs_best_point(measured_rows):
    best = time_fit.search(*measured_rows)
    for key in time_fit.SEARCH:
        assert getattr(timing, key) == best[key], key
    assert timing.WARMUP_SECONDS == pytest.approx(time_fit.warmup_seconds(), abs=0.01)


def test_the_docs_show_every_checked_cards_run_as_the_model_predicts_it():
    """Later cards' runs (the H200's) set no constant: the page shows each against the plan's own time."""
    preds = time_fit.checked_predictions(time_fit.all_checked_rows())
    assert len(preds) >= 15  # every run of every stack of the H200 file
    page = (REPO / "docs" / "memory-and-planner.md").read_text()
    for row in time_fit.checked_markdown_rows(preds):
        assert row in page, row
    within = sum(abs(p / m - 1) <= timing.TIME_TOLERANCE for _, _, m, p in preds)
    assert f"{within} of {len(preds)} are within {100 * timing.TIME_TOLERANCE:g} %" in " ".join(page.split())


def test_plan_command_prints_the_time_on_a_named_gpu_and_writes_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "--gpus", "H100", "recipe=llama3.1-8b-24gb",
         "trainer.max_steps=200", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("time on H100: "))
    section = json.loads((tmp_path / "plan.json").read_text())["time"]
    assert f"{section['s_per_step']:.2f} s/step" in line and f"{section['tokens_per_s']:,.0f} tokens/s" in line
    assert section["steps"] == 200 and section["wall_s"] == pytest.approx(
        200 * section["s_per_step"] + timing.WARMUP_SECONDS
    )
    assert any(ln.startswith("wall time: ") and "200 steps" in ln for ln in proc.stdout.splitlines())
    assert "fitted_on" in section["constants"] and "nvidia-h100" in section["constants"]["fitted_on"]
    # the card's memory is the budget, as --gpus 80GB plans it
    assert "79.0 GiB" in proc.stdout and "budget" in proc.stdout


def test_an_unknown_gpu_name_is_one_line_listing_the_known_ones(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "--gpus", "2xH1000", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'H1000' is not a GPU we know" in lines[0]
    assert all(card.name in lines[0] for card in gpus.CARDS)
    assert not (tmp_path / "plan.json").exists()


def test_a_card_name_plans_that_cards_memory_and_counts():
    assert devices.parse_gpus("H100") == devices.parse_gpus("80GB")
    assert devices.parse_gpus("a100-40gb") == devices.parse_gpus("40GB")  # case does not matter
    named = devices.parse_gpu_cards("2xH100")
    assert [size for size, _ in named] == devices.parse_gpus("2x80GB") and {c.name for _, c in named} == {"H100"}
    assert [c for _, c in devices.parse_gpu_cards("24GB")] == [None]  # a plain size names no card
    assert devices.parse_gpus("H200")[0] > devices.parse_gpus("80GB")[0]
    with pytest.raises(UserError, match="not a GPU we know; name one of H100, "):
        devices.parse_gpus("B300")


def test_a_plain_size_says_in_one_line_that_a_time_needs_a_card():
    cfg = compose_cfg("model=llama3.1-8b", "trainer=standard", "data.metric=null")
    plan = planner.plan(cfg, gpus=[24 * GiB], host_ram=64 * GiB)
    section = timeplan.time_section(cfg, plan, [None], [24 * GiB])
    assert timeplan.time_lines(section) == [timeplan.NAME_A_GPU]
    assert all(card.name in timeplan.NAME_A_GPU for card in gpus.CARDS)


def _time(card: str, *overrides: str) -> dict:
    cfg = compose_cfg("model=llama3.1-8b", "trainer=standard", "data.metric=null", *overrides)
    sizes = [size for size, _ in devices.parse_gpu_cards(card)]
    plan = planner.plan(cfg, gpus=sizes, host_ram=256 * GiB)
    return timeplan.time_section(cfg, plan, [c for _, c in devices.parse_gpu_cards(card)], sizes)


def test_cards_differ_by_their_datasheet_figures_and_ranks_share_the_tokens():
    h100, h200, a100, l4 = (_time(c)["s_per_step"] for c in ("H100", "H200", "A100-40GB", "L4"))
    assert h200 < h100 < a100 < l4  # H200: the H100's FLOPs, more bandwidth
    one = _time("H100", "dist=ddp", "hardware.gpus=1")
    two = _time("2xH100", "dist=ddp", "hardware.gpus=2")
    assert two["tokens_per_s"] > 1.8 * one["tokens_per_s"]  # per-rank tokens, plus the adapters' all-reduce
    assert two["terms_s"]["collectives"] > 0 == one["terms_s"]["collectives"]


def test_checkpointing_costs_a_forward_and_moe_counts_its_active_experts():
    cfg = compose_cfg("model=llama3.1-8b", "trainer=standard", "data.metric=null", "trainer.micro_batch_size=1")
    on = timing.micro_batch_work(spec_from_cfg(cfg, 1))
    cfg.trainer.gradient_checkpointing = False
    off = timing.micro_batch_work(spec_from_cfg(cfg, 1))
    assert off.matmul_flops < on.matmul_flops and off.ops < on.ops
    moe = compose_cfg("model=qwen3-30b-a3b", "trainer=standard", "data.metric=null", "trainer.micro_batch_size=1")
    st = spec_from_cfg(moe, 1)
    every_expert = 2 * sum(bb.params_quantized for blk, bb in timing.block_bytes(st) if blk.is_layer) * st.seq_len
    assert timing.micro_batch_work(st).matmul_flops < every_expert  # 3 passes of the active ones < 1 of all


def test_a_local_dataset_gives_the_runs_steps_and_wall_time(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(100)))
    section = _time(
        "L4", f"data.path={data}", "data.format=text", "data.eval_fraction=0.1", "trainer.epochs=2",
        "trainer.micro_batch_size=4", "trainer.grad_accum=4", "trainer.max_steps=-1",
    )  # fmt: skip
    per_epoch = math.ceil(math.ceil(90 / 4) / 4)  # 90 train rows, micro-batches of 4, 4 accumulated
    assert section["steps"] == 2 * per_epoch and "90 train rows" in section["steps_from"]
    assert section["wall_s"] == pytest.approx(section["steps"] * section["s_per_step"] + timing.WARMUP_SECONDS)
    hub = _time("L4", "data=alpaca", "trainer.max_steps=-1")
    assert "wall_s" not in hub and "data.path" in hub["wall_omitted"]


def test_the_docs_table_and_constants_are_the_time_models(measured_rows):
    page = (REPO / "docs" / "memory-and-planner.md").read_text()
    for row in time_fit.markdown_rows(time_fit.predictions(*measured_rows)):
        assert row in page, row
    said = (
        f"the matmuls reach {timing.MATMUL_EFFICIENCY:g} of the peak, flash attention {timing.ATTENTION_EFFICIENCY:g}",
        f"(a dense block-diagonal mask; its one row) {timing.PACKED_ATTENTION_EFFICIENCY:g}, a module call costs "
        f"{timing.OP_SECONDS * 1e6:g} us, each kept byte moves {timing.ELEMENTWISE_TRAFFIC:g}",
        f"median warm-up,\n{timing.WARMUP_SECONDS:g} s",
        f"every row is within {100 * timing.TIME_TOLERANCE:g} %",
    )
    flat = " ".join(page.split())
    for words in said:
        assert " ".join(words.split()) in flat, words


def test_a_card_without_bf16_plans_fp16_and_times_the_default_stack(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "--gpus", "T4", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "precision=auto: fp16" in proc.stdout and "planned for: --gpus T4 14.5 GiB" in proc.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["stack"]["dtype"] == "float16" and plan["time"]["gpu"] == "T4"
    assert plan["time"]["s_per_step"] > 0 and "seq_len_auto" in plan  # timed at what auto was planned at


def test_offloaded_layers_cost_their_host_link_and_mixed_cards_get_no_time():
    cfg = compose_cfg("recipe=llama2-70b-24gb-disk", "data.metric=null")
    sizes = devices.parse_gpus("RTX-4090")
    plan = planner.plan(cfg, gpus=sizes, host_ram=128 * GiB)
    offloaded = timeplan.time_section(cfg, plan, [gpus.card("RTX-4090")], sizes)
    link = offloaded["terms_s"]["host_link"]
    assert link > offloaded["terms_s"]["matmul_and_attention"]  # the layers on disk and in RAM, every pass
    mixed = timeplan.time_section(cfg, plan, [gpus.card("RTX-4090"), None], sizes * 2)
    assert "differ" in mixed["omitted"] and timeplan.time_lines(mixed)[0].startswith("time: not estimated")


def test_partly_checkpointed_and_auto_batches_are_timed_as_planned():
    base = ("model=llama3.1-8b", "trainer=standard", "data.metric=null", "trainer.micro_batch_size=1")
    flops = [
        timing.micro_batch_work(
            spec_from_cfg(compose_cfg(*base, f"trainer.gradient_checkpointing={v}"), 1)
        ).matmul_flops
        for v in ("false", "16", "true")
    ]
    assert flops[0] < flops[1] < flops[2]  # the first 16 of 32 layers recompute
    cfg = compose_cfg(*base[:3], "trainer.gradient_checkpointing=auto", "trainer.micro_batch_size=auto")
    sizes = devices.parse_gpus("H100")
    plan = planner.plan(cfg, gpus=sizes, host_ram=256 * GiB)
    section = timeplan.time_section(cfg, plan, [gpus.card("H100")], sizes)
    assert section["tokens_per_s"] * section["s_per_step"] == pytest.approx(plan["tokens_per_step"])
