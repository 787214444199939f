"""The tracer (bench/trace): a real training step on fake tensors, counted by torch's MemTracker.

Fast: the pieces that need no traced process, and traces of tiny models on the fake CUDA device,
each in a child forked from one server process (tests/helpers_forkserver.py). Slow (`make
test-all`): layer slices scaled to a full trace, a small model's trace against its plan, and fake
tensors against real ones on the CPU.
"""

from __future__ import annotations

import inspect
import shutil

import pytest
from helpers_forkserver import tracer

from qlora_recipes.units import GiB

SMALL = [  # a small Llama (yaml figures: the name is no local dir), 6 layers, GQA, 2 x 256 tokens
    "model.name_or_path=trace-test-llama",
    "model.hub_id=trace-test-llama",  # the figures below are this name's: no config.json is looked up
    "model.hidden_size=256",
    "model.num_layers=6",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=688",
    "model.vocab_size=4000",
    "trainer.micro_batch_size=2",
    "trainer.seq_len=256",
]


def test_fused_head_outputs_are_sfttrainers():
    from trl import SFTTrainer

    from bench.trace.model import SFT_FUSED_OUTPUTS

    source = "".join(inspect.getsource(SFTTrainer.__init__).split())
    assert "outputs=(" + ",".join(f'"{o}"' for o in SFT_FUSED_OUTPUTS) + ")" in source


def test_preload_refuses_once_torch_is_imported():
    import torch  # noqa: F401 - the point: torch is already here

    from bench.trace import fakecuda

    with pytest.raises(RuntimeError, match="before torch"):
        fakecuda.preload()


def test_extrapolation_is_affine_per_phase():
    from bench.trace.run import extrapolate

    def result(layers: int) -> dict:
        static = {"quantized_weights": 100 + 10 * layers, "lora_weights": 2 * layers}
        phases = {
            "cuda:0|forward": {"total": 1000 + 50 * layers, "components": {"activations": 50 * layers}},
            "cuda:0|backward": {
                "total": 1400 + 55 * layers,
                "components": {"layer_working": 400, "activations": 55 * layers},
            },
        }
        return {"layers_traced": layers, "phases": phases, "static": {"cuda:0": static}}

    out = extrapolate(result(2), result(3), 32)
    assert out["phases"]["cuda:0|backward"]["total"] == 1400 + 55 * 32
    assert out["phases"]["cuda:0|backward"]["components"] == {"layer_working": 400, "activations": 55 * 32}
    assert out["peak"]["cuda:0"] == 1400 + 55 * 32 and out["peak_phase"]["cuda:0"] == "backward"
    assert out["static"]["cuda:0"]["quantized_weights"] == 100 + 10 * 32


def test_suite_covers_every_single_gpu_recipe_and_lean_option():
    from bench.trace.suite import LEAN, LEAN_BASES, cases, single_gpu_recipes

    names = [c["case"] for c in cases()]
    recipes = single_gpu_recipes()
    assert "llama3.1-8b-24gb" in recipes and "llama3.1-70b-2x24gb" not in recipes and "tiny-cpu" not in recipes
    for r in recipes:
        assert f"recipe {r}" in names
    for base in LEAN_BASES:
        for option in LEAN:
            assert f"{base} + {option}" in names


def test_slices_for_offloading_cover_trls_forward_stash():
    from conftest import compose_cfg

    from bench.trace.run import slice_layers
    from qlora_recipes.planner.constants import TRL_OFFLOAD_FWD_STASH

    assert slice_layers(compose_cfg("recipe=llama3.1-8b-24gb")) == (2, 3)
    k, _ = slice_layers(compose_cfg("recipe=llama3.1-8b-24gb", "trainer.activation_offloading=true"))
    assert k > TRL_OFFLOAD_FWD_STASH
    assert slice_layers(compose_cfg()) is None  # the 2-layer tiny model is traced whole


