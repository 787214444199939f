"""model.vision_tower: `quantized` loads the tower's linears in quant's 4-bit format (the projector stays
unquantized, nothing of either trains), `lora` adds LoRA to the tower's linears beside the language
model's and the tower's adapters get gradients from the images; a choice the stack cannot carry out is
one line (a tiny LLaVA built offline)."""

import pytest
from conftest import REPO, compose_cfg
from helpers_vision import build_llava, colour_row, draw_images

from qlora_recipes.errors import UserError

TOWER, PROJECTOR = ".vision_tower.", ".multi_modal_projector."


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


def _trainable(llava, tmp_path, *overrides):
    from qlora_recipes.model import loading

    cfg = compose_cfg(f"model.name_or_path={llava}", "quant=nf4", "optim=paged8bit", *overrides)
    return cfg, loading.make_trainable(cfg, loading.load_model(cfg, tmp_path))


def test_a_quantized_tower_has_4bit_linears_and_trains_nothing(llava, tmp_path):
    import bitsandbytes as bnb

    from qlora_recipes.model import loading

    cfg, model = _trainable(llava, tmp_path, "model.vision_tower=quantized", "precision=bf16")
    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert any(TOWER in n for n in four_bit) and not any(PROJECTOR in n for n in four_bit)
    tower_linears = [n for n, m in model.named_modules() if TOWER in n and type(m).__name__ == "Linear"]
    assert not tower_linears  # every tower linear is 4-bit
    compute = loading.torch_dtype(cfg.precision.dtype)
    floats = [(n, p) for n, p in model.named_parameters() if (TOWER in n or PROJECTOR in n) and p.is_floating_point()]
    assert floats and all(p.dtype == compute for _, p in floats)  # norms, embeddings, projector: bf16 after prep
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and not any(TOWER in n or PROJECTOR in n for n in trained)


def test_lora_on_the_tower_adapts_its_linears_and_learns_from_the_images(llava, tmp_path):
    import torch
    from peft.tuners.lora import LoraLayer

    from qlora_recipes.model.loading import source
    from qlora_recipes.model.vision import load_processor

    cfg, model = _trainable(llava, tmp_path, "model.vision_tower=lora")
    lora = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    in_tower = {n.rsplit(".", 1)[-1] for n in lora if TOWER in n}
    assert in_tower == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}  # CLIP's linears
    assert any(".language_model." in n for n in lora) and not any(PROJECTOR in n for n in lora)
    frozen = [n for n, p in model.named_parameters() if TOWER in n and "lora_" not in n]
    assert frozen and not any(model.get_parameter(n).requires_grad for n in frozen)

    processor = load_processor(cfg.model, source(cfg.model))
    image = draw_images(tmp_path / "images")["red"]
    row = colour_row("red", str(image))
    from PIL import Image

    batch = processor.apply_chat_template(
        [row["messages"]], tokenize=True, return_dict=True, return_tensors="pt", images=[[Image.open(image)]]
    )
    model.train()
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if TOWER in n and "lora_B" in n]
    assert grads and all(g is not None for g in grads) and any(torch.count_nonzero(g) for g in grads)


@pytest.mark.parametrize(
    "overrides,line",
    [
        ((f"model.name_or_path={REPO / 'assets/tiny-llama'}", "model.vision_tower=lora"),
         r"model.vision_tower=lora: model.name_or_path=.*tiny-llama is a text model, with no vision tower; drop "
         r"model.vision_tower"),
        (("LLAVA", "model.vision_tower=quantized", "quant=none", "optim=adamw"),
         r"model.vision_tower=quantized puts the tower's linears in quant's format, and quant=none quantizes nothing"),
        (("LLAVA", "model.vision_tower=lora", "peft.target_modules=.*q_proj"),
         r"model.vision_tower=lora adds LoRA to the tower's linears, and peft.target_modules is a regular expression"),
    ],
)  # fmt: skip
def test_a_tower_choice_the_stack_cannot_carry_out_is_one_line(llava, overrides, line):
    from qlora_recipes.model.vision import refuse_untried

    overrides = [f"model.name_or_path={llava}" if o == "LLAVA" else o for o in overrides]
    with pytest.raises(UserError, match=line):
        refuse_untried(compose_cfg(*overrides))
    from qlora_recipes.config.loader import load

    with pytest.raises(UserError, match=r"model.vision_tower"):  # a name the schema does not know
        load([f"model.name_or_path={llava}", "model.vision_tower=trained"])
