"""trainer.gradient_checkpointing=N: the first N decoder layers recompute in backward, the others keep
their activations; the model keeps that choice when the trainer enables checkpointing again, trains to
the same gradients, and the plan counts each layer as it runs (an input for the checkpointed ones, the
whole layer's saved tensors for the others)."""

import pytest
import torch
from conftest import compose_cfg

from qlora_recipes import planner
from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.model import loading
from qlora_recipes.model.checkpointing import checkpoint_every_layer, decoder_layers

GiB = 2**30
TINY = ("trainer=smoke", "trainer.seq_len=64", "quant=nf4", "peft.r=8", "precision=fp32", "peft.dropout=0")


def _flags(model) -> list[bool]:
    return [bool(layer.gradient_checkpointing) for layer in decoder_layers(model)]


def _loss_and_grads(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_the_first_n_layers_checkpoint_and_keep_doing_so_when_the_trainer_enables_it_again(tmp_path):
    ids = torch.randint(4, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    results = {}
    for value in ("true", "1", "false"):
        torch.manual_seed(0)
        model = loading.make_trainable(compose_cfg(*TINY, f"trainer.gradient_checkpointing={value}"),
                                       loading.load_model(compose_cfg(*TINY), tmp_path))  # fmt: skip
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
        if value == "1":
            assert _flags(model) == [True, False]  # the tiny model's two layers: the first only
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            assert _flags(model) == [True, False]  # as the Trainer (and TRL after a reference pass) call it
        results[value] = _loss_and_grads(model, ids)
        if value == "1":  # the in-process OOM rung: every layer from then on
            checkpoint_every_layer(model, {"use_reentrant": False})
            assert _flags(model) == [True, True]
    for value in ("1", "false"):
        torch.testing.assert_close(results[value][0], results["true"][0])
        for name, grad in results["true"][1].items():
            torch.testing.assert_close(results[value][1][name], grad, rtol=1e-5, atol=1e-6)


def _activations(gc: str) -> tuple[int, dict]:
    cfg = compose_cfg("recipe=llama3.1-8b-24gb", "trainer.micro_batch_size=1", f"trainer.gradient_checkpointing={gc}")
    p = planner.plan(cfg, gpus=[80 * GiB], host_ram=128 * GiB, world_size=1, ladder=False)
    return p["components"]["activations"]["cuda:0"], p


def test_the_plan_counts_inputs_for_the_checkpointed_layers_and_whole_layers_for_the_others():
    every, _ = _activations("true")
    none, _ = _activations("false")
    half, p = _activations("16")
    layers = p["model"]["num_layers"]
    assert every < half < none
    # each of the 16 layers left keeps its saved tensors instead of its input: (L - N) / L of the gap
    assert (half - every) * layers == (none - every) * (layers - 16)
    assert p["stack"]["gradient_checkpointing"] == 16
    assert "checkpointing 16 of 32 layers" in planner.render_table(p)
    # as many as the model has, or more: every layer
    assert _activations("32")[1]["stack"]["gradient_checkpointing"] is True
    assert _activations("40")[0] == every


@pytest.mark.parametrize("value", ["-1", "sometimes"])
def test_a_checkpointing_value_that_is_no_count_is_one_line(value):
    with pytest.raises(UserError, match=f"trainer.gradient_checkpointing={value} must be true, false, a number"):
        check_stack(compose_cfg(f"trainer.gradient_checkpointing={value}"))


def test_the_trace_of_a_partial_n_combines_its_three_slices_affinely_in_both_kinds_of_layer():
    from bench.trace.partial import SLICES, combine

    def slice_result(ckpt: int, kept: int) -> dict:  # 100 a checkpointed layer, 1000 a kept one, 5 fixed
        total = 5 + 100 * ckpt + 1000 * kept
        comps = {"activations": 100 * ckpt + 1000 * kept, "quantized_weights": 5}
        return {"phases": {"cuda:0|backward": {"total": total, "components": comps}}, "static": {"cuda:0": {}}}

    (c0, k0), layers, n = SLICES[0], 32, 14
    got = combine(*(slice_result(c, k) for c, k in SLICES), n - c0, layers - n - k0)
    assert got["peak"]["cuda:0"] == 5 + 100 * n + 1000 * (layers - n)
    assert got["peak_components"]["cuda:0"]["activations"] == 100 * n + 1000 * (layers - n)


def test_a_vision_language_models_n_counts_its_language_model_layers_not_its_towers(tmp_path):
    from helpers_vision import build_llava

    from qlora_recipes.model.vision import language_model

    model_dir = build_llava(tmp_path / "llava")
    cfg = compose_cfg(f"model.name_or_path={model_dir}", *TINY[:-2], "trainer.gradient_checkpointing=1")
    model = loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))
    base = model.get_base_model()
    text_layers = [m for m in language_model(base)[1].modules() if m in set(decoder_layers(base))]
    assert len(decoder_layers(base)) == len(text_layers) == 2  # the tower's two CLIP layers are not counted
    assert _flags(base) == [True, False]
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert _flags(base) == [True, False]