def test_split_extrapolation_is_affine_in_both_counts():
    """Offloading recipes: three slices (k GPU + m offloaded layers, one more of each) give every
    phase at G GPU and O offloaded layers exactly when each count adds its own bytes per layer."""
    from bench.trace.offload import extrapolate_split

    def result(g: int, o: int) -> dict:
        comps = {"quantized_weights": 7 * g, "lora_weights": 3 * (g + o), "offload_staging": 900}
        phases = {"cuda:0|backward": {"total": 2000 + 7 * g + 3 * (g + o) + 900, "components": comps}}
        return {"offload_split": [g, o], "phases": phases, "static": {"cuda:0": {"lora_weights": 3 * (g + o)}}}

    out = extrapolate_split(result(2, 1), result(3, 1), result(2, 2), 63, 21)
    assert out["phases"]["cuda:0|backward"]["total"] == 2000 + 7 * 63 + 3 * 84 + 900
    assert out["peak_components"]["cuda:0"] == {
        "quantized_weights": 7 * 63,
        "lora_weights": 3 * 84,
        "offload_staging": 900,
    }
    assert out["static"]["cuda:0"]["lora_weights"] == 3 * 84


def test_offloading_recipes_are_sliced_as_their_plan_places_them():
    """llama3.1-70b-48gb offloads its last layers to host RAM: the slices keep that split, the LM
    head on the GPU (the planner pins it: TRL's fused head reads its weight outside the offload hook)."""
    from bench.trace.offload import offloaded_counts, slice_map
    from bench.trace.run import plan_for, recipe_gpus

    overrides = ["recipe=llama3.1-70b-48gb"]
    plan = plan_for(overrides, recipe_gpus(overrides))
    gpu, off = offloaded_counts(plan)
    assert gpu + off == 80 and off > 0
    assert plan["device_map"]["lm_head"] == 0 and plan["device_map"]["model.norm"] == "cpu"
    dmap = slice_map(plan, 2, 1)
    assert [dmap[f"model.layers.{i}"] for i in range(3)] == [0, 0, "cpu"]
    assert dmap["lm_head"] == 0 and dmap["model.embed_tokens"] == 0 and dmap["model.norm"] == "cpu"


def _can_build() -> bool:
    from bench.trace import fakecuda

    if fakecuda.library_path().is_file():
        return True
    return bool(shutil.which("c++") or shutil.which("g++")) and bool(shutil.which("ninja"))


needs_fake_cuda = pytest.mark.skipif(
    not _can_build(), reason="the fake CUDA device is built once with a C++ compiler and ninja"
)


# precision pinned: precision=auto picks by the device, and the fake CUDA device and the plan's
# declared GPU need not agree with this CPU's bf16 support (the trace and the plan must be one stack)
TINY = ["trainer.micro_batch_size=4", "trainer.seq_len=32", "precision=bf16"]


@pytest.fixture(scope="module")
def traced():
    """traced(spec): run_child(spec) for a spec on the fake CUDA device, in a child forked from one
    server that imported the tracer's libraries once (a fresh Python spent most of a trace on them)."""
    with tracer() as trace:
        yield trace


@pytest.fixture(scope="module")
def tiny_trace(traced):
    return traced({"overrides": TINY, "device": "cuda"})


@needs_fake_cuda
def test_tiny_trace_on_the_fake_cuda_device(tiny_trace):
    """The whole path on the tiny model: the static rows are exactly the plan's, every phase ran, and
    the GPU's kernel choices were taken (SDPA without the math path, 4-bit matmuls, the compact head)."""
    from bench.trace.run import compare, plan_for

    r = tiny_trace
    dev = "cuda:0"
    assert r["device"] == "cuda" and r["fake"] and set(r["peak"]) == {dev}
    assert {"forward", "loss", "backward", "optimizer"} <= {k.split("|")[1] for k in r["phases"]}
    plan = plan_for(TINY, [24 * GiB])
    static = r["static"][dev]
    for row in ("other_params", "lora_weights"):
        assert static[row] == plan["components"][row][dev], row
    # the 4-bit rows: six tensors per linear (packed data, uint8 absmax, its fp32 absmax, offset, two
    # codes), each rounded up to the CUDA allocator's 512-byte blocks (as memory_allocated counts them)
    linears = 7 * 2
    assert 0 <= static["quantized_weights"] - plan["components"]["quantized_weights"][dev] < 6 * 512 * linears
    assert r["kernels"]["attention"] and "math" not in r["kernels"]["attention"]
    assert r["kernels"]["ops"].get("gemm_4bit fused") and r["kernels"]["ops"].get("bool index")
    assert r["optimizer"] == "AdamW"  # paged_adamw_8bit's state (bitsandbytes, unpaged for the trace)
    assert r["peak"][dev] > sum(static.values())
    cmp = compare(r, plan, dev)  # the tiny stack's plan peaks in eval (generation), which is not traced
    assert 0.8 < cmp["traced_gib"] / cmp["planned_train_gib"] < 1.25, cmp


