"""The lean options: `precision.upcast_frozen=false` (frozen embeddings, lm_head and norms in the
compute dtype instead of k-bit prep's fp32) and `trainer.activation_offloading` (TRL: saved
activations to pinned host RAM): what they leave trainable, what reaches SFTConfig, and the plan
moving by the bytes the option moves. Training with them: e2e/test_lean_options_train.py."""

import pytest
import torch
from conftest import compose_cfg, requires_gpu

from qlora_recipes import planner
from qlora_recipes.config.loader import precision_for
from qlora_recipes.errors import UserError
from qlora_recipes.model import loading
from qlora_recipes.planner.ladder import COSTS, LADDER_ORDER, _candidates
from qlora_recipes.planner.peaks import device_peak
from qlora_recipes.run.validate import validate

GiB = 2**30
HOST = 64 * GiB


@pytest.mark.parametrize("upcast", [True, False])
def test_planned_other_params_are_what_make_trainable_leaves(upcast, run_dir):
    """The tiny default, NF4: the frozen non-quantized params as make_trainable leaves them, byte
    for byte (fp32 after k-bit prep, bf16 without its upcast)."""
    cfg = compose_cfg("precision=bf16", f"precision.upcast_frozen={str(upcast).lower()}")
    plan = planner.plan(cfg, gpus=[], host_ram=HOST, world_size=1, ladder=False)
    model = loading.make_trainable(cfg, loading.load_model(cfg, run_dir))
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()]
    assert {p.dtype for p in frozen} == {torch.float32 if upcast else torch.bfloat16}
    assert sum(plan["components"]["other_params"].values()) == sum(p.numel() * p.element_size() for p in frozen)


def test_activation_offloading_reaches_sft_config_and_passes_validation_with_a_gpu(tmp_path):
    from qlora_recipes.run import trainer_args

    cfg = compose_cfg("trainer.activation_offloading=true")
    validate(cfg, gpu_available=True, world_size=1)
    assert trainer_args.sft_config(cfg, tmp_path, "text", on_gpu=False, has_eval=False).activation_offloading is True
    assert (
        trainer_args.sft_config(compose_cfg(), tmp_path, "text", on_gpu=False, has_eval=False).activation_offloading
        is False
    )


# ----------------------------------------------------------------------------------------------
# The plan: llama3.1-8b, bs 2 x 2048, on a 24 GB card
# ----------------------------------------------------------------------------------------------
EIGHT_B = ("model=llama3.1-8b", "trainer=standard", "trainer.micro_batch_size=2", "trainer.seq_len=2048")
L, H, B, S = 32, 4096, 2, 2048


def _plan(*overrides, gpus=(24 * GiB,), host_ram=HOST, ladder=True):
    return planner.plan(compose_cfg(*overrides), gpus=list(gpus), host_ram=host_ram, world_size=1, ladder=ladder)


def _row(plan, component, device=None):
    row = plan["components"].get(component, {})
    return row.get(device, 0) if device else sum(row.values())


def _device(plan, name):
    return next((d for d in plan["devices"] if d["device"] == name), None)


def _train_peak(plan) -> int:
    """The GPU's peak over the training phases (evaluation is not what these options change)."""
    return device_peak(_device(plan, "cuda:0"), with_eval=False)


def test_frozen_parts_in_bf16_lower_the_plan_by_two_bytes_per_frozen_param():
    base, lean = _plan(*EIGHT_B), _plan(*EIGHT_B, "precision.upcast_frozen=false")
    frozen = base["counts"]["params_total"] - base["counts"]["params_quantized"]
    assert frozen == 2 * 128_256 * H + (2 * L + 1) * H  # embed_tokens + lm_head + norms
    assert _row(base, "other_params") - _row(lean, "other_params") == 2 * frozen
    # the residual stream follows the embeddings: each checkpointed layer input in bf16, not fp32
    rope = 2 * S * 128  # cos/sin elements
    assert _row(base, "activations") - _row(lean, "activations") == 2 * (L * B * S * H + rope)
    assert lean["peak_gib"] < base["peak_gib"] and _train_peak(lean) < _train_peak(base)
    print(f"8B bs2x2048 24GB: peak {base['peak_gib']} -> {lean['peak_gib']} GiB with precision.upcast_frozen=false")


def test_frozen_dtype_changes_nothing_where_nothing_is_upcast():
    for stack in (("quant=none",), ("precision=fp32",)):
        base, lean = (
            _plan(*EIGHT_B, *stack, ladder=False),
            _plan(*EIGHT_B, *stack, "precision.upcast_frozen=false", ladder=False),
        )
        assert base["components"] == lean["components"], stack


