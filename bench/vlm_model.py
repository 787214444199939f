"""A LLaVA-shaped model for the planner suites, written locally with random weights: a 12-layer
CLIP-ViT-B/16-shaped vision tower at 224 px (196 image tokens an image, LLaVA-1.5's second-to-last layer
without its CLS token), a two-linear projector and a Llama language model of the suite's figures; the
word-level tokenizer with an `<image>` token, a LlavaProcessor whose chat template renders image parts and
marks the assistant's turn, and image rows (messages + images) of 224 px PNGs."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.models import write_tokenizer

IMAGE_SIZE, PATCH = 224, 16
# hidden, intermediate, layers, heads: CLIP ViT-B/16's tower
TOWER = (768, 3072, 12, 12)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set parts = [{'type': 'text', 'text': m['content']}] %}"
    "{% else %}{% set parts = m['content'] %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% for p in parts %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    " {{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "{% for p in parts %}{% if p['type'] == 'image' %}<image> {% elif p['type'] == 'text' %}{{ p['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)


def build_llava(out: Path, text_config, words: int = 24, rows: int = 64) -> Path:
    """The model in `out` (bf16 safetensors), its tokenizer and processor, images/ and rows.jsonl: each
    row an image and `words` words asked, `words` answered (1 + 196 + 2 * words + 1 tokens)."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, text_config.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text_config.vocab_size = len(tokenizer)
    config = llava_config(text_config, tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(str(out))
    edge = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=edge),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the default strategy: 196 tokens
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    write_image_rows(out, text_config.vocab_size - 1, words, rows)
    return out


def llava_config(text_config, image_token: int):
    """The LlavaConfig: the CLIP-B/16-shaped tower at 224 px, LLaVA-1.5's feature layer and strategy."""
    from transformers import CLIPVisionConfig, LlavaConfig

    hidden, inter, layers, heads = TOWER
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_index=image_token,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        dtype="bfloat16",
    )


def write_planning_dir(out: Path, text_config) -> Path:
    """What the planner reads of the model, without weights: its config.json and processor_config.json
    (the image token is the one added after the word-level vocabulary)."""
    text_config.vocab_size += 1
    llava_config(text_config, text_config.vocab_size - 1).save_pretrained(out)
    settings = {
        "image_processor": {
            "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_center_crop": True,
            "size": {"shortest_edge": IMAGE_SIZE},
        },
        "num_additional_image_tokens": 1,
        "patch_size": PATCH,
        "vision_feature_select_strategy": "default",
    }
    (out / "processor_config.json").write_text(json.dumps(settings, indent=1) + "\n")
    return out


def write_image_rows(out: Path, vocab: int, words: int, rows: int) -> Path:
    """images/ (four 224 px squares) and rows.jsonl beside them."""
    from PIL import Image

    (out / "images").mkdir(exist_ok=True)
    colours = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 220, 30)]
    for i, rgb in enumerate(colours):
        Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), rgb).save(out / "images" / f"{i}.png")
    rng = random.Random(0)

    def text() -> str:
        return " ".join(f"w{rng.randrange(4, vocab)}" for _ in range(words))

    with open(out / "rows.jsonl", "w") as f:
        for i in range(rows):
            row = {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text()}]},
                    {"role": "assistant", "content": [{"type": "text", "text": text()}]},
                ],
                "images": [f"images/{i % len(colours)}.png"],
            }
            f.write(json.dumps(row) + "\n")
    return out / "rows.jsonl"