@pytest.mark.slow
@needs_fake_cuda
def test_layer_slices_scale_exactly_to_a_full_trace():
    from bench.trace.run import trace_stack

    full = trace_stack(SMALL, layers="full")
    sliced = trace_stack(SMALL, layers=2)
    assert sliced["sliced"] and not full["sliced"]
    for key, phase in full["phases"].items():
        assert sliced["phases"][key]["total"] == phase["total"], key
    assert sliced["peak"] == full["peak"]


@pytest.mark.slow
@needs_fake_cuda
def test_small_model_trace_agrees_with_its_plan():
    from bench.trace.run import compare, plan_for, trace_stack

    result = trace_stack(SMALL)
    cmp = compare(result, plan_for(SMALL, [24 * GiB]), "cuda:0")
    # the default data evaluates (exact match), which the plan's peak includes and the trace does not
    # run: compare the training phases, each and their largest
    assert abs(cmp["traced_gib"] / cmp["planned_train_gib"] - 1) <= 0.10, cmp
    for phase, row in cmp["phases"].items():
        assert abs(row["traced_gib"] / row["planned_gib"] - 1) <= 0.10, (phase, row)


@pytest.mark.slow
@needs_fake_cuda
def test_a_padding_free_stack_traces_through_sdpa_varlen_within_its_plan():
    from bench.trace.run import compare, plan_for, trace_stack

    packed = [*SMALL, "data.packing=true", "data.padding_free=true"]  # auto attention: sdpa_varlen here
    cmp = compare(trace_stack(packed), plan_for(packed, [24 * GiB]), "cuda:0")
    assert abs(cmp["traced_gib"] / cmp["planned_train_gib"] - 1) <= 0.10, cmp


@pytest.mark.slow
def test_fake_tensors_count_what_real_ones_allocate_on_cpu():
    from bench.trace.run import run_child

    small = [*SMALL[:-2], "trainer.micro_batch_size=2", "trainer.seq_len=128"]
    real = run_child({"overrides": small, "device": "cpu", "fake": False})
    fake = run_child({"overrides": small, "device": "cpu", "fake": True})
    assert fake["peak"]["cpu"] == pytest.approx(real["peak"]["cpu"], rel=0.01)
    assert fake["peak_phase"] == real["peak_phase"]


@pytest.mark.slow
@needs_fake_cuda
def test_embeddings_kept_in_host_ram_leave_the_gpu_and_the_step_still_runs():
    """offload.embeddings on the tiny model, traced on the fake CUDA device: the table is no GPU
    static row (the plan moves it to the host's), the looked-up rows still reach the layers, and
    the training phases agree with the plan."""
    from bench.trace.run import compare, plan_for, run_child

    overrides = ["trainer.micro_batch_size=4", "trainer.seq_len=32", "offload.embeddings=true"]
    r = run_child({"overrides": overrides, "device": "cuda"})
    plan = plan_for(overrides, [24 * GiB])
    table = 100 * 128 * 4  # vocab x hidden, fp32 after k-bit prep's upcast
    assert plan["components"]["other_params"]["cpu"] == table
    assert r["static"]["cuda:0"]["other_params"] == plan["components"]["other_params"]["cuda:0"]
    assert {"forward", "loss", "backward", "optimizer"} <= {k.split("|")[1] for k in r["phases"]}
    cmp = compare(r, plan, "cuda:0")
    assert 0.8 < cmp["traced_gib"] / cmp["planned_train_gib"] < 1.25, cmp


# Qwen3-30B-A3B's figures shrunk to a tiny MoE: 2 layers of 8 experts (2 a token), 4-bit experts
TINY_MOE = [
    "model=qwen3-30b-a3b",
    "model.hidden_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=32",
    "model.intermediate_size=256",
    "model.vocab_size=1000",
    "model.figures.num_experts=8",
    "model.figures.num_experts_per_tok=2",
    "model.figures.moe_intermediate_size=128",
    "trainer.micro_batch_size=2",
    "trainer.seq_len=64",
    "precision=bf16",
]


