"""data.images_per_row: the plan counts a row's images, not one. Every vision term scales with them (the
tower's forward and kept activations, the projector, the eval batch's tower, mllama's cross-attention
features); auto reads the most any row of the data holds where a run reads its rows (1, said so, in a plan
made without the data); a row holding more than a number set there, or a value that is no number of
images, is one line."""

import dataclasses
from collections import defaultdict

import pytest
from conftest import compose_cfg
from helpers_vision import build_llava, build_wide_llava, write_multi_image_rows
from helpers_vlm_families import build_mllama

from qlora_recipes import planner
from qlora_recipes.config.checks import check_stack
from qlora_recipes.errors import UserError
from qlora_recipes.planner.spec import spec_from_cfg
from qlora_recipes.planner.vision import add_vision_eval, add_vision_rows, settle_images

SEQ = 3200  # three of the wide LLaVA's 1,025-token images and their text


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return build_wide_llava(tmp_path_factory.mktemp("wide") / "model")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


def _vision_terms(st, images: int) -> tuple[dict, list[str]]:
    """The vision rows add_vision_rows and add_vision_eval plan for `images` a row, alone."""
    st = dataclasses.replace(st, images_per_row=images, images_auto=False)
    comp, counts = defaultdict(lambda: defaultdict(int)), defaultdict(int)
    notes: list[str] = []
    add_vision_rows(st, comp, counts, "cpu", notes, [])
    add_vision_eval(st, comp, "cpu")
    return {k: comp[k]["cpu"] for k in ("vision_forward", "activations", "eval_transient")}, notes


@pytest.mark.parametrize("tower", ["frozen", "lora"])
def test_the_planned_tower_terms_double_from_one_to_two_images_a_row(wide, tower):
    cfg = compose_cfg(
        f"model.name_or_path={wide}",
        f"model.vision_tower={tower}",
        "precision=fp32",
        f"trainer.seq_len={SEQ}",
        "trainer.micro_batch_size=2",
        "trainer.eval_batch_size=3",
        "data.metric=null",
    )
    st = spec_from_cfg(cfg, 1)
    one, _ = _vision_terms(st, 1)
    two, notes = _vision_terms(st, 2)
    hidden = st.fig.hidden_size
    # the text embeddings the features are written into hold seq_len tokens a row, whatever the images
    train_embeds, eval_embeds = st.train_rows * SEQ * hidden * 4, st.eval_rows * SEQ * hidden * 4
    assert two["vision_forward"] - train_embeds == 2 * (one["vision_forward"] - train_embeds) > 0
    if tower == "lora":  # the tower's kept tensors (a frozen tower keeps none: it is off the autograd graph)
        assert two["activations"] == 2 * one["activations"] > 0
    else:
        assert two["activations"] == one["activations"] == 0
    assert two["eval_transient"] - eval_embeds == 2 * (one["eval_transient"] - eval_embeds) > 0
    assert any("planned for 2 images a row (data.images_per_row=2)" in n for n in notes)


def test_images_past_what_seq_len_holds_are_capped_and_said_so(wide):
    st = spec_from_cfg(compose_cfg(f"model.name_or_path={wide}", f"trainer.seq_len={SEQ}", "data.metric=null"), 1)
    three, _ = _vision_terms(st, 3)
    many, notes = _vision_terms(st, 40)
    assert many == three  # no row of SEQ tokens holds a fourth 1,025-token image
    assert any(
        "planned for 3 images a row (data.images_per_row=40, capped at the 3 seq_len=3200 holds)" in n for n in notes
    )


def test_mllama_cross_attends_to_every_images_tiles(tmp_path):
    mllama = build_mllama(tmp_path / "mllama")
    cfg = compose_cfg(f"model.name_or_path={mllama}", "trainer.seq_len=64", "data.metric=null")
    st = spec_from_cfg(cfg, 1)
    (one, notes_one), (two, notes_two) = _vision_terms(st, 1), _vision_terms(st, 2)
    features = int(next(n for n in notes_one if n.startswith("cross-attention")).split(" read ")[1].split()[0])
    # one token an image in the row: no cap from seq_len; the features a row double with the images
    assert any(f" read {2 * features} image features a row" in n for n in notes_two)
    assert two["activations"] > one["activations"] > 0


def test_a_plan_without_the_data_counts_one_image_a_row_and_says_so(llava):
    cfg = compose_cfg(f"model.name_or_path={llava}", "trainer.seq_len=64", "data.metric=null")
    assert cfg.data.images_per_row == "auto"
    notes = planner.plan(cfg, world_size=1, ladder=False)["notes"]
    assert any(
        "planned for 1 image a row (data.images_per_row=auto with no data read: a run plans the most any row "
        "of its data holds; seq_len holds up to 12)" in n
        for n in notes
    )


def _rows_and_processor(llava, folder):
    from transformers import AutoProcessor

    rows = write_multi_image_rows(folder, (2, 3, 1, 2), size=28)
    return rows, AutoProcessor.from_pretrained(llava)


def test_auto_is_the_most_images_a_row_of_the_data_holds_and_the_run_plans_them(llava, tmp_path):
    from qlora_recipes.data.images import load_image_splits

    rows, processor = _rows_and_processor(llava, tmp_path)
    cfg = compose_cfg(f"model.name_or_path={llava}", f"data.path={rows}", "trainer.seq_len=64", "data.metric=null")
    _, _, stats = load_image_splits(cfg.data, processor, 64, 0)
    assert stats["images_per_row"] == {"images": 3, "where": f"{rows} line 2"}
    first = planner.plan(cfg, world_size=1, ladder=False)
    settled, plan = planner.settle_for_data(cfg, first, stats)
    assert settled.data.images_per_row == 3  # config.yaml records what the plan counted
    line = f"data.images_per_row=auto -> 3 (the most images a row of the data holds: {rows} line 2)"
    assert line in plan["notes"]
    assert any("planned for 3 images a row (data.images_per_row=3)" in n for n in plan["notes"])
    assert plan["components"]["vision_forward"]["cpu"] > first["components"]["vision_forward"]["cpu"]
    # a number set is the user's: kept, and no second line
    explicit = compose_cfg(f"model.name_or_path={llava}", f"data.path={rows}", "data.images_per_row=4")
    assert settle_images(explicit, stats) == (explicit, None)


def test_a_row_holding_more_images_than_set_is_one_line_naming_it(llava, tmp_path):
    from qlora_recipes.data.images import load_image_splits

    rows, processor = _rows_and_processor(llava, tmp_path)
    cfg = compose_cfg(f"model.name_or_path={llava}", f"data.path={rows}", "data.images_per_row=2")
    with pytest.raises(UserError) as err:
        load_image_splits(cfg.data, processor, 64, 0)
    assert str(err.value) == (
        f"{rows} line 2: 3 images in one row, more than data.images_per_row=2 (the memory plan counts that many "
        "a row); set data.images_per_row=3, or auto to read it from the data"
    )
    ok = compose_cfg(f"model.name_or_path={llava}", f"data.path={rows}", "data.images_per_row=3")
    assert load_image_splits(ok.data, processor, 64, 0)[2]["images_per_row"]["images"] == 3


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_value_that_is_no_number_of_images_is_one_line(value):
    cfg = compose_cfg(f"data.images_per_row={value}")
    with pytest.raises(UserError) as err:
        check_stack(cfg)
    assert str(err.value) == (
        f"data.images_per_row={value} must be a whole number of images a row, 1 or more, or auto (the most any "
        "row of the data holds)"
    )
    assert "\n" not in str(err.value)
