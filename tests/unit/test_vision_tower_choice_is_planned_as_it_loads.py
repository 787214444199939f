"""model.vision_tower in the plan: quantized, the tower's linears at what bitsandbytes holds for them and
the rest in the compute dtype; lora, the tower's adapters with their gradients and optimizer state, and
the activations the tower keeps for backward (each layer's input when checkpointed: transformers
checkpoints the tower's layers too). Held to what the tiny LLaVA loads and allocates on CPU."""

import pytest
import torch
from conftest import compose_cfg
from helpers_vision import build_llava
from test_memory_planner import quantized_bytes_held
from torch.profiler import ProfilerActivity, profile

from qlora_recipes import planner
from qlora_recipes.planner.components import optimizer_bytes
from qlora_recipes.planner.spec import spec_from_cfg
from qlora_recipes.planner.vision_forward import TowerLora, image_tokens, lora_kept_bytes, vision_shape

TOWER = ".vision_tower."
COMMON = ("quant=nf4", "precision=bf16", "optim=paged8bit", "trainer.seq_len=64", "data.metric=null")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


def _cfg(llava, *overrides):
    return compose_cfg(f"model.name_or_path={llava}", *COMMON, *overrides)


def _plan(llava, *overrides) -> dict:
    return planner.plan(_cfg(llava, *overrides), world_size=1, ladder=False)


def _row(plan: dict, name: str) -> int:
    return plan["components"].get(name, {}).get("cpu", 0)


def _loaded(llava, tmp_path, *overrides):
    from qlora_recipes.model import loading

    cfg = _cfg(llava, *overrides)
    return loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))


def test_the_spec_carries_the_tower_choice(llava):
    assert spec_from_cfg(_cfg(llava), 1).vision_tower == "frozen"
    assert spec_from_cfg(_cfg(llava, "model.vision_tower=lora"), 1).vision_tower == "lora"


def test_a_quantized_tower_is_planned_at_the_bytes_bitsandbytes_holds(llava, tmp_path):
    model = _loaded(llava, tmp_path, "model.vision_tower=quantized")
    tower = next(m for n, m in model.named_modules() if n.endswith(TOWER.strip(".")))
    held = quantized_bytes_held(tower)
    linear_params = sum(p.numel() * 2 for p in tower.parameters() if type(p).__name__ == "Params4bit")
    frozen, quantized = _plan(llava), _plan(llava, "model.vision_tower=quantized")
    added = _row(quantized, "quantized_weights") - _row(frozen, "quantized_weights")
    assert abs(added - held) / held < 0.02, (added, held)
    # the linears' weights leave the compute-dtype row (each Params4bit holds two 4-bit weights a byte)
    assert _row(frozen, "other_params") - _row(quantized, "other_params") == linear_params * 2
    # k-bit prep's fp32 copy while loading: the unquantized weights alone
    assert _row(quantized, "load_transient") < _row(frozen, "load_transient")
    assert any("the tower's linears in nf4, the rest unquantized" in n for n in quantized["notes"])


def test_a_lora_tower_plans_its_adapters_as_peft_makes_them(llava, tmp_path):
    model = _loaded(llava, tmp_path, "model.vision_tower=lora")
    adapters = [p for n, p in model.named_parameters() if TOWER in n and p.requires_grad]
    assert adapters and all("lora_" in n for n, p in model.named_parameters() if TOWER in n and p.requires_grad)
    numel = sum(p.numel() for p in adapters)
    held = sum(p.numel() * p.element_size() for p in adapters)  # peft.adapter_dtype=auto: as the run settles it
    frozen, lora = _plan(llava), _plan(llava, "model.vision_tower=lora")
    assert lora["counts"]["lora_params"] - frozen["counts"]["lora_params"] == numel
    assert _row(lora, "lora_weights") - _row(frozen, "lora_weights") == held
    assert _row(lora, "gradients") - _row(frozen, "gradients") == held
    state, _ = optimizer_bytes("paged_adamw_8bit", [tuple(p.shape) for p in adapters])
    assert _row(lora, "optimizer_state") - _row(frozen, "optimizer_state") == state
    assert any("its LoRA keeps each layer's input" in n for n in lora["notes"])


def _kept(model, images: int) -> int:
    """Bytes autograd holds after the tower and projector's forward on `images` images (bf16 autocast,
    training mode), less the projector's output (the embeddings' copy of it is planned apart)."""
    base = model.base_model.model
    side = base.config.vision_config.image_size

    def forward():
        pixels = torch.randn(images, 3, side, side)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = base.model.get_image_features(
                pixel_values=pixels, vision_feature_layer=-1, vision_feature_select_strategy="full"
            )
        return out.pooler_output

    forward()  # one-time allocations before measuring
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        features = forward()
    held = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return held - sum(f.numel() * f.element_size() for f in features)


@pytest.mark.parametrize("choice,checkpointing", [("lora", True), ("lora", False), ("frozen", True), ("frozen", False)])
def test_the_tower_keeps_what_the_tiny_llava_tower_holds_for_backward(llava, tmp_path, choice, checkpointing):
    """LoRA's gradients need the tower's activations (each layer's input when checkpointed); a frozen
    tower keeps none, checkpointed or not (its patch embeddings are not made to require grad)."""
    from qlora_recipes.planner import vision

    overrides = (f"model.vision_tower={choice}", f"trainer.gradient_checkpointing={str(checkpointing).lower()}")
    model = _loaded(llava, tmp_path, *overrides)
    model.train()
    images = 256  # enough that the tensors, not overheads, count
    measured = _kept(model, images)
    st = spec_from_cfg(_cfg(llava, *overrides, f"trainer.micro_batch_size={images}"), 1)
    cj = vision.vision_config(st)
    shape = vision_shape(cj, st.fig.hidden_size)
    img = image_tokens(shape, vision.processor_settings(st), st.seq_len)
    planned = vision._tower_kept(st, shape, img, cj, "cpu")
    print(f"{choice} checkpointing={checkpointing}: the tower keeps {measured} B, planned {planned} B")
    if planned == 0:
        assert measured < 4096  # nothing of the tower's activations
    else:
        assert abs(planned - measured) / measured < 0.05
    # the plan's activations row carries it for a micro-batch's images
    with_tower = _plan(llava, "trainer.micro_batch_size=2", *overrides)
    notes = "\n".join(with_tower["notes"])
    assert ("nothing of it kept for backward" in notes) == (planned == 0)


def test_without_checkpointing_only_a_lora_tower_keeps_activations(llava):
    overrides = ("trainer.micro_batch_size=2", "trainer.gradient_checkpointing=false")
    frozen, lora = _plan(llava, *overrides), _plan(llava, *overrides, "model.vision_tower=lora")
    config = _config(llava)
    shape = vision_shape(config, config["text_config"]["hidden_size"])
    img = image_tokens(shape, {"num_additional_image_tokens": 1, "vision_feature_select_strategy": "full"}, 64)
    st = spec_from_cfg(_cfg(llava, "model.vision_tower=lora"), 1)
    lora_kept = lora_kept_bytes(shape, img, 2, 2, False, TowerLora(st.r, True, False, sigmoid_act=True))
    assert _row(lora, "activations") - _row(frozen, "activations") == lora_kept


def _config(llava) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(llava).to_dict()
