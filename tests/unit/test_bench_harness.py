"""The benchmark harness: statistics, models with random weights, the baseline's job, goals and the
results' markdown. The suites run end to end in e2e/test_bench_suites_run_end_to_end.py."""

import json
import sys

import pytest
from conftest import REPO, compose_cfg

from bench import goals, machine, models, planning, report, runner, stats, suite


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------
def test_fit_line_recovers_an_exact_line():
    fit = stats.fit_line([2, 4, 8], [3 + 0.5 * x for x in (2, 4, 8)])
    assert fit["slope"] == pytest.approx(0.5) and fit["intercept"] == pytest.approx(3.0)
    assert fit["r2"] == pytest.approx(1.0) and fit["max_abs_residual"] == pytest.approx(0.0, abs=1e-12)


def test_extrapolate_layers_to_80_with_synthetic_70b_numbers():
    # 0.45 GiB per layer (NF4 weights + adapters + checkpointed input) over a 2.8 GiB constant.
    per_layer, constant = 0.45, 2.8
    points = {2: constant + 2 * per_layer, 4: constant + 4 * per_layer, 8: constant + 8 * per_layer}
    ex = stats.extrapolate_layers(points, 80)
    assert ex["per_layer"] == pytest.approx(per_layer)
    assert ex["constant"] == pytest.approx(constant)
    assert ex["at_target"] == pytest.approx(constant + 80 * per_layer)
    assert ex["points"] == {"2": pytest.approx(3.7), "4": pytest.approx(4.6), "8": pytest.approx(6.4)}
    # Noise shows in r2 and the residual, and the prediction stays close.
    noisy = stats.extrapolate_layers({2: 3.72, 4: 4.58, 8: 6.41}, 80)
    assert noisy["r2"] < 1 and noisy["max_abs_residual"] > 0
    assert noisy["at_target"] == pytest.approx(38.8, rel=0.02)
    # None values (a failed run) are left out; fewer than 2 points is an error.
    assert stats.extrapolate_layers({2: 3.7, 4: None, 8: 6.4}, 80)["at_target"] == pytest.approx(38.8)
    with pytest.raises(ValueError):
        stats.extrapolate_layers({2: 3.7}, 80)
    with pytest.raises(ValueError):
        stats.fit_line([4, 4], [1.0, 2.0])


def test_steady_step_time_skips_warmup_steps():
    ends = {1: 5.0, 2: 7.0, 3: 8.0, 4: 9.0, 5: 10.5}  # step 1 ends at 5 s (load), then 2, 1, 1, 1.5 s
    assert stats.steady_step_s(ends, warmup=2) == pytest.approx(3.5 / 3)  # steps 3, 4, 5
    assert stats.steady_step_s(ends, warmup=1) == pytest.approx(5.5 / 4)  # steps 2..5
    assert stats.steady_step_s({1: 5.0}, warmup=1) is None
    # train.py logs every trainer.memory_log_steps steps (and the last): the interval starts at the
    # first logged step at or after the warm-up.
    assert stats.steady_step_s({5: 3.0, 10: 4.0, 15: 5.0, 17: 5.4}, warmup=4) == pytest.approx(2.4 / 12)
    assert stats.steady_step_s({5: 3.0, 10: 4.0}, warmup=10) is None


def test_errors_and_ratios():
    assert stats.pct_error(11.0, 10.0) == pytest.approx(10.0)
    assert stats.pct_error(9.0, 10.0) == pytest.approx(-10.0)
    assert stats.pct_error(None, 1.0) is None and stats.ratio(1.0, 0) is None
    assert stats.median([3, None, 1, 2, float("nan")]) == 2
    # GPU: the plan includes the CUDA context (not in max_memory_reserved) and allocator overhead
    # (not in max_memory_allocated either).
    plan = {"peak_gib": 12.0, "cuda_context_gib": 1.0, "allocator_overhead_gib": 0.5}
    gpu = planning.plan_errors(plan, {"status": "ok", "peak_reserved_gib": 11.0, "peak_allocated_gib": 10.5}, gpu=True)
    assert gpu["vs_reserved"] == pytest.approx(0.0) and gpu["vs_allocated"] == pytest.approx(0.0)
    cpu = planning.plan_errors({"peak_gib": 0.6}, {"status": "ok", "peak_rss_gib": 0.5}, gpu=False)
    assert cpu["headline"] == pytest.approx(20.0)
    assert planning.plan_errors(plan, {"status": "error"}, gpu=True) == {}
    # The planner's figure a slope fit compares with each measured quantity.
    assert planning.comparable(plan, "peak_reserved_gib") == 11.0 and planning.comparable(plan, "peak_rss_gib") == 12.0
    assert planning.comparable(plan, "peak_allocated_gib") == 10.5 and planning.comparable(plan, "s_per_step") is None


