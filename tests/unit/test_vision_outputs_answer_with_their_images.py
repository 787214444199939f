"""A vision-language model's outputs: prompts with images rendered by the processor and answered (the
one helper generate, merge's quality check and the metric share), exact match on image rows, the merge's
vision tensors kept as stored, the model card of a VLM run, and one line for each bad --image."""

import json
from pathlib import Path

import pytest
import torch
from conftest import SMOKE, compose_cfg
from helpers_vision import COLOURS, build_llava, colour_row, draw_images, write_colour_rows

from qlora_recipes.errors import UserError
from qlora_recipes.outputs.images import generate_with_images, image_inputs, image_prompt, open_images
from qlora_recipes.outputs.prompts import Prompt, PromptFormat

IMAGE_TOKENS = 5  # the tiny LLaVA's tokens an image (4 patches + CLIP's CLS, helpers_vision)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def llava(llava_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(llava_dir), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(llava_dir))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    return draw_images(tmp_path_factory.mktemp("images"))


def _error(call) -> str:
    with pytest.raises(UserError) as err:
        call()
    return str(err.value)


def test_a_missing_a_directory_or_an_unreadable_image_is_one_line_naming_it(tmp_path, images):
    broken = tmp_path / "broken.png"
    broken.write_text("not a png")
    assert _error(lambda: open_images([str(tmp_path / "gone.png")])) == (
        f"--image {tmp_path / 'gone.png'}: no such file; give an image file (PNG, JPEG, ...)"
    )
    assert "is a directory" in _error(lambda: open_images([str(tmp_path)]))
    line = _error(lambda: open_images([str(broken)]))
    assert line.startswith(f"--image {broken}: not an image PIL can read") and "\n" not in line
    opened = open_images([str(images["red"]), str(images["blue"])])
    assert [i.mode for i in opened] == ["RGB", "RGB"] and opened[0].getpixel((14, 14)) == (220, 30, 30)


def test_a_typed_prompt_asks_about_its_images_before_its_text():
    fmt = PromptFormat(style="chat", system="be brief")
    asked = image_prompt(Prompt("text", "colour?"), fmt, ["a", "b"])
    assert asked.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "colour?"}]},
    ]
    assert asked.images == ["a", "b"] and asked.show() == "system: be brief | user: <image><image>colour?"
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    assert image_prompt(Prompt("messages", turns), fmt, ["a"]).messages == turns  # its own image part kept
    assert "1 image part(s) but 2 image file(s)" in _error(lambda: image_prompt(Prompt("messages", turns), fmt, "ab"))
    assert "--raw" in _error(lambda: image_prompt(Prompt("formatted", "user: colour?\n"), fmt, ["a"]))
    alone = [{"role": "system", "content": "be brief"}]  # a row of a mixed file: no images, nothing to place
    assert image_prompt(Prompt("messages", alone), fmt, []).messages == alone
    assert "no user turn to put the images in" in _error(lambda: image_prompt(Prompt("messages", alone), fmt, ["a"]))


def test_an_image_prompt_is_rendered_with_its_image_tokens_and_pixels(llava, images):
    model, processor = llava
    asked = image_prompt(Prompt("text", "colour?"), PromptFormat(style="chat"), open_images([str(images["red"])] * 2))
    inputs = image_inputs(processor, asked)
    image_id = model.config.image_token_id
    assert int((inputs["input_ids"] == image_id).sum()) == 2 * IMAGE_TOKENS
    assert tuple(inputs["pixel_values"].shape) == (2, 3, 28, 28)
    # the prompt is the start of the row as training rendered it (data.images counts those tokens)
    from trl.data_utils import prepare_multimodal_messages

    row = colour_row("red", "unused")["messages"]
    row[0]["content"] = [{"type": "image"}, *row[0]["content"]]
    trained = processor.apply_chat_template(
        [prepare_multimodal_messages(row, images=asked.images)],
        tokenize=True,
        return_dict=True,
        processor_kwargs={"add_special_tokens": False},
    )["input_ids"][0]
    prompt = inputs["input_ids"][0].tolist()
    assert trained[: len(prompt)] == prompt and len(trained) > len(prompt)


