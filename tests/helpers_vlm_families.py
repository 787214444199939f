"""Tiny vision-language models beyond LLaVA, built offline from transformers' own config and processor
classes: Qwen2.5-VL, Qwen3-VL (and Qwen3-VL-MoE), Gemma 3, LLaVA-NeXT, Llama-3.2-Vision (mllama), Idefics3
and SmolVLM. Each has a 2-layer language model in the shared tiny figures, a 2-layer vision tower, the
shipped character tokenizer with the family's image tokens added, and a chat template that renders image
parts as the family's image token and marks the assistant's turn with {% generation %}. The colour rows of
helpers_vision train them; FAMILIES names those the loading and training tests take in turn."""

from pathlib import Path

from helpers_families import COMMON
from helpers_vision import TINY, chat_template

# the model_types built here
FAMILIES = ("qwen2_5_vl", "gemma3", "mllama", "idefics3", "smolvlm", "qwen3_vl")


def _tokenizer(*special: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def _ids(tokenizer, *tokens: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


def _save(model_cls, config, processor, out: Path) -> Path:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model_cls(config).save_pretrained(str(out))
    if processor is not None:
        processor.save_pretrained(str(out))
    return out


def _save_parts(model_cls, config, tokenizer, image_processor, processor: dict, out: Path) -> Path:
    """The model dir a hub checkout holds, laid out file by file: weights, tokenizer, image processor and
    processor_config.json. Qwen-VL and SmolVLM processors also build a video processor, which needs
    torchvision: the dir holds none, as the processor the loader builds without torchvision has none."""
    import json

    _save(model_cls, config, None, out)
    tokenizer.save_pretrained(str(out))
    image_processor.save_pretrained(str(out))
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return out


def _qwen_tokenizer():
    tokenizer = _tokenizer("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    tokenizer.chat_template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    ids = _ids(tokenizer, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    return tokenizer, dict(
        zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), ids, strict=True)
    )


def _qwen_image_processor(patch: int):
    """Qwen's image processor: patches merged 2x2, min and max pixels both 2x2 merged patches (4 tokens)."""
    from transformers import Qwen2VLImageProcessorPil

    pixels = (2 * 2 * patch) ** 2
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": pixels, "longest_edge": pixels}, patch_size=patch, merge_size=2, temporal_patch_size=2
    )


def build_qwen2_5_vl(out: Path) -> Path:
    """Qwen2.5-VL: 14-px patches merged 2x2 (image_grid_thw), 56x56 pixels at least and at most: 4 image
    tokens an image."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer, ids = _qwen_tokenizer()
    text = {k: v for k, v in COMMON.items() if k != "head_dim"}  # head_dim = hidden / heads = 16
    text.update(vocab_size=len(tokenizer), rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
    )  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    processor = {"processor_class": "Qwen2_5_VLProcessor"}
    return _save_parts(Qwen2_5_VLForConditionalGeneration, config, tokenizer, _qwen_image_processor(14), processor, out)


# Qwen3-VL's tower (the MoE model's too): 16-px patches merged 2x2, one deepstack layer
QWEN3_VL_TOWER = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
    deepstack_visual_indexes=[0],
)  # fmt: skip


def build_qwen3_vl(out: Path) -> Path:
    """Qwen3-VL: 16-px patches merged 2x2, 64x64 pixels (4 image tokens), one deepstack layer."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer, ids = _qwen_tokenizer()
    text = {**COMMON, "vocab_size": len(tokenizer)}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    vision = QWEN3_VL_TOWER
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    processor = {"processor_class": "Qwen3VLProcessor"}
    return _save_parts(Qwen3VLForConditionalGeneration, config, tokenizer, _qwen_image_processor(16), processor, out)


def build_qwen3_vl_moe(out: Path) -> Path:
    """Qwen3-VL-MoE: Qwen3-VL's tower and processor (4 image tokens an image, one deepstack layer) around a
    2-layer MoE text model: 4 experts fused into 3-D weights, top 2."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    tokenizer, ids = _qwen_tokenizer()
    text = {**COMMON, "vocab_size": len(tokenizer), "num_experts": 4, "num_experts_per_tok": 2}
    text.update(moe_intermediate_size=64, tie_word_embeddings=False)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    vision = QWEN3_VL_TOWER
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids)
    processor = {"processor_class": "Qwen3VLProcessor"}
    return _save_parts(Qwen3VLMoeForConditionalGeneration, config, tokenizer, _qwen_image_processor(16), processor, out)


def _named_tokenizer(**named: str):
    """The shipped tokenizer with the family's image tokens as named special tokens (tokenizer.boi_token)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY, extra_special_tokens=named)


