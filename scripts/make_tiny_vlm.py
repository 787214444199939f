"""Build a tiny vision-language model for the shipped shapes sample: a LLaVA whose language model is the
shipped tiny base (assets/tiny-llama, so it already writes words) with an `<image>` token added, a
randomly initialised 2-layer CLIP vision tower at 28 px and a projector, and a LlavaProcessor whose chat
template renders image parts. Seeded; built in seconds on CPU, so it is not shipped: `make shapes` builds
it at first use.

    python scripts/make_tiny_vlm.py [--out runs/tiny-llava]
"""

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE_SIZE = 28  # two 14-px patches a side


def chat_template(image: str = "<image>") -> str:
    """The tiny base's template, with a content list's parts rendered in order (an image part as `image`)
    and the assistant's turn inside {% generation %}: the loss is on what the assistant says."""
    return (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['content'] is string %}{% set parts = [{'type': 'text', 'text': m['content']}] %}"
        "{% else %}{% set parts = m['content'] %}{% endif %}"
        "{% if m['role'] == 'assistant' %}assistant: {% generation %}"
        "{% for p in parts %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
        "{{ eos_token }}{% endgeneration %}{{ '\\n' }}"
        "{% else %}{{ m['role'] }}: "
        "{% for p in parts %}{% if p['type'] == 'image' %}" + image + "{% elif p['type'] == 'text' %}{{ p['text'] }}"
        "{% endif %}{% endfor %}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )


def build(out: Path, base: Path = REPO / "assets" / "tiny-llama", seed: int = 0) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaForCausalLM,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text_model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    text_model.resize_token_embeddings(len(tokenizer))
    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=14,
        projection_dim=64,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text_model.config,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",  # the CLS token kept: 5 image tokens an image
    )
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
        chat_template=chat_template(),
    )
    processor.save_pretrained(str(out))
    print(f"saved a tiny LLaVA ({sum(p.numel() for p in model.parameters()):,} params) to {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "tiny-llava")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    build(args.out, seed=args.seed)


if __name__ == "__main__":
    main()
