"""Under gradient checkpointing transformers' enable_input_require_grads hooks the input embeddings of every
PreTrainedModel in the model, the vision tower's patch embeddings too. A tower that trains nothing (frozen,
quantized) loses that hook, at load and after each later call (the Trainer's checkpointing, TRL's trainers):
its outputs need no gradient, and the loss and the language model's LoRA gradients are the hooked ones.
A tower with LoRA keeps it: reentrant checkpointing needs it for the tower's adapters to get gradients."""

import warnings

import helpers_vlm_families as fam
import pytest
import torch
from conftest import compose_cfg
from helpers_vision import build_llava, colour_row, draw_images

BUILDS = {"llava": build_llava, "gemma3": fam.build_gemma3}
COMMON = ("quant=nf4", "optim=paged8bit", "peft.dropout=0", "trainer.gradient_checkpointing=true")


@pytest.fixture(scope="module", params=sorted(BUILDS))
def family(request, tmp_path_factory):
    return BUILDS[request.param](tmp_path_factory.mktemp(request.param) / "model")


def _trainable(model_dir, tmp_path, *overrides):
    from qlora_recipes.model import loading

    cfg = compose_cfg(f"model.name_or_path={model_dir}", *COMMON, *overrides)
    return cfg, loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))


def _batch(cfg, tmp_path) -> dict:
    from PIL import Image

    from qlora_recipes.model.loading import source
    from qlora_recipes.model.vision import load_processor

    processor = load_processor(cfg.model, source(cfg.model))
    image = draw_images(tmp_path / "images")["red"]
    row = colour_row("red", str(image))
    return dict(
        processor.apply_chat_template(
            [row["messages"]], tokenize=True, return_dict=True, return_tensors="pt", images=[[Image.open(image)]]
        )
    )


def _tower(model) -> torch.nn.Module:
    from qlora_recipes.model.vision import vision_prefixes
    from qlora_recipes.model.vision_tower import tower_prefix

    base = model.get_base_model()
    return base.get_submodule(tower_prefix(base, vision_prefixes(base)))


def _step(model, batch) -> tuple[torch.Tensor, dict, bool]:
    """The loss, every trained parameter's gradient, and whether the tower's output required grad."""
    seen = []
    hook = _tower(model).register_forward_hook(lambda m, i, out: seen.append(out[0].requires_grad))
    model.zero_grad(set_to_none=True)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    hook.remove()
    grads = {n: p.grad if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads, any(seen)


def _nonzero_lora_b(model) -> None:
    """lora_B starts at zero, which leaves lora_A's gradient zero: give both a gradient to compare."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_a_frozen_towers_outputs_need_no_gradient_and_the_lora_gradients_are_unchanged(family, tmp_path, mode):
    from transformers import PreTrainedModel

    cfg, model = _trainable(family, tmp_path, f"trainer.checkpointing_mode={mode}")
    model.train()
    _nonzero_lora_b(model)
    batch = _batch(cfg, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads, tower_grad = _step(model, batch)
    assert not tower_grad
    assert not [w for w in caught if "None of the inputs have requires_grad" in str(w.message)]  # none checkpointed
    assert grads and all(g is not None for g in grads.values())

    base = model.get_base_model()
    PreTrainedModel.enable_input_require_grads(base)  # transformers' own: the tower's embeddings hooked too
    hooked_loss, hooked_grads, hooked_tower_grad = _step(model, batch)
    assert hooked_tower_grad  # the hook this removes is what made the tower build its graph
    assert torch.equal(loss, hooked_loss)
    assert grads.keys() == hooked_grads.keys()
    assert all(torch.equal(grads[n], hooked_grads[n]) for n in grads)

    # what the Trainer (activation_checkpointing_enable) and TRL's trainers (on the peft model) call again
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    assert not _step(model, batch)[2]
    PreTrainedModel.enable_input_require_grads(base)
    model.enable_input_require_grads()
    again_loss, again_grads, again_tower_grad = _step(model, batch)
    assert not again_tower_grad and torch.equal(again_loss, loss)
    assert all(torch.equal(grads[n], again_grads[n]) for n in grads)


def test_a_quantized_tower_loses_the_hook_too(tmp_path_factory, tmp_path):
    llava = build_llava(tmp_path_factory.mktemp("llava") / "model")
    cfg, model = _trainable(llava, tmp_path, "model.vision_tower=quantized")
    model.train()
    assert not _step(model, _batch(cfg, tmp_path))[2]


def test_a_lora_tower_keeps_the_hook_its_reentrant_checkpointed_adapters_need(tmp_path_factory, tmp_path):
    llava = build_llava(tmp_path_factory.mktemp("llava") / "model")
    cfg, model = _trainable(llava, tmp_path, "model.vision_tower=lora", "trainer.checkpointing_mode=reentrant")
    model.train()
    model.enable_input_require_grads()  # as TRL's trainers call it again
    _nonzero_lora_b(model)
    _, grads, tower_grad = _step(model, _batch(cfg, tmp_path))
    in_tower = [g for n, g in grads.items() if ".vision_tower." in n]
    assert tower_grad and in_tower and all(g is not None and torch.count_nonzero(g) for g in in_tower)
