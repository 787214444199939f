"""The device maps the planner infers for the text families it inventories (planner/device_map.py, no
torch, no meta model) are the maps transformers' own inference gives (_get_device_map on the meta
model, as the planner ran it before): every family's tiny model in nf4, int8 and 16 bits, tied or not,
on one GPU, two (balanced) and none, budgets on both sides of every block boundary; the OOM ladder's
candidates; whole plans of the recipes that offload, byte for byte. Planning the 70B on a 24 GB card
so imports neither torch nor a transformers modeling module."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, compose_cfg
from helpers_families import FAMILY_CONFIGS, tiny_config

from qlora_recipes import planner
from qlora_recipes.config import devices
from qlora_recipes.planner import components, constants, device_map, figures, placement
from qlora_recipes.planner.spec import spec_from_cfg
from qlora_recipes.units import dtype_bytes

GiB = 2**30
STACK = ("precision=bf16", "trainer.seq_len=64", "trainer.micro_batch_size=1", "offload=cpu")
# model_type, and what differs from its tiny config (helpers_families, every known family): Llama and
# Qwen2 (its small checkpoints) tied too; Gemma 2/3/4 and SmolLM3 tie by default; a vocabulary whose
# embeddings outweigh a layer, as in the real models (the balanced budgets' reserve is then theirs)
FAMILIES = {
    **{t: (t, {}) for t in FAMILY_CONFIGS},
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama-wide-vocab": ("llama", {"vocab_size": 4096}),
    "gemma2-wide-vocab": ("gemma2", {"vocab_size": 4096}),
}


def _tiny_stack(tmp_path, family: str, quant: str):
    model_type, extra = FAMILIES[family]
    config = tiny_config(model_type)
    for key, value in extra.items():
        setattr(config, key, value)
    config.save_pretrained(str(tmp_path))
    return spec_from_cfg(compose_cfg(f"model.name_or_path={tmp_path}", f"quant={quant}", *STACK), 1)


def _both_maps(st, max_memory: dict, bbs, monkeypatch) -> tuple[list, list]:
    """(the port's map, transformers' map on the meta model), each with its unquantized re-sizing rounds."""
    monkeypatch.setattr(placement, "MAP_CACHE_SIZE", 0)
    ours = placement.infer_device_map(st, dict(max_memory), bbs, shortcut=False)
    with monkeypatch.context() as m:
        m.setattr(placement, "_ported", lambda *a: False)
        theirs = placement.infer_device_map(st, dict(max_memory), bbs, shortcut=False)
    return list(ours.items()), list(theirs.items())


def _boundaries(st) -> list[int]:
    """Budgets on both sides of every block boundary: where the blocks before it, plus the room the main
    device keeps for the largest layer, fill the budget after the quantizer's cut; and a coarse grid."""
    blocks = figures.inventory(st.fig)
    names = frozenset(f"{lin.name}.weight" for b in blocks for lin in b.linears if lin.name != "lm_head")
    sizes = device_map.block_sizes(blocks, dtype_bytes(st.dtype), names, 0.5 if st.quant == "nf4" else 1.0)
    largest = max(sizes.of[b.name] for b in blocks if b.is_layer)
    cut = constants.BNB_MAX_MEMORY_FACTOR if st.quantized else 1.0
    ends, used = [], 0
    for blk in blocks:
        used += sizes.of.get(blk.name, 0)
        ends.append((used + largest) / cut)
    points = {max(0, int(end) + d) for end in ends for d in (-1, 0, 1)}
    return sorted(points | {int(ends[-1] * f) for f in (0.1, 0.3, 0.5, 0.7, 1.5)})