def test_generation_with_images_decodes_only_the_new_tokens_and_the_image_changes_the_answer(llava, images):
    model, processor = llava
    fmt = PromptFormat(style="chat")
    asked = [image_prompt(Prompt("text", "colour?"), fmt, open_images([str(images[c])])) for c in ("red", "blue")]
    got = generate_with_images(model, processor, asked, max_new_tokens=6)
    for prompt, text in zip(asked, got, strict=True):
        inputs = image_inputs(processor, prompt)
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        new = out[0, inputs["input_ids"].shape[1] :]
        eos = processor.tokenizer.eos_token_id
        new = new[: (new == eos).nonzero()[0, 0]] if (new == eos).any() else new
        assert text == processor.tokenizer.decode(new, skip_special_tokens=True)
        assert "colour?" not in text
    # the pixels reach the model: the two squares' prompts give different logits at the answer
    logits = [model(**image_inputs(processor, p)).logits[0, -1] for p in asked]
    assert not torch.allclose(logits[0], logits[1])


def _image_splits(tmp_path, llava_dir, *overrides):
    from qlora_recipes.data.images import load_image_splits
    from qlora_recipes.model import loading, vision

    rows = write_colour_rows(tmp_path / "data", repeats=2)
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={llava_dir}", f"data.path={rows}", *overrides)
    processor = vision.load_processor(cfg.model, loading.source(cfg.model))
    return cfg, processor, load_image_splits(cfg.data, processor, 64, 0)


def test_exact_match_on_image_rows_answers_each_held_out_row_with_its_image(tmp_path, llava_dir, llava):
    from qlora_recipes.run import metrics

    model, processor = llava
    cfg, _, (_, eval_ds, stats) = _image_splits(
        tmp_path, llava_dir, "data.metric=exact_match", "data.eval_fraction=0.5"
    )
    assert stats["metric"] == "eval loss + exact match"
    pairs = metrics.image_pairs(eval_ds, None)
    assert len(pairs) == len(eval_ds) == 4
    prompt, reference = pairs[0]
    assert reference in ("red", "green", "blue", "yellow") and len(prompt.images) == 1
    assert [m["role"] for m in prompt.messages] == ["user"]
    said = generate_with_images(model, processor, [p for p, _ in pairs], cfg.data.max_new_tokens)
    scored = [(p, s) for (p, _), s in zip(pairs, said, strict=True)]
    assert metrics.image_exact_match(model, processor, scored, cfg.data.max_new_tokens) == 1.0
    half = scored[:2] + [(p, s + "x") for p, s in scored[2:]]
    assert metrics.image_exact_match(model, processor, half, cfg.data.max_new_tokens) == 0.5
    assert metrics.image_pairs(eval_ds, 0) == [] and metrics.image_exact_match(model, processor, [], 4) is None


def test_merge_compares_on_the_held_out_image_rows_with_their_pixels(tmp_path, llava_dir, llava):
    from qlora_recipes.merge import quality

    model, processor = llava
    cfg, processor, _ = _image_splits(tmp_path, llava_dir, "data.eval_fraction=0.5")
    batches, source = quality.compare_prompts(cfg, processor.tokenizer, None, "chat", processor)
    assert source.startswith("eval data of the run (0.5 of") and len(batches) == 4
    assert all(b["pixel_values"].shape[0] == 1 for b in batches)
    logits = quality.prompt_logits(model, batches)
    assert [t.shape[0] for t in logits] == [b["input_ids"].shape[1] for b in batches]
    assert torch.equal(logits[0], model(**batches[0]).logits[0])


def test_the_merge_writes_the_vision_tensors_as_the_base_stored_them(tmp_path):
    from safetensors.torch import load_file

    from qlora_recipes.merge.export import ShardWriter

    writer = ShardWriter(tmp_path, 1 << 30, torch.bfloat16)
    exact = torch.tensor([1.0 + 2**-20], dtype=torch.float32)  # bf16 would round it to 1.0
    writer.add("vision", exact, keep_dtype=True)
    writer.add("language", exact)
    writer.close()
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["vision"], exact) and saved["language"].dtype == torch.bfloat16