def build_gemma3(out: Path) -> Path:
    """Gemma 3: a SigLIP tower at 28 px (2x2 patches), its projector pooling them to 4 soft tokens between
    <start_of_image> and <end_of_image>."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer = _named_tokenizer(
        boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>"
    )
    boi, eoi, image = _ids(tokenizer, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    text = Gemma3TextConfig(
        **{**COMMON, "vocab_size": len(tokenizer)},
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
        chat_template=chat_template("<start_of_image>"),
    )  # fmt: skip
    return _save(Gemma3ForConditionalGeneration, config, processor, out)


def build_mllama(out: Path) -> Path:
    """Llama-3.2-Vision: a tiled vision tower (28-px tiles, up to 2 a side by the image's aspect ratio)
    whose features the language model reads through a cross-attention layer (its second of 2)."""
    from transformers import (
        MllamaConfig,
        MllamaForConditionalGeneration,
        MllamaImageProcessorPil,
        MllamaProcessor,
        MllamaTextConfig,
        MllamaVisionConfig,
    )

    tokenizer = _tokenizer("<|image|>", "<|python_tag|>")
    (image,) = _ids(tokenizer, "<|image|>")
    text = MllamaTextConfig(
        **{k: v for k, v in COMMON.items() if k != "head_dim"}, cross_attention_layers=[1], tie_word_embeddings=False
    )
    text.vocab_size = len(tokenizer)
    vision = MllamaVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
        image_size=28, patch_size=14, max_num_tiles=2, intermediate_layers_indices=[0],
        vision_output_dim=64, supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
    )  # fmt: skip
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=image)
    image_processor = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
    processor = MllamaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template("<|image|>")
    )
    return _save(MllamaForConditionalGeneration, config, processor, out)


def build_idefics3(out: Path) -> Path:
    """Idefics3: each image resized to 56 px and split into 2x2 sub-images of 28 px plus the whole image,
    each one 28-px SigLIP view (2x2 patches) shuffled down to 1 token."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    grid = [f"<row_{i}_col_{j}>" for i in (1, 2) for j in (1, 2)]
    tokenizer = _tokenizer("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid)
    (image,) = _ids(tokenizer, "<image>")
    text = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})
    vision = Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Idefics3Config(vision_config=vision, text_config=text, image_token_id=image, scale_factor=2)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=1, chat_template=chat_template("<image>")
    )
    return _save(Idefics3ForConditionalGeneration, config, processor, out)


def build_smolvlm(out: Path) -> Path:
    """SmolVLM: Idefics3's image splitting (2x2 sub-images of 28 px and the whole image, 1 token each)."""
    from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil

    grid = [f"<row_{i}_col_{j}>" for i in (1, 2) for j in (1, 2)]
    tokenizer = _tokenizer("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid)
    tokenizer.chat_template = chat_template("<image>")
    (image,) = _ids(tokenizer, "<image>")
    text = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = SmolVLMConfig(vision_config=vision, text_config=text.to_dict(), image_token_id=image, scale_factor=2)
    image_processor = SmolVLMImageProcessorPil(
        size={"longest_edge": 56}, max_image_size={"longest_edge": 28}, do_image_splitting=True
    )
    processor = {"processor_class": "SmolVLMProcessor", "image_seq_len": 1}
    return _save_parts(SmolVLMForConditionalGeneration, config, tokenizer, image_processor, processor, out)


LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # a 28-px base view and 2 or 4 crops of 28 px


def build_llava_next(out: Path) -> Path:
    """LLaVA-NeXT: a CLIP tower at 28 px (2x2 patches and CLS), anyres tiling over LLAVA_NEXT_PINPOINTS (the
    base view and up to 2x2 crops, unpadded to the image's aspect, a newline token a row of features), the
    default strategy dropping CLS: up to 4 + 16 + 4 = 24 image tokens an image."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    tokenizer = _tokenizer("<image>")
    (image,) = _ids(tokenizer, "<image>")
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    text = LlamaConfig(**{**COMMON, "vocab_size": len(tokenizer)})
    config = LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=image, vision_feature_layer=-1,
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
    )  # fmt: skip
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template("<image>"),
    )  # fmt: skip
    return _save(LlavaNextForConditionalGeneration, config, processor, out)


def add_wide_rows(rows: Path) -> int:
    """Rows whose squares sit on a 56 x 28 picture, appended to `rows`: a second shape for the processor
    (mllama's 1x2 aspect-ratio tiles, Idefics3's 2x1 sub-images, Qwen's resize to its pixel bounds).
    Returns how many rows were added."""
    import json

    from helpers_vision import COLOURS, colour_row
    from PIL import Image, ImageDraw

    folder = rows.parent / "images"
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, rgb in COLOURS.items():
        image = Image.new("RGB", (56, 28), (0, 0, 0))
        ImageDraw.Draw(image).rectangle((4, 4, 51, 23), fill=rgb)
        image.save(folder / f"wide-{name}.png")
        lines.append(json.dumps(colour_row(name, f"images/wide-{name}.png")) + "\n")
    with rows.open("a") as f:
        f.writelines(lines)
    return len(lines)