def _budget_shapes(b: int) -> list[dict]:
    """One GPU with room on the CPU, or with disk after it; the CPU alone; two GPUs (balanced)."""
    big = 10**12
    return [{0: b, "cpu": big}, {0: b, "cpu": b}, {"cpu": b}, {0: b, 1: b, "cpu": b}, {0: b, 1: b // 2, "cpu": big}]


@pytest.mark.parametrize("quant", ["nf4", "int8", "none"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_map_is_transformers_own_on_both_sides_of_every_block_boundary(
    tmp_path, monkeypatch, family, quant
):
    st = _tiny_stack(tmp_path, family, quant)
    blocks = figures.inventory(st.fig)
    model = figures.meta_model(st.fig, st.dtype)
    # the tree the port walks: the meta model's undivided layers and tied weights
    no_split = set(model._no_split_modules)
    layers = {b.name for b in blocks if b.is_layer}
    assert {n for n, m in model.named_modules() if type(m).__name__ in no_split} == layers
    ties = [sorted([k, v]) for k, v in model.all_tied_weights_keys.items()] or [[]]
    assert device_map.tied_groups(blocks) == ties
    assert placement._ported(st, {0: 1, "cpu": 1})
    bbs = components.block_bytes(st)
    wrong = []
    for b in _boundaries(st):
        for budgets in _budget_shapes(b):
            ours, theirs = _both_maps(st, budgets, bbs, monkeypatch)
            if ours != theirs:
                wrong.append((budgets, ours, theirs))
    assert not wrong, wrong[:2]


def _text_models() -> list:
    """The conf/model entries of families the port covers: a few fast (tied, MoE), the rest slow."""
    fast = ("smollm3-3b", "gemma2-9b", "qwen3-30b-a3b")
    out = []
    for option in sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml")):
        text = (REPO / "conf" / "model" / f"{option}.yaml").read_text()
        arch = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("architecture:"))
        if arch in figures.KNOWN_ARCHITECTURES and "vision_config:" not in text:
            out.append(option if option in fast else pytest.param(option, marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize("option", _text_models())
def test_a_real_size_models_map_is_transformers_own(monkeypatch, option):
    st = spec_from_cfg(compose_cfg(f"model={option}", "quant=nf4", *STACK), 1)
    assert placement._ported(st, {0: 1, "cpu": 1})
    bbs = components.block_bytes(st)
    whole = sum(bb.placed_bytes for _, bb in bbs)
    for share in (0.05, 0.3, 0.6, 0.95):
        gpu = int(whole * share)
        for budgets in ({0: gpu, "cpu": whole // 2}, {0: gpu, 1: gpu, "cpu": whole}, {"cpu": gpu}):
            ours, theirs = _both_maps(st, budgets, bbs, monkeypatch)
            assert ours == theirs, (budgets, ours, theirs)


def _plan_recording(monkeypatch, cfg, gpus, host_ram, ported: bool) -> tuple[str, list]:
    """The plan as JSON, and every map the planner inferred with what it was inferred for."""
    monkeypatch.setattr(placement, "_INFERRED", {})
    inferred, real = [], placement._inferred_map

    def recorded(st, max_memory, linears):
        dmap = real(st, max_memory, linears)
        inferred.append((st.fig.architecture, st.quant, tuple(max_memory.items()), list(dmap.items())))
        return dmap

    with monkeypatch.context() as m:
        m.setattr(placement, "_inferred_map", recorded)
        if not ported:
            m.setattr(placement, "_ported", lambda *a: False)
        plan = planner.plan(cfg, gpus=gpus, host_ram=host_ram)
    return json.dumps(plan, default=str), inferred


def _same_plan_both_ways(monkeypatch, cfg, gpus, host_ram) -> list:
    monkeypatch.setattr(devices, "disk_free", lambda folder: 10**12)  # other processes write to this disk
    ours, ours_maps = _plan_recording(monkeypatch, cfg, gpus, host_ram, ported=True)
    theirs, their_maps = _plan_recording(monkeypatch, cfg, gpus, host_ram, ported=False)
    for mine, its in zip(ours_maps, their_maps, strict=True):
        assert mine == its
    assert ours == theirs
    return ours_maps


# (overrides, --gpus, host RAM GiB, maps the ladder infers at least): the 8B fits 8 GB without
# offloading (its eval batch cut), so no map; on 6 GB its cpu_offload rung probes a few
@pytest.mark.parametrize(
    "overrides, gpus, host_gib, least",
    [
        (("model=llama2-70b",), "24GB", 24, 6),
        (("recipe=llama3.1-8b-24gb",), "8GB", 64, 0),
        (("recipe=llama3.1-8b-24gb",), "6GB", 64, 2),
    ],
)
def test_the_oom_ladders_candidates_get_transformers_maps_and_the_same_plan(
    monkeypatch, overrides, gpus, host_gib, least
):
    cfg = compose_cfg(*overrides)
    maps = _same_plan_both_ways(monkeypatch, cfg, devices.parse_gpus(gpus), host_gib * GiB)
    offloading = [dmap for *_, dmap in maps if any(v in ("cpu", "disk") for _, v in dmap)]
    assert len(maps) >= least and len(offloading) >= least // 2


# the recipes whose offload is device_map=auto, and whether their map is inferred (the A100 ones fit
# their GPU budget whole: the map is that GPU, placement._whole_model_fits_one_device)
OFFLOADING_RECIPES = {
    "llama2-70b-24gb-disk": True,
    "llama3.1-70b-48gb": True,
    "llama2-70b-a100": False,
    "llama3.1-70b-80gb-dpo": False,
}


@pytest.mark.parametrize("recipe, inferred", OFFLOADING_RECIPES.items())
def test_an_offloading_recipes_plan_is_the_same_byte_for_byte(monkeypatch, recipe, inferred):
    cfg = compose_cfg(f"recipe={recipe}")
    assert cfg.offload.device_map == "auto"
    maps = _same_plan_both_ways(monkeypatch, cfg, devices.declared_gpus(cfg), devices.declared_host_ram(cfg))
    assert bool(maps) == inferred


def test_the_offloading_recipes_are_those_above():
    auto = [p.stem for p in sorted((REPO / "recipes").glob("*.yaml")) if "override /offload:" in p.read_text()]
    assert sorted(auto) == sorted(OFFLOADING_RECIPES)


PLAN_70B = """
import json, sys
from qlora_recipes import planner
from qlora_recipes.config import devices, loader
cfg = loader.load(["model=llama2-70b"])
plan = planner.plan(cfg, gpus=devices.parse_gpus("24GB"), host_ram=24 * 2**30)
disk = loader.load(["recipe=llama2-70b-24gb-disk"])
on_disk = planner.plan(disk, gpus=devices.declared_gpus(disk), host_ram=devices.declared_host_ram(disk))
print(json.dumps({
    "rungs": [r["change"] for r in plan["ladder"]],
    "devices": sorted(set(str(v) for v in on_disk["device_map"].values())),
    "modules": sorted(m for m in sys.modules if m == "torch" or ".modeling_" in m),
}))
"""


def test_planning_the_70b_on_a_24gb_card_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", PLAN_70B], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert "disk_offload" in got["rungs"] and got["devices"] == ["0", "cpu", "disk"]
    assert got["modules"] == []  # neither torch nor any transformers modeling module