def test_a_vision_run_without_its_processor_is_one_line(tmp_path, llava_dir):
    from transformers import AutoTokenizer

    from qlora_recipes.outputs.generation import load_processor_of

    AutoTokenizer.from_pretrained(str(llava_dir)).save_pretrained(str(tmp_path / "run" / "adapter"))
    line = _error(lambda: load_processor_of(tmp_path / "run", "run"))
    assert line.startswith(f"{tmp_path / 'run' / 'adapter'}: ") and "re-run training" in line and "\n" not in line


def _finished_run(folder: Path, *overrides: str) -> Path:
    from qlora_recipes.config.loader import to_yaml
    from qlora_recipes.outputs.runfiles import run_file_names, write_manifest

    (folder / "adapter").mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(compose_cfg(*SMOKE, *overrides)))
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    (folder / "metrics.json").write_text(json.dumps({"status": "ok"}))
    write_manifest(folder, run_file_names(folder))
    return folder


def _generate(argv: list[str], capsys) -> str:
    from qlora_recipes.cli.generate import run

    with pytest.raises(SystemExit) as done:
        run(argv)
    assert done.value.code == 2
    return capsys.readouterr().err.strip()


def test_image_on_a_text_model_or_a_missing_image_is_one_line_before_anything_loads(tmp_path, capsys, llava_dir):
    text_run = _finished_run(tmp_path / "text")
    image = draw_images(tmp_path / "images")["red"]
    assert _generate([str(text_run), "colour?", "--image", str(image)], capsys) == (
        f"error: --image: {text_run} holds a text model, which cannot see images; drop --image, or pass a "
        "vision-language model's run or merged dir"
    )
    vision_run = _finished_run(tmp_path / "vision", f"model.name_or_path={llava_dir}")
    assert _generate([str(vision_run), "colour?", "--image", str(tmp_path / "gone.png")], capsys) == (
        f"error: --image {tmp_path / 'gone.png'}: no such file; give an image file (PNG, JPEG, ...)"
    )


def test_a_vision_runs_card_names_its_parts_its_processor_and_an_image_example(tmp_path, llava_dir):
    from qlora_recipes.integrations.vision_card import vision_lines, vision_usage

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(colour_row("red", "images/red.png")) + "\n")
    cfg = compose_cfg(*SMOKE, f"model.name_or_path={llava_dir}", f"data.path={rows}", "quant=nf4")
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "processor_config.json").write_text('{"processor_class": "LlavaProcessor"}')
    card = "\n".join(vision_lines(cfg, tmp_path / "run", "merged"))
    assert "Its language model (`model.language_model`) was loaded in nf4 (bitsandbytes)" in card
    assert "`model.vision_tower`, `model.multi_modal_projector` stayed unquantized" in card
    assert "`LlavaProcessor`" in card and 'qlora generate RUN_DIR/merged "colour?" --image red.png' in card
    use = "\n".join(vision_usage("merged", "org/tuned", None, cfg))
    assert 'AutoModelForImageTextToText.from_pretrained("org/tuned")' in use and '"path": "red.png"' in use
    assert "are the base's tensors, unchanged" in card
    assert vision_lines(compose_cfg(*SMOKE), tmp_path / "run", "adapter") == []  # a text run: no such section
    cfg.model.vision_tower = "lora"
    card = "\n".join(vision_lines(cfg, tmp_path / "run", "merged"))
    assert "LoRA adapted the vision tower's linears too" in card and "unchanged" not in card


def test_image_rows_of_a_prompts_file_keep_their_images_read_from_the_files_folder(tmp_path):
    from qlora_recipes.outputs.prompts import read_prompts

    rows = write_colour_rows(tmp_path, repeats=1)
    prompts = read_prompts(rows)
    assert len(prompts) == 4 and prompts[0].kind == "messages"
    assert prompts[0].images == [str(tmp_path / "images" / "red.png")]
    assert prompts[0].show() == "user: <image>colour?"