def test_activation_offloading_moves_the_checkpointed_inputs_to_host_ram():
    base, off = _plan(*EIGHT_B), _plan(*EIGHT_B, "trainer.activation_offloading=true")
    layer_input = B * S * H * 4  # fp32 residual stream (k-bit prep's upcast)
    assert layer_input == 2**26  # a power of two: the pinned block is that size
    assert _row(base, "activations", "cuda:0") - _row(off, "activations", "cuda:0") == (L - 5) * layer_input
    assert _row(off, "activations", "cpu") == L * layer_input  # every input copied; the last 5 also kept
    host = _device(off, "cpu")
    assert _device(base, "cpu") is None and host["budget"] == HOST
    assert host["peak_by_phase"]["train: loss"] > L * layer_input  # checked against the host budget
    assert _train_peak(off) < _train_peak(base) and off["peak_gib"] <= base["peak_gib"]
    print(f"8B bs2x2048 24GB: peak {base['peak_gib']} -> {off['peak_gib']} GiB with activation offloading")
    # a host too small for the pinned inputs: the plan says so
    small = _plan(*EIGHT_B, "trainer.activation_offloading=true", host_ram=2 * GiB, ladder=False)
    assert not small["fits"] and _device(small, "cpu")["peak"] > 2 * GiB


def test_activation_offloading_leaves_a_cpu_plan_alone():
    base = _plan(*EIGHT_B, gpus=(), ladder=False)
    off = _plan(*EIGHT_B, "trainer.activation_offloading=true", gpus=(), ladder=False)
    assert base["components"] == off["components"]
    assert [d["device"] for d in base["devices"]] == [d["device"] for d in off["devices"]] == ["cpu"]


# ----------------------------------------------------------------------------------------------
# The ladder
# ----------------------------------------------------------------------------------------------
# evaluation off: the rungs are judged on the training phases
THIRTY_3B = (
    "model=llama-33b",
    "model.max_position_embeddings=4096",  # its own 2048 would refuse seq 4096
    "trainer=standard",
    "trainer.micro_batch_size=1",
    "trainer.seq_len=4096",
    "data.eval_path=null",
    "data.eval_fraction=0",
)


def test_ladder_offers_the_lean_rungs_first_when_they_help():
    """LLaMA-33B, seq 4096, micro-batch 1 on 24 GiB (the QLoRA paper's "does not quite fit", at twice
    its sequence): bf16 frozen parts, then activation offloading make it fit."""
    plan = _plan(*THIRTY_3B)
    assert not plan["fits"]
    kinds = [r["change"] for r in plan["ladder"]]
    assert kinds == ["frozen_dtype", "activation_offload"], kinds
    assert kinds == [k for k in LADDER_ORDER if k in kinds]
    frozen, offload = plan["ladder"]
    assert frozen["adds"] == "precision.upcast_frozen=false" and frozen["cost"] == "none"
    assert COSTS["frozen_dtype"][1].startswith("frozen parts in bf16")
    assert offload["adds"] == "trainer.activation_offloading=true" and offload["cost"] == "small"
    assert offload["worst_peak_gib"] < frozen["worst_peak_gib"] < plan["peak_gib"] and offload["fits"]
    replanned = _plan(*THIRTY_3B, *offload["overrides"].split(), ladder=False)
    assert replanned["fits"] and replanned["peak_gib"] == offload["peak_gib"]
    assert _device(replanned, "cpu")["peak"] < HOST  # the pinned inputs fit the host


def test_ladder_leaves_out_lean_rungs_that_cannot_help():
    """No fp32 upcast to undo with quant=none or precision=fp32; no GPU to offload from on a CPU
    machine, nor a checkpointed input to move without checkpointing."""
    from qlora_recipes.config import devices
    from qlora_recipes.planner.spec import spec_from_cfg

    gpu, cpu = devices.hardware([24 * GiB], HOST), devices.hardware([], HOST)

    def offered(kind, hw, *overrides):
        st = spec_from_cfg(precision_for(compose_cfg(*THIRTY_3B, *overrides), list(hw.gpus)), 1)  # auto on hw
        return [ov for _, ov in _candidates(kind, st, hw, {})]

    assert offered("frozen_dtype", gpu) == [{"precision.upcast_frozen": "false"}]
    assert offered("frozen_dtype", gpu, "quant=none") == offered("frozen_dtype", gpu, "precision=fp32") == []
    assert offered("frozen_dtype", gpu, "precision.upcast_frozen=false") == []
    on = {"trainer.activation_offloading": "true"}
    assert offered("activation_offload", gpu) == [on, {**on, "trainer.activation_offload_stash": 1}]
    assert offered("activation_offload", cpu) == []
    assert offered("activation_offload", gpu, "trainer.gradient_checkpointing=false") == []