@needs_fake_cuda
def test_a_moe_traces_with_its_experts_stored_4bit_and_routed_on_the_fake_cuda_device(traced):
    """The loader's own expert quantization (model/moe_experts.py) on the skeleton and again on fake
    tensors: the 4-bit row holds the experts as the plan does, and the routed experts' forward and
    backward run (tokens per expert counted on the fake device)."""
    from bench.trace.run import compare, plan_for

    r = traced({"overrides": TINY_MOE, "device": "cuda"})
    dev = "cuda:0"
    plan = plan_for(TINY_MOE, [24 * GiB])
    assert r["experts_4bit_layers"] == 2
    static, planned = r["static"][dev], plan["components"]
    assert static["lora_weights"] == planned["lora_weights"][dev]
    # the q/k norms' and router's small tensors each rounded up to the allocator's 512-byte blocks
    assert 0 <= static["other_params"] - planned["other_params"][dev] < 512 * 4 * 2
    weights = 4 * 2 + 2 * 2  # q/k/v/o and the two fused expert weights, per layer
    assert 0 <= static["quantized_weights"] - planned["quantized_weights"][dev] < 6 * 512 * weights
    assert r["kernels"]["ops"].get("bincount") == 2 * 2  # each layer's routing, forward and recompute
    assert {"forward", "loss", "backward", "optimizer"} <= {k.split("|")[1] for k in r["phases"]}
    cmp = compare(r, plan, dev)
    assert 0.8 < cmp["traced_gib"] / cmp["planned_train_gib"] < 1.25, cmp


def test_the_committed_traces_hold_the_moe_recipes_within_ten_percent():
    """bench/results/planner-traced.json (`python -m bench trace --suite`): gpt-oss-20b on 16 GB and
    Qwen3-30B-A3B on 24 GB traced within 10 % of their plans, their 4-bit rows (experts included) the
    plan's."""
    import json

    from conftest import REPO

    cases = {c["case"]: c for c in json.loads((REPO / "bench/results/planner-traced.json").read_text())["cases"]}
    for recipe in ("gpt-oss-20b-16gb", "qwen3-30b-a3b-24gb"):
        c = cases[f"recipe {recipe}"]
        assert c["within"] and 0.9 <= c["ratio"] <= 1.1, c["case"]
        row = c["components"]["quantized_weights"]
        assert abs(row["traced_gib"] / row["planned_gib"] - 1) < 0.01, c["case"]


@needs_fake_cuda
def test_a_moe_layers_backward_holds_the_top_k_weights_product_as_planned(traced):
    """Many routed rows a token (4 of 8 experts, narrow experts, 2,048 tokens): the layer backward's peak
    is where the top-k weights' product runs backward, three routed-row gradients of the hidden width
    beside the hidden-state ones (planner/components.py backward_working_bytes); its traced
    phase peak is the plan's within 10 %."""
    from bench.trace.run import compare, plan_for

    overrides = [*TINY_MOE, "model.figures.num_experts_per_tok=4", "model.figures.moe_intermediate_size=32"]
    overrides += ["trainer.micro_batch_size=1", "trainer.seq_len=2048"]
    r = traced({"overrides": overrides, "device": "cuda"})
    row = compare(r, plan_for(overrides, [24 * GiB]), "cuda:0")["phases"]["train: layer backward"]
    assert 0.9 <= row["traced_gib"] / row["planned_gib"] <= 1.1, row


def test_the_flex_block_mask_is_built_a_band_at_a_time_as_the_compiled_builder_gives_it():
    """The tracer builds transformers' flex block mask in bands of query blocks (the eager builder's
    dense seq^2 mask is no tensor the compiled one holds): the same BlockMask as torch's, causal,
    sliding and padded, over bands of one to three query blocks and a partial last block."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from bench.trace.kernels import banded_block_mask

    keep = torch.ones(2, 1000, dtype=torch.bool)
    keep[1, 900:] = False

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (q - kv < 300) & keep[b, kv]

    want = create_block_mask(mask_mod, 2, None, 1000, 1000, "cpu", _compile=False)
    for band in (2 * 128 * 1000, 2 * 3 * 128 * 1000):
        got = banded_block_mask(mask_mod, 2, None, 1000, 1000, "cpu", band=band)
        assert got.shape == want.shape
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (band, name)
