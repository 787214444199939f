"""A vision-language stack in the tracer: the model as `load_model` builds it for one, and its image rows.

The model: transformers' image-text-to-text class of the figures' whole config (vision tower, projector,
language model), layer slices cut from its language model, the vision parts left unquantized by the
same skip list the loader gives bitsandbytes (transformers' default, the parts `model/vision_tower`
leaves unquantized). `loading.make_trainable` then does what it does for a VLM (the tower back in the
compute dtype after k-bit prep, LoRA on the language model).

The rows (Gemma 3): each one image, rendered by the model's processor as the checkpoint configures it
(`Gemma3Processor`: `<start_of_image>`, mm_tokens_per_image soft tokens, `<end_of_image>`; its image
processor at the vision config's image_size), the shipped character tokenizer standing in for the
checkpoint's (no hub here: its image tokens are mapped to the config's ids), text filling the row to
seq_len. The processor's pixel_values and token_type_ids go into the batch, as TRL's vision collator
passes them; labels on every text position, -100 on the image's tokens.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tiny-llama"
NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
CONFIG_IDS = {"boi_token": "boi_token_index", "eoi_token": "eoi_token_index", "image_token": "image_token_index"}


def is_vlm(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def set_layers(config, layers: int) -> None:
    """A layer slice of the language model (its text_config)."""
    text = config.get_text_config()
    text.num_hidden_layers = int(layers)
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[: int(layers)]


def skip_list(cfg: Any, meta) -> list[str]:
    """What bitsandbytes leaves unquantized in the VLM, as `vision.skipped_from_quantization` computes it
    for the loader (from the model skeleton here: the conf entry has no config.json on disk)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    from qlora_recipes.model.vision import vision_prefixes
    from qlora_recipes.model.vision_tower import left_unquantized

    user = [str(m) for m in (cfg.quant.skip_modules or ())]
    default = set(get_keys_to_not_convert(meta))
    return sorted(default | set(user) | set(left_unquantized(meta, vision_prefixes(meta), cfg.model.vision_tower)))


def processor(config):
    """The model's processor as its checkpoint configures it (Gemma 3 only so far)."""
    if config.model_type != "gemma3":
        raise NotImplementedError(f"image rows of a {config.model_type} model are not traced (Gemma 3 is)")
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    edge = int(config.vision_config.image_size)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER), extra_special_tokens=NAMED)
    images = Gemma3ImageProcessorPil(size={"height": edge, "width": edge})
    return Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=int(config.mm_tokens_per_image)
    )


def image_rows(config, rows: int, seq: int) -> dict:
    """`rows` rows of `seq` tokens (the last one token short at rows > 1, then padded), one image each,
    on real tensors: input_ids, attention_mask, token_type_ids, pixel_values, labels."""
    import torch
    from PIL import Image

    proc = processor(config)
    tok = proc.tokenizer
    lengths = [seq] * rows if rows == 1 else [seq] * (rows - 1) + [seq - 1]
    text = f"{tok.boi_token} What shape is this?"
    got = proc(text=[text] * rows, images=[[Image.new("RGB", (64, 48), (200, 40, 40))]] * rows, return_tensors="pt")
    ids = got["input_ids"].clone()
    for name, key in CONFIG_IDS.items():  # the stand-in tokenizer's ids -> the checkpoint's
        ids[got["input_ids"] == tok.convert_tokens_to_ids(getattr(tok, name))] = int(getattr(config, key))
    prefix = ids.shape[1]
    if prefix >= min(lengths):
        raise ValueError(f"an image row takes {prefix} tokens: seq_len {seq} leaves no text")
    out_ids = torch.zeros(rows, seq, dtype=torch.long)
    mask = torch.zeros(rows, seq, dtype=torch.long)
    types = torch.zeros(rows, seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        out_ids[i, :prefix] = ids[i]
        out_ids[i, prefix:n] = 3 + (torch.arange(n - prefix) % 90)  # the tokenizer's characters
        mask[i, :n] = 1
        types[i, :prefix] = got["token_type_ids"][i]
    labels = out_ids.masked_fill((types == 1) | (mask == 0), -100)
    batch = {"input_ids": out_ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}
    batch["pixel_values"] = got["pixel_values"]
    if rows == 1:
        batch.pop("attention_mask")  # no padding: transformers skips the mask, as step.py's text rows
    return batch


def phase_hooks(model, tracker) -> list:
    """Phase `vision` from the tower's forward to the projector's output (the plan's vision forward),
    then `forward` again, what the tower keeps for backward then counted as activations (the plan's
    row for it). Returns the hook handles."""
    from qlora_recipes.model.vision import vision_prefixes

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefixes = vision_prefixes(base)
    if not prefixes:
        return []
    first, last = base.get_submodule(prefixes[0]), base.get_submodule(prefixes[-1])

    def start(module, args):
        if tracker.phase == "forward":
            tracker.phase = "vision"

    def end(module, args, output):
        if tracker.phase == "vision":
            tracker.phase = "forward"
            tracker.relabel_live("vision_forward", "activations")  # the checkpointed tower layers' inputs

    return [first.register_forward_pre_hook(start), last.register_forward_hook(end)]


@contextlib.contextmanager
def checks_hold(config):
    """transformers checks that a row's image tokens match the image features (a boolean tensor read as a
    Python bool: data a fake tensor has none of); the processor made them match, so the check holds."""
    from bench.trace import kernels

    if not is_vlm(config):
        yield
        return
    kernels.BOOL_READS.append(True)
    try:
        yield
    finally:
        kernels.BOOL_READS.pop()