def test_liger_is_refused_on_cpu_or_without_the_package_and_reaches_sft_config(tmp_path):
    import importlib.util

    from qlora_recipes.run import trainer_args

    cfg = compose_cfg("trainer.liger=true")
    with pytest.raises(UserError, match=r"trainer.liger=true needs a CUDA GPU"):
        validate(cfg, gpu_available=False, world_size=1)
    if importlib.util.find_spec("liger_kernel") is None:  # the CPU path never installs it
        with pytest.raises(UserError, match=r"pip install -r requirements-gpu.txt"):
            validate(cfg, gpu_available=True, world_size=1)
    assert trainer_args.sft_config(cfg, tmp_path, "text", on_gpu=False, has_eval=False).use_liger_kernel is True


def test_a_stash_of_one_keeps_only_the_layer_input_in_flight_on_the_gpu():
    """trainer.activation_offload_stash: TRL's forward stash keeps the newest N offloaded layer inputs
    on the GPU while their copies run (5 by default); 1 leaves one. The ladder offers it after
    offloading itself, and 0 is one line."""
    long = ("model=llama3.1-8b", "trainer=standard", "trainer.seq_len=32768", "trainer.activation_offloading=true")
    five, one = (
        planner.plan(compose_cfg(*long, f"trainer.activation_offload_stash={n}"), gpus=[80 * GiB], host_ram=HOST)
        for n in (5, 1)
    )
    layer_input = 32768 * 4096 * 4  # one row of hidden states, fp32 (k-bit prep upcasts the residual stream)
    kept = five["components"]["activations"]["cuda:0"] - one["components"]["activations"]["cuda:0"]
    assert kept == 4 * layer_input
    assert five["components"]["activations"]["cpu"] == one["components"]["activations"]["cpu"]
    st = planner.spec_from_cfg(precision_for(compose_cfg(*long), [24 * GiB]), 1)
    offered = [ov for _, ov in _candidates("activation_offload", st, planner_hw(24), {})]
    assert offered == [{"trainer.activation_offloading": "true", "trainer.activation_offload_stash": 1}]
    with pytest.raises(UserError, match="trainer.activation_offload_stash"):
        validate(compose_cfg("trainer.activation_offload_stash=0"), gpu_available=True, world_size=1)


def planner_hw(gib: int):
    from qlora_recipes.config import devices

    return devices.hardware([gib * GiB], HOST)


@pytest.mark.gpu
@requires_gpu("TRL's offloading context needs a CUDA stream")
def test_the_stash_and_pageable_copies_reach_trls_offloading_context():
    from types import SimpleNamespace

    from qlora_recipes.run.trainer_args import offload_context

    trainer = SimpleNamespace(model=torch.nn.Linear(8, 8).cuda())
    on = ("trainer.activation_offloading=true", "trainer.activation_offload_stash=1")
    offload_context(trainer, compose_cfg(*on, "trainer.activation_offload_pinned=false").trainer)
    assert trainer.maybe_activation_offload_context.max_fwd_stash_size == 1
    assert trainer.maybe_activation_offload_context.use_pin_memory is False


def test_pageable_offload_copies_are_planned_at_their_size_not_rounded_up():
    """trainer.activation_offload_pinned=false: TRL's host copies in pageable RAM, each at its size;
    pinned ones are rounded up to a power of two by torch's caching host allocator."""
    long = ("model=llama3.1-8b", "trainer=standard", "trainer.seq_len=40000", "trainer.activation_offloading=true")
    pinned, pageable = (
        planner.plan(compose_cfg(*long, f"trainer.activation_offload_pinned={p}"), gpus=[80 * GiB], host_ram=HOST)
        for p in ("true", "false")
    )
    layer_input = 40000 * 4096 * 4  # fp32 residual stream (k-bit prep upcasts it)
    moved = 32  # every layer's input goes to host RAM (the stash's stay on the GPU too)
    cpu = lambda plan: plan["components"]["activations"]["cpu"]  # noqa: E731
    assert cpu(pinned) - cpu(pageable) == moved * ((1 << (layer_input - 1).bit_length()) - layer_input)
    assert pinned["components"]["activations"]["cuda:0"] == pageable["components"]["activations"]["cuda:0"]
