"""The parts of a model card that a vision-language run adds: what was quantized and trained, the
processor, and an example with an image (the `qlora generate --image` line and the transformers code).

    vision_lines(cfg, run_dir, kind) -> [markdown lines]     # [] for a text model
    vision_usage(kind, name, base_id) -> [markdown lines]
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config.schema import TrainConfig
from ..errors import UserError

DEFAULT_EXAMPLE = ("Describe this image.", "photo.jpg")


def is_vision_run(cfg: TrainConfig) -> bool:
    from ..model.vision import is_vision_language

    return is_vision_language(cfg.model)


def _parts(cfg: TrainConfig) -> tuple[str, str]:
    """(the language model's module name, the vision parts' names) of the base, from the model
    transformers builds on the meta device; general words when it cannot be built here."""
    from ..config.model_dir import config_json_path
    from ..model.vision import language_model, meta_model, vision_prefixes

    path = config_json_path(cfg.model)
    try:
        meta = meta_model(str(Path(path).parent), bool(cfg.model.trust_remote_code)) if path else None
        if meta is not None:
            return language_model(meta)[0], ", ".join(f"`{p}`" for p in vision_prefixes(meta))
    except (UserError, OSError, ValueError, KeyError):
        pass
    return "the language model", "the vision tower and projector"


def _processor_class(run_dir: Path) -> str | None:
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = run_dir / "adapter" / name
        try:
            found = json.loads(path.read_text()).get("processor_class") if path.is_file() else None
        except (OSError, ValueError):
            found = None
        if found:
            return str(found)
    return None


def example(cfg: TrainConfig) -> tuple[str, str]:
    """(a question, an image file's name) from the first row of a local JSON lines data file: the
    example the card shows; a generic one when the data is elsewhere or its first row has no image."""
    path = Path(str(cfg.data.path)).expanduser()
    try:
        with path.open(encoding="utf-8") as f:
            row = json.loads(f.readline())
        user = next(m for m in row["messages"] if m["role"] == "user")
        content = user["content"]
        text = content if isinstance(content, str) else "".join(p.get("text") or "" for p in content)
        if text.strip() and row.get("images"):
            return text.strip(), Path(str(row["images"][0])).name
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration):
        pass
    return DEFAULT_EXAMPLE


def _tower(cfg: TrainConfig, vision: str, kind: str) -> str:
    """What the run did with the vision parts (model.vision_tower), and what the merge wrote of them."""
    choice = getattr(cfg.model, "vision_tower", "frozen")
    merged = kind == "merged"
    if choice == "lora":
        return (
            f"LoRA adapted the vision tower's linears too ({vision} unquantized in {cfg.precision.dtype}, their "
            "base weights frozen)." + (" The merge added each adapter into its weights." if merged else "")
        )
    if choice == "quantized":
        return f"the vision tower's linears were loaded {cfg.quant.method} too, frozen, with no LoRA ({vision})." + (
            " The merge wrote them dequantized, as the run computed with them." if merged else ""
        )
    return f"{vision} stayed unquantized in {cfg.precision.dtype}, frozen, with no LoRA." + (
        f" The merge added the adapter into the language model; {vision} are the base's tensors, unchanged."
        if merged
        else ""
    )


def vision_lines(cfg: TrainConfig, run_dir: Path, kind: str) -> list[str]:
    """The card's vision-language section: what is quantized, what LoRA adapts, the processor, an example."""
    if not is_vision_run(cfg):
        return []
    lm, vision = _parts(cfg)
    quant = "unquantized" if cfg.quant.method == "none" else f"in {cfg.quant.method} (bitsandbytes)"
    processor = _processor_class(run_dir) or "the base's processor"
    where = "beside the adapter" if kind == "adapter" else "beside the merged weights"
    question, image = example(cfg)
    return [
        "## Vision-language model",
        "",
        f"The base is a vision-language model. Its language model (`{lm}`) was loaded {quant} and trained with "
        f"LoRA on its linear layers; {_tower(cfg, vision, kind)}",
        "",
        f"The processor (`{processor}`: tokenizer, image processor, chat template) is saved {where}; prompts "
        "are rendered with its chat template, images as image parts.",
        "",
        "```bash",
        f"qlora generate RUN_DIR{'/merged' if kind == 'merged' else ''} {json.dumps(question)} --image {image}",
        "```",
        "",
    ]


def vision_usage(kind: str, name: str, base_id: str | None, cfg: TrainConfig) -> list[str]:
    """The card's `Use` section for a vision-language model: the model, its processor, a prompt with an image."""
    if kind == "adapter" and base_id is None:
        return []  # the base is not on the hub: nothing a reader could load by name
    question, image = example(cfg)
    load = (
        [
            "from peft import PeftModel",
            "from transformers import AutoModelForImageTextToText, AutoProcessor",
            "",
            f'model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("{base_id}"), "{name}")',
        ]
        if kind == "adapter"
        else [
            "from transformers import AutoModelForImageTextToText, AutoProcessor",
            "",
            f'model = AutoModelForImageTextToText.from_pretrained("{name}")',
        ]
    )
    content = f'[{{"type": "image", "path": "{image}"}}, {{"type": "text", "text": {json.dumps(question)}}}]'
    return [
        "## Use",
        "",
        "```python",
        *load,
        f'processor = AutoProcessor.from_pretrained("{name}")',
        f'messages = [{{"role": "user", "content": {content}}}]',
        "inputs = processor.apply_chat_template(",
        '    messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"',
        ")",
        "out = model.generate(**inputs, max_new_tokens=64)",
        'print(processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))',
        "```",
        "",
    ]
