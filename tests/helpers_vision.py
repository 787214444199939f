"""A tiny LLaVA built offline (a 2-layer CLIP vision tower at 28 px, a 2-layer Llama, the shipped character
tokenizer with an `<image>` token, a LlavaProcessor whose chat template renders image parts) and image rows
that name small PNGs drawn here: what the vision-language tests load and train."""

import importlib.util
import json
from pathlib import Path

from helpers_families import COMMON

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny-llama"
IMAGE_SIZE = 28  # two 14-px patches a side: 4 image tokens per image
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}


def _shipped_vlm_script():
    """scripts/make_tiny_vlm.py (no package): the chat template the shipped tiny VLM renders image parts with."""
    path = TINY.parents[1] / "scripts" / "make_tiny_vlm.py"
    spec = importlib.util.spec_from_file_location("make_tiny_vlm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chat_template = _shipped_vlm_script().chat_template
CHAT_TEMPLATE = chat_template("<image>")


def build_llava(out: Path) -> Path:
    """A tiny random LLaVA saved in `out` as a user's model dir: weights, config, tokenizer and processor."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
        projection_dim=32,
    )
    text = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",  # with no CLS token dropped: 4 features, 4 image tokens
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(str(out))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,  # CLIP's CLS token: the "full" strategy keeps it, so 5 tokens an image
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    return out


def draw_images(folder: Path) -> dict[str, Path]:
    """One IMAGE_SIZE-px PNG a colour, a filled square on black: {colour: path}."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rgb in COLOURS.items():
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
        ImageDraw.Draw(image).rectangle((4, 4, IMAGE_SIZE - 5, IMAGE_SIZE - 5), fill=rgb)
        paths[name] = folder / f"{name}.png"
        image.save(paths[name])
    return paths


def colour_row(colour: str, image: str) -> dict:
    """A row asking for the square's colour, its image named relative to the data file."""
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]},
        ],
        "images": [image],
    }


def write_colour_rows(folder: Path, repeats: int = 8) -> Path:
    """rows.jsonl beside images/ (each colour's square, `repeats` rows each): the data file a run trains on."""
    draw_images(folder / "images")
    rows = [colour_row(c, f"images/{c}.png") for _ in range(repeats) for c in COLOURS]
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


WIDE_IMAGE_SIZE = 448  # 32 x 32 patches of 14 px and CLS: 1,025 image tokens an image, a tower forward of some size


def build_wide_llava(out: Path) -> Path:
    """A tiny LLaVA whose tower's work is a large part of a CPU run's peak: a 2-layer CLIP tower 256 wide
    at WIDE_IMAGE_SIZE px (1,025 tokens an image, the "full" strategy keeping CLS) around the 2-layer Llama,
    with the positions for rows of several images."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=2048,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=WIDE_IMAGE_SIZE,
        patch_size=14,
        projection_dim=256,
    )
    text = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer), "max_position_embeddings": 4096})
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(str(out))
    edge = {"height": WIDE_IMAGE_SIZE, "width": WIDE_IMAGE_SIZE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": WIDE_IMAGE_SIZE}, crop_size=edge),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    return out


def write_multi_image_rows(folder: Path, counts: tuple[int, ...], size: int = WIDE_IMAGE_SIZE) -> Path:
    """rows.jsonl beside images/: a row for each of `counts`, holding that many squares (colours in turn),
    asked their colours in order."""
    from PIL import Image, ImageDraw

    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    for name, rgb in COLOURS.items():
        image = Image.new("RGB", (size, size), (0, 0, 0))
        ImageDraw.Draw(image).rectangle((size // 7, size // 7, size - size // 7, size - size // 7), fill=rgb)
        image.save(folder / "images" / f"{name}.png")
    rows = []
    for i, n in enumerate(counts):
        colours = [names[(i + j) % len(names)] for j in range(n)]
        content = [{"type": "image"} for _ in colours] + [{"type": "text", "text": "colours?"}]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": " ".join(colours)}]},
                ],
                "images": [f"images/{c}.png" for c in colours],
            }
        )
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
