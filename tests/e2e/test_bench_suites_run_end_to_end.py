"""The benchmark suites run end to end on the CPU: the smoke suite (ours and the baseline), the GPU suite in
shrink mode. No timings are asserted: numbers live in bench/results with their device and date."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from bench import runner


# ---------------------------------------------------------------------------------------------
# Whole suites, end to end on the CPU
# ---------------------------------------------------------------------------------------------
def _run_bench(*args, timeout=900):
    out = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


# What every successful CPU run reports, as a positive float.
MEASURED_ON_CPU = tuple(
    "wall_s cpu_s train_s s_per_step tokens_per_s tokens_per_s_steady peak_gib peak_rss_gib loss_first loss_last".split()
)


def test_smoke_suite_runs_ours_and_the_baseline_and_writes_json_and_markdown(tmp_path):
    readme_before = (REPO / "bench" / "README.md").read_text()
    _run_bench("smoke", "--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work"))
    [path] = (tmp_path / "results").glob("*-smoke.json")
    assert path.name.startswith("cpu-")
    res = json.loads(path.read_text())
    assert res["device"]["name"].startswith("cpu: ") and res["device"]["name"].endswith(" cores")
    assert res["runs"][0]["load_avg_before"] and res["runs"][0]["command"].startswith("python -m bench smoke")
    [stack] = res["stacks"]
    assert stack["name"] == "default" and stack["train_py"].startswith("python train.py")
    for side in ("ours", "baseline"):
        r = stack[side]
        assert r["status"] == "ok", r
        for key in MEASURED_ON_CPU:
            assert isinstance(r[key], float) and r[key] > 0, (side, key, r[key])
        assert r["steps"] == 3 and len(r["runs"]) == 1
        assert stack["plan_error_pct"][side]["headline"] is not None
    assert stack["plan"]["peak_gib"] > 0
    assert set(stack["ratios"]) == set(runner.RATIO_KEYS) and all(v > 0 for v in stack["ratios"].values())
    # Same data, seed and steps: the first loss is the same batch on both sides.
    assert stack["ours"]["loss_first"] == pytest.approx(stack["baseline"]["loss_first"], rel=0.05)
    [timing] = res["timings"]
    assert timing["name"] == "plan-70b" and timing["median_s"] > 0 and timing["pass"] in (True, False)
    assert any(g["claim"].startswith("train.py no more than 5 % slower") for g in res["goals"])
    md = path.with_suffix(".md").read_text()
    assert "| default | ours |" in md and "| default | baseline |" in md and "Ours / baseline" in md
    assert (REPO / "bench" / "README.md").read_text() == readme_before  # smoke never touches the README
    # --resume keeps what the day's results file has (an interrupted run, a device command's time limit)
    out = _run_bench(
        "smoke", "--resume", "--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "w2")
    )
    assert "kept from an earlier run" in out.stdout
    again = json.loads(path.read_text())
    assert len(again["runs"]) == 2 and again["stacks"][0]["ours"]["runs"] == stack["ours"]["runs"]


def _shrink(tmp_path, *extra):
    _run_bench(
        "gpu",
        "--shrink",
        *extra,
        "--results-dir",
        str(tmp_path / "results"),
        "--work-dir",
        str(tmp_path / "work"),
        "--cache",
        str(tmp_path / "cache"),
        timeout=2400,
    )
    [path] = (tmp_path / "results").glob("*-gpu-shrink.json")
    res = json.loads(path.read_text())
    assert res["runs"][0]["shrink"] is True and not res.get("errors")
    return path, res, {s["name"]: s for s in res["stacks"]}


def _check_8b_and_slope(stacks, res, md):
    s8 = stacks["8b-nf4-paged8bit-ckpt"]
    assert s8["ours"]["status"] == "ok" and s8["baseline"]["status"] == "ok" and s8["ratios"]["peak_gib"] > 0
    assert "model.name_or_path=" in s8["train_py"] and "data.format=text" in s8["train_py"]
    for layers in (1, 2):
        assert stacks[f"slope-llama2-70b-L{layers}"]["ours"]["status"] == "ok"
    [slope] = res["slope"]
    fits = {f["quantity"]: f for f in slope["fits"]}
    assert fits["peak_rss_gib"]["at_target"] > 0 and fits["peak_rss_gib"]["planner"] > 0
    assert fits["s_per_step"]["at_target"] is not None and slope["target_layers"] == 4
    assert "Per-layer slope" in md and "SHRINK" in md
    assert any(g["claim"].startswith("70B shape, 4 layers") for g in res["goals"])


def test_gpu_suite_code_path_runs_in_shrink_mode_on_cpu(tmp_path):
    """The GPU suite's 8b and slope stages with small shapes: random-weight models written from the
    figures, loaded by train.py and the baseline through the 4-bit path, the per-layer slope fit."""
    path, res, stacks = _shrink(tmp_path, "--stages", "8b,slope", "--only", "8b-nf4*")
    _check_8b_and_slope(stacks, res, path.with_suffix(".md").read_text())
    assert "8b-mixed-packing" not in stacks  # --only


@pytest.mark.slow
def test_every_gpu_suite_stage_runs_in_shrink_mode_on_cpu(tmp_path):
    """Every stage: also the speed options, the pre-quantized full-depth model, the sequence search and
    the longest-context cases."""
    path, res, stacks = _shrink(tmp_path)
    md = path.with_suffix(".md").read_text()
    _check_8b_and_slope(stacks, res, md)
    assert stacks["8b-mixed-packing"]["ours"]["status"] == "ok"
    assert stacks["8b-mixed-packing-liger"]["status"] == "skipped"  # no liger-kernel (or no stack key) here
    assert stacks["full-llama2-70b-L4-prequantized"]["ours"]["status"] == "ok"
    [seq] = res["seq_search"]
    assert seq["longest_seq"] in (64, 128, 192, 256) and seq["probes"] and seq["verified_full"] is True
    assert "Longest sequence" in md
    assert stacks["long-llama3.1-8b-8gb"]["ours"]["status"] == "ok"  # the recorded longest-context case, shrunk


# ---------------------------------------------------------------------------------------------
# The GPU check (bench/suites/gpu-check.yaml): every part's code path on the CPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_gpu_check_runs_every_part_in_shrink_mode_on_cpu(tmp_path):
    _run_bench(
        "gpu-check",
        "--shrink",
        *("--results-dir", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work")),
        *("--cache", str(tmp_path / "cache")),
        timeout=2400,
    )
    [path] = (tmp_path / "results").glob("*-gpu-check-shrink.json")
    res = json.loads(path.read_text())
    assert not res.get("errors")
    stacks = {s["name"]: s for s in res["stacks"]}
    for s in stacks.values():
        assert s["ours"]["status"] == "ok", (s["name"], s["ours"])
    pair = stacks["8b-nf4-paged8bit-ckpt"]
    assert pair["baseline"]["status"] == "ok" and pair["ratios"]["peak_gib"] > 0
    for side in ("ours", "baseline"):  # one step of each under torch.profiler, its trace beside the results
        prof = pair[side]["runs"][0]["profile"]
        assert prof["step"] == pair["profile_step"] and prof["rows"] and prof["activities"] == ["cpu"]
        assert (path.parent / prof["trace"]).is_file()
    assert "torch.profiler, 8b-nf4-paged8bit-ckpt (baseline)" in path.with_suffix(".md").read_text()
    assert "trainer.gradient_checkpointing=auto" in stacks["8b-ckpt-auto"]["train_py"]
    assert stacks["8b-mixed-padding-free"]["ours"]["token_efficiency"] == pytest.approx(1.0)
    moe = stacks["moe-gpt-oss-20b-16gb-L1"]
    assert "recipe=gpt-oss-20b-16gb" in moe["train_py"] and moe["plan_error_pct"]["ours"]["headline"] is not None
    # the two longest-context cases at 24 and 48 GB, each with expandable segments on and off
    claimed = json.loads((REPO / "bench" / "results" / "longest-context.json").read_text())["cases"]
    lengths = {c["card_gb"]: c["longest_seq"] for c in claimed if c["model"] == "llama3.1-8b"}
    for card in (24, 48):
        for mode, expandable in (("expandable", True), ("fixed", False)):
            s = stacks[f"card-llama3.1-8b-{card}gb-{mode}"]
            assert s["card_gb"] == card and s["claimed_seq"] == lengths[card] and s["seq_len"] == 128
            assert s["expandable_segments"] is expandable and s["card_imposed"] is False
            assert f"trainer.expandable_segments={str(expandable).lower()}" in s["train_py"]
            log = tmp_path / "work" / s["name"] / "ours-0.log"
            assert "the card's size is not imposed" in log.read_text()  # train.py ran under the cap's launcher


def test_gpu_check_part_that_does_not_exist_is_named_with_the_parts_there_are(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench", "gpu-check", "--shrink", "--part", "9", "--results-dir", str(tmp_path / "r")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == "error: no stage in part 9; this suite's parts are 1, 2, 3, 4, 5"
    assert not (tmp_path / "r").exists()  # refused before any results file is written
