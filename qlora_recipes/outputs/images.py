"""Prompts with images for a vision-language model: the one place they are rendered and answered.

    open_images(paths, what) -> [PIL.Image]                   # one line for a missing or unreadable file
    image_prompt(prompt, fmt, images) -> ImagePrompt           # a typed prompt (or turns) with its images
    image_inputs(processor, prompt) -> BatchFeature            # ids, mask, pixel values, as the run trained
    generate_with_images(model, processor, prompts, max_new_tokens, ...) -> [str]

`qlora generate --image`, the merge's quality check and the exact-match metric on image rows all come
here. A prompt is rendered by the processor's chat template with its image parts, as the trainer's
collator rendered the rows (TRL's `prepare_multimodal_messages`, no special tokens added beside what the
template writes), then the processor turns each image into pixels and its image tokens. Prompts go
`batch_size` at a time through the processor's batch call, left-padded, as text prompts go
(generation.generate: at most `max_batch_tokens` positions a batch, a longer prompt alone), greedy
unless a temperature is given; only the new tokens are decoded. A prompt is never cut to the run's
seq_len: a cut would split an image's tokens from its pixels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from .prompts import Prompt, PromptFormat

log = logging.getLogger(__name__)


@dataclass
class ImagePrompt:
    """Turns before the answer (content: a string or a list of text and image parts) and the images
    their image parts stand for, in order (PIL images or file paths)."""

    messages: list[dict]
    images: list = field(default_factory=list)

    def show(self) -> str:
        texts = []
        for m in self.messages:
            content = m["content"]
            parts = [content] if isinstance(content, str) else [_part_text(p) for p in content]
            texts.append(f"{m['role']}: {''.join(parts)}")
        return " | ".join(texts).replace("\n", "\\n")


def image_parts(messages: list[dict]) -> int:
    """How many image parts the turns hold."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    )


def _part_text(part: dict) -> str:
    return "<image>" if part.get("type") == "image" else str(part.get("text") or "")