def test_a_merged_vision_dir_answers_each_image_row_of_a_prompts_file_with_its_own_image(tmp_path, capsys, llava):
    from qlora_recipes.cli.generate import run

    model, processor = llava
    merged = build_llava(tmp_path / "merged")  # a standalone VLM dir, as merge writes one
    rows = write_colour_rows(tmp_path / "data", repeats=1)
    with pytest.raises(SystemExit) as done:
        run([str(merged), "--file", str(rows), "--jsonl", "--max-new-tokens", "3"])
    assert done.value.code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["images"] for line in lines] == [[str(rows.parent / "images" / f"{c}.png")] for c in COLOURS]
    fmt = PromptFormat(style="plain")
    asked = [image_prompt(Prompt("messages", line["prompt"]), fmt, open_images(line["images"])) for line in lines]
    assert [line["generation"] for line in lines] == generate_with_images(model, processor, asked, 3)


def test_a_prompts_images_on_a_text_model_or_beside_image_is_one_line(tmp_path, capsys):
    rows = write_colour_rows(tmp_path / "data", repeats=1)
    text_run = _finished_run(tmp_path / "text")
    assert _generate([str(text_run), "--file", str(rows)], capsys) == (
        f"error: the prompts' images: {text_run} holds a text model, which cannot see images; drop the rows' images, "
        "or pass a vision-language model's run or merged dir"
    )
    image = str(rows.parent / "images" / "red.png")
    assert "--image with a prompts file whose rows name their own images" in _generate(
        [str(text_run), "--file", str(rows), "--image", image], capsys
    )
    bare = tmp_path / "bare.jsonl"
    row = colour_row("red", "images/red.png")
    del row["images"]
    bare.write_text(json.dumps(row) + "\n")
    assert _generate([str(text_run), "--file", str(bare)], capsys) == (
        "error: prompt 'user: <image>colour?' has image parts but no images: pass --image PATH for them, or give "
        "the row an 'images' list"
    )


def test_merge_prompts_file_of_image_rows_compares_with_their_images(tmp_path, llava_dir):
    from qlora_recipes.merge import quality

    cfg, processor, _ = _image_splits(tmp_path, llava_dir)
    rows = write_colour_rows(tmp_path / "asked", repeats=1)
    batches, source = quality.compare_prompts(cfg, processor.tokenizer, str(rows), "chat", processor)
    assert source == str(rows) and len(batches) == 4
    assert all(tuple(b["pixel_values"].shape) == (1, 3, 28, 28) for b in batches)


def test_merge_reads_the_held_out_rows_under_the_runs_image_bound(tmp_path, llava_dir):
    from qlora_recipes.data.images import held_out_rows

    cfg, _, _ = _image_splits(tmp_path, llava_dir, "data.eval_fraction=0.5")
    assert len(held_out_rows(cfg.data, cfg.seed)[0]) == 4
    cfg.data.image_file_max_pixels = 500  # below the squares' 28 x 28
    assert "over data.image_file_max_pixels=500" in _error(lambda: held_out_rows(cfg.data, cfg.seed))


def test_the_merge_copies_only_the_vision_tensors_no_lora_adapted(llava_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from qlora_recipes.merge.tensors import vision_keys

    base = AutoModelForImageTextToText.from_pretrained(str(llava_dir), dtype=torch.float32)
    targets = r"model\.(vision_tower\..*\.q_proj|language_model\..*\.v_proj)"  # model.vision_tower=lora's shape
    model = get_peft_model(base, LoraConfig(r=2, target_modules=targets))
    keys = vision_keys(model)
    assert not any("q_proj" in k or "lora_" in k or "base_layer" in k for k in keys)  # merged, not copied
    assert "vision_tower.encoder.layers.0.self_attn.k_proj.weight" in keys  # the checkpoint's own names
    assert any("multi_modal_projector" in k for k in keys)
    assert not any("language_model" in k for k in keys)