def test_run_child_measures_the_child_alone(tmp_path):
    busy = machine.busy_cpu_seconds()
    assert busy is None or busy > 0
    child = runner.run_child([sys.executable, "-c", "x = bytearray(200 * 2**20); print('ok')"], tmp_path / "c.log")
    assert child["rc"] == 0 and child["peak_rss_gib"] > 0.18 and child["wall_s"] > 0 and child["cpu_s"] > 0
    assert child["others_cores"] is None or child["others_cores"] >= 0
    assert "ok" in (tmp_path / "c.log").read_text()
    slow = runner.run_child([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log", timeout_s=1)
    assert slow["timed_out"] and slow["rc"] != 0 and slow["wall_s"] < 20


def test_search_longest_is_a_bounded_binary_search():
    calls = []

    def fits(seq):
        calls.append(seq)
        return seq <= 5000

    assert stats.search_longest(2048, 65536, 1024, fits, 64) == 4096
    assert len(calls) <= 1 + 6  # lo, then log2(63) halvings
    assert stats.search_longest(2048, 65536, 1024, lambda s: False, 64) is None
    # Out of probes: the best known answer so far, never one that was not shown to fit.
    calls.clear()
    got = stats.search_longest(2048, 65536, 1024, fits, 2)
    assert len(calls) == 2 and got is not None and got <= 4096


def test_stack_matrix_expands_to_every_pair():
    stacks = suite.expand_stacks(
        [
            {
                "matrix": {"quant": ["nf4", "int8"], "optim": ["adamw", "paged8bit"]},
                "name": "{quant}-{optim}",
                "baseline": True,
            }
        ]
    )
    assert [s["name"] for s in stacks] == ["nf4-adamw", "nf4-paged8bit", "int8-adamw", "int8-paged8bit"]
    assert stacks[1]["overrides"] == ["quant=nf4", "optim=paged8bit"] and stacks[1]["baseline"]


def test_shipped_suites_load_and_compose():
    cpu = suite.load_suite("cpu", shrink=False)
    names = [s["name"] for s in suite.expand_stacks(cpu["stacks"])]
    assert "default" in names and len(names) == 1 + 4 * 5
    for s in suite.expand_stacks(cpu["stacks"]):
        compose_cfg(*cpu["job"], *s["overrides"])  # every stack of the CPU suite is a valid config
    gpu = suite.load_suite("gpu", shrink=True)
    assert set(gpu["stages"]) == {"8b", "slope", "full", "seq", "long"}
    assert gpu["stages"]["slope"]["layers"] == [1, 2] and "trainer.seq_len=128" in gpu["job"]
    real = suite.load_suite("gpu", shrink=False)
    assert real["stages"]["slope"]["layers"] == [2, 4, 8] and real["stages"]["slope"]["target_layers"] == 80


# ---------------------------------------------------------------------------------------------
# The baseline's job and models with random weights
# ---------------------------------------------------------------------------------------------
def test_baseline_argv_is_the_same_job(tmp_path):
    cfg = compose_cfg(
        "trainer=smoke",
        "trainer.max_steps=7",
        "optim=adamw8bit",
        "peft.r=8",
        "quant=fp4",
        "trainer.gradient_checkpointing=false",
        "data.packing=true",
    )
    argv = runner.baseline_argv(cfg, tmp_path / "out", tmp_path / "m.json")
    assert argv[1:3] == ["-m", "bench.baseline"]
    args = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert args["--steps"] == "7" and args["--batch"] == str(cfg.trainer.micro_batch_size)
    assert args["--seq-len"] == str(cfg.trainer.seq_len) and args["--optim"] == cfg.optim.name
    assert args["--quant"] == "fp4" and args["--r"] == "8" and float(args["--lr"]) == cfg.optim.lr
    assert args["--model"] == cfg.model.name_or_path and args["--data"] == cfg.data.path
    assert "--no-gradient-checkpointing" in argv and "--packing" in argv
    assert cfg.model.attn_implementation == "sdpa_varlen" and args["--attn"] == "sdpa"  # plain TRL has no varlen
    with pytest.raises(ValueError):
        runner.baseline_argv(compose_cfg("peft=dora"), tmp_path, tmp_path / "m.json")


def test_baseline_script_imports_nothing_of_ours():
    text = (REPO / "bench" / "baseline.py").read_text()
    assert "qlora_recipes" not in text.replace("imports nothing from this repository", "")
    assert "from bench" not in text and "import bench" not in text
    for needed in ("BitsAndBytesConfig", "prepare_model_for_kbit_training", "get_peft_model", "SFTTrainer"):
        assert needed in text


TINY_FIG = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 96,
    "tie_embeddings": False,
    "max_position_embeddings": 512,
    "head_dim": 16,
}


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_random_model_loads_through_the_real_4bit_path(tmp_path, quantize):
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    out = models.build_random_model(TINY_FIG, tmp_path / "m", quantize=quantize)
    assert len(list(out.glob("model-*.safetensors"))) == 1 + TINY_FIG["num_layers"]  # one shard per layer
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == TINY_FIG["vocab_size"]
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=q, dtype=torch.bfloat16, device_map={"": "cpu"}
    )
    assert isinstance(model.model.layers[1].mlp.down_proj, bnb.nn.Linear4bit)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    ids = tok(["w5 w6 w7 w8"], return_tensors="pt")["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    # The same figures again: the build is reused, not rewritten.
    stamp = (out / "bench-model.json").stat().st_mtime_ns
    models.build_random_model(TINY_FIG, out, quantize=quantize)
    assert (out / "bench-model.json").stat().st_mtime_ns == stamp
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert size == pytest.approx(models.model_disk_bytes(TINY_FIG, quantize), rel=0.2)


def test_text_data_lengths(tmp_path):
    path = models.write_text_data(tmp_path / "d.jsonl", 100, rows=50, min_words=8, max_words=64)
    rows = [json.loads(line)["text"].split() for line in path.read_text().splitlines()]
    assert len(rows) == 50 and all(8 <= len(r) <= 64 for r in rows) and len({len(r) for r in rows}) > 5
    assert all(4 <= int(w[1:]) < 100 for r in rows for w in r)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _fake_results():
    ok = {
        "status": "ok",
        "n": 1,
        "wall_s": 10.0,
        "train_s": 5.0,
        "s_per_step": 0.1,
        "tokens_per_s": 100.0,
        "tokens_per_s_steady": 120.0,
        "peak_gib": 0.6,
        "peak_rss_gib": 0.6,
        "loss_first": 3.0,
        "loss_last": 1.0,
    }
    return {
        "suite": "cpu",
        "date": "2026-01-01",
        "device": {"kind": "cpu", "name": "cpu: Test CPU, 2 cores", "slug": "cpu-test-cpu-2-cores"},
        "runs": [{"command": "python -m bench cpu", "started": "t", "load_avg_before": [0.1, 0.2, 0.3]}],
        "environment": {"torch": "x"},
        "settings": {"steps": 30, "warmup_steps": 5, "repeats": 1},
        "stacks": [
            {
                "name": "default",
                "status": "ok",
                "plan": {"peak_gib": 0.62},
                "ours": dict(ok),
                "baseline": {**ok, "wall_s": 9.8},
                "ratios": runner.ratios({**ok}, {**ok, "wall_s": 9.8}),
                "plan_error_pct": {"ours": {"headline": 3.3}, "baseline": {"headline": 3.3}},
            },
            {"name": "liger", "status": "skipped", "reason": "liger_kernel not installed"},
        ],
        "timings": [
            {
                "name": "plan-70b",
                "command": "python scripts/plan.py",
                "runs_s": [2.0],
                "median_s": 2.0,
                "goal_s": 5,
                "pass": True,
            }
        ],
        "slope": [],
        "seq_search": [],
        "goals": [],
    }


def test_goals_and_markdown_from_results():
    res = _fake_results()
    cpu_goals = goals.goals_cpu(res, {})
    by = {g["claim"].split(" (")[0]: g for g in cpu_goals}
    assert by["train.py no more than 5 % slower than the baseline"]["pass"] is True  # 10.0 / 9.8 = 1.02
    assert any(g["claim"].startswith("plan-70b") and g["pass"] for g in cpu_goals)
    res["goals"] = cpu_goals
    md = report.render_markdown(res)
    for text in (
        "cpu: Test CPU, 2 cores",
        "| default | ours |",
        "| default | baseline |",
        "skipped: liger_kernel",
        "Ours / baseline",
        "| plan-70b |",
        "load average",
        "| goal |",
        "1.020",
    ):
        assert text in md, text


def test_gpu_goals_and_sections_from_results():
    res = _fake_results()
    res["device"] = {"kind": "cuda", "name": "NVIDIA Test", "slug": "nvidia-test"}
    peak = {"status": "ok", "peak_allocated_gib": 6.1, "peak_reserved_gib": 6.5, "tokens_per_s_steady": 900.0}
    res["stacks"] = [
        {"name": "8b-nf4-paged8bit-ckpt", "ours": peak},
        {
            "name": "8b-mixed",
            "ours": {**peak, "tokens_per_s_steady": 1000.0},
            "baseline": {"tokens_per_s_steady": 500.0},
        },
        {"name": "8b-mixed-packing", "ours": {**peak, "tokens_per_s_steady": 2000.0}},
        {"name": "full-llama2-70b-L80-prequantized", "ours": {**peak, "peak_reserved_gib": 38.0}},
    ]
    fit = {"quantity": "peak_reserved_gib", "per_layer": 0.45, "constant": 2.8, "r2": 1.0, "at_target": 38.8}
    res["slope"] = [{"name": "slope-llama2-70b", "layers": [2, 4, 8], "target_layers": 80, "fits": [fit]}]
    probe = {"seq_len": 4096, "fits": True, "peak_gib": 60.0, "note": "extrapolated"}
    res["seq_search"] = [{"name": "seq-llama2-70b", "mode": "m", "longest_seq": 4096, "probes": [probe]}]
    by = {g["claim"].split(":")[0].split(",")[0]: g for g in goals.goals_gpu(res, {})}
    assert by["8B (Llama-3.1-8B shape)"]["pass"] is True  # 6.1 GiB allocated
    assert by["8B tokens/s"]["measured"] == "4.00× (8b-mixed-packing)" and by["8B tokens/s"]["pass"]
    assert by["70B shape"]["pass"] is True and by["full-llama2-70b-L80-prequantized"]["pass"] is True
    assert by["longest sequence the 70B shape trains at here (seq-llama2-70b)"]["measured"].startswith("4096")
    md = report.render_markdown(res)
    assert "Per-layer slope: slope-llama2-70b (layers 2, 4, 8 → 80)" in md and "| 4096 | yes | 60.00 |" in md


def test_notes_of_a_run_and_of_a_stack_are_printed_beside_their_figures():
    """Figures copied back from a lent GPU and merged by hand say what their reader needs (the commit
    they ran, a peak that is not the training step's) in the markdown, not only in the JSON."""
    res = _fake_results()
    res["runs"] = [{"command": "python -m bench gpu-check --part 1", "note": "git abc1234: bf16 adapters"}]
    res["stacks"] = [{"name": "moe-slice", "ours": {"status": "ok"}, "note": "the peak is the loading warm-up"}]
    md = report.render_markdown(res)
    assert "`python -m bench gpu-check --part 1` at None" in md and "; git abc1234: bf16 adapters" in md
    assert "Notes:\n- moe-slice: the peak is the loading warm-up" in md


def test_readme_keeps_one_latest_section_per_device(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\n<!-- RESULTS -->\n\nmore text\n")
    res = _fake_results()
    report.update_readme(readme, res, "first table\n", "results/a.json")
    report.update_readme(readme, res, "second table\n", "results/b.json")
    text = readme.read_text()
    assert text.count("BEGIN cpu-test-cpu-2-cores:cpu") == 1 and "second table" in text and "first" not in text
    assert text.endswith("more text\n")


def test_steady_tokens_per_s_counts_the_timed_steps_own_tokens():
    """Rows of mixed lengths: the timed steps (4 and 5 here) trained 900 tokens, while the run's mean
    per step (2,000 / 5) would credit them with 800."""
    ends = {1: 5.0, 2: 6.0, 3: 7.0, 4: 8.0, 5: 9.0}
    tokens = {1: 500.0, 2: 900.0, 3: 1100.0, 4: 1400.0, 5: 2000.0}
    assert stats.steady_tokens_per_s(ends, tokens, warmup=3) == pytest.approx(900 / 2)
    assert stats.steady_tokens_per_s(ends, {1: 500.0, 5: 2000.0}, warmup=3) is None  # step 3 not counted


def test_a_run_record_keeps_each_steps_end_and_tokens_from_its_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"status": "ok", "steps": 4, "train_s": 10.0, "tokens_per_s": 200.0}))
    ends = {1: 4.0, 2: 5.0, 3: 7.0, 4: 8.0}
    (run / "memory.jsonl").write_text("".join(json.dumps({"step": k, "t_s": t}) + "\n" for k, t in ends.items()))
    writer = SummaryWriter(str(run / "tb"))
    for step, tokens in {1: 100, 2: 900, 3: 1200, 4: 2000}.items():
        writer.add_scalar("train/num_tokens", tokens, step)
    writer.close()
    child = {"rc": 0, "wall_s": 12.0, "peak_rss_gib": 1.0, "log": str(tmp_path / "log")}
    rec = runner.read_ours(run, child, warmup=2, gpu=False)
    assert rec["step_end_s"] == {"1": 4.0, "2": 5.0, "3": 7.0, "4": 8.0}
    assert rec["step_tokens"] == {"1": 100.0, "2": 900.0, "3": 1200.0, "4": 2000.0}
    assert rec["s_per_step"] == pytest.approx(1.5)  # steps 3 and 4, from the end of step 2
    assert rec["tokens_per_s_steady"] == pytest.approx((2000 - 900) / 3.0)