def open_images(paths: list[str], what: str = "--image") -> list:
    """Each file opened as an RGB image; a missing or unreadable one is one line naming it."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.is_file():
            kind = "is a directory" if path.is_dir() else "no such file"
            raise UserError(f"{what} {raw}: {kind}; give an image file (PNG, JPEG, ...)")
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except Image.DecompressionBombError:
            raise UserError(f"{what} {raw}: too large to load safely; resize it") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise UserError(f"{what} {raw}: not an image PIL can read ({first}); give a PNG, JPEG, ...") from None
    return images


def image_prompt(prompt: Prompt, fmt: PromptFormat, images: list) -> ImagePrompt:
    """A typed prompt as a user turn (after the run's system message), or a prompts file's turns, with
    `images`: their image parts before the first user turn's text, unless the turns already hold as
    many image parts as there are images."""
    if prompt.kind == "formatted":
        raise UserError(
            "--image with --raw (or a prompts file row with a formatted prompt): the processor's chat template "
            "places the image tokens; give plain prompts or message rows"
        )
    messages = fmt.messages(prompt.value) if prompt.kind == "text" else [dict(m) for m in prompt.value]
    parts = image_parts(messages)
    if parts and parts != len(images):
        raise UserError(
            f"prompt {prompt.show()!r} holds {parts} image part(s) but {len(images)} image file(s) were given; "
            "give one file per part"
        )
    if not parts and images:
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is None:
            raise UserError(f"prompt {prompt.show()!r}: no user turn to put the images in")
        text = messages[first]["content"]
        text_parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
        messages[first] = {"role": "user", "content": [{"type": "image"} for _ in images] + text_parts}
    return ImagePrompt(messages, list(images))


def image_inputs(processor, prompt: ImagePrompt):
    """The processor's tensors for one prompt: rendered by its chat template with the generation prompt,
    images turned into pixels and image tokens (as the trainer's collator did for the rows)."""
    return _rendered(processor, [prompt])


def _batch_inputs(processor, prompts: list[ImagePrompt]):
    """The processor's batch call on several prompts, left-padded (generation continues on the right)."""
    return _rendered(processor, prompts, {"padding": True, "padding_side": "left"})


def _rendered(processor, prompts: list[ImagePrompt], padding: dict | None = None):
    from trl.data_utils import prepare_multimodal_messages

    conversations = [
        prepare_multimodal_messages([dict(m) for m in p.messages], images=[_as_image(i) for i in p.images])
        for p in prompts
    ]
    try:
        return processor.apply_chat_template(
            conversations if padding else conversations[0],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs={"add_special_tokens": False, **(padding or {})},  # the template writes them
        )
    except (ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        shown = " | ".join(repr(p.show()) for p in prompts)
        raise UserError(f"prompt {shown}: the processor could not render it with its images ({first})") from None


def _index_batches(ids: list[list[int]], size: int, max_tokens: int | None, new: int) -> list[list[int]]:
    """generation._batches of the tokenized prompts, as the prompts' indices."""
    from .generation import _batches

    out, start = [], 0
    for group in _batches(ids, size, max_tokens, new):
        out.append(list(range(start, start + len(group))))
        start += len(group)
    return out


def _as_image(value: Any):
    """A PIL image as it is; a path (a dataset's decoded or undecoded entry) opened as RGB."""
    if isinstance(value, (str, Path)):
        return open_images([str(value)], "image")[0]
    if isinstance(value, dict) and value.get("path"):
        return open_images([value["path"]], "image")[0]
    return value.convert("RGB") if hasattr(value, "convert") else value


def generate_with_images(
    model,
    processor,
    prompts: list[ImagePrompt],
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float = 1.0,
    max_prompt_tokens: int | None = None,
    batch_size: int = 1,
    max_batch_tokens: int | None = None,
) -> list[str]:
    """One completion per prompt, without the prompt, cut at the first stop token (generation's stop
    tokens: the tokenizer's EOS, the model's eos ids, the template's end-of-turn token or its text)."""
    import torch

    from .generation import _compute_device, _cut_at, no_router_logits, stop_strings, stop_token_ids

    tokenizer = processor.tokenizer
    device = _compute_device(model)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature else {"do_sample": False}
    sampling.update(no_router_logits(model))
    stops = stop_strings(tokenizer, PromptFormat(style="chat"))  # an end-of-turn marker of several tokens
    if stops:
        sampling.update(stop_strings=stops, tokenizer=tokenizer)
    eos_ids = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    dtype = vision_dtype(model)
    # each prompt alone first: its length for the batch bound, and one line naming it if it does not render
    alone = [image_inputs(processor, prompt) for prompt in prompts]
    ids = [inputs["input_ids"][0].tolist() for inputs in alone]
    long = sum(bool(max_prompt_tokens and len(i) > max_prompt_tokens) for i in ids)
    outputs: list[str] = []
    for batch in _index_batches(ids, max(1, int(batch_size)), max_batch_tokens, max_new_tokens):
        inputs = alone[batch[0]] if len(batch) == 1 else _batch_inputs(processor, [prompts[i] for i in batch])
        n = int(inputs["input_ids"].shape[1])
        tensors = {k: _to(v, device, dtype) for k, v in inputs.items()}
        with torch.no_grad():
            out = model.generate(
                **tensors,
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=pad_id,
                eos_token_id=eos_ids or None,
                **sampling,
            )
        outputs += [_cut_at(text, stops) for text in tokenizer.batch_decode(out[:, n:], skip_special_tokens=True)]
    if long:
        log.warning(
            "%d of %d image prompts are longer than the run's trainer.seq_len=%d; generated from them whole "
            "(a cut would split an image's tokens from its pixels)",
            long,
            len(prompts),
            max_prompt_tokens,
        )
    return outputs


def vision_dtype(model):
    """The dtype the pixels go in: the vision tower's (the compute dtype the run kept it in)."""
    import torch

    from ..model.vision import vision_prefixes

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for prefix in vision_prefixes(base):
        for param in base.get_submodule(prefix).parameters():
            if param.is_floating_point():
                return param.dtype
    return torch.float32


def _to(value, device, dtype):
    """A processor tensor on the model's device; floating ones (pixels) in the vision tower's dtype."""
    if not hasattr(value, "to"):
        return value
    return value.to(device, dtype=dtype) if value.is_floating_point() else value.to(device)
