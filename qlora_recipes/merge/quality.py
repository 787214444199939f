"""Merge quality: the merged model's logits against the base + adapter forward on a few prompts.

The merged model is loaded with plain transformers (no peft, no bitsandbytes), in fp32 where memory
allows. The reference is the 4-bit stack the run trained, with its non-quantized parts and its
dequantization in fp32, so the figure measures the merge, not quantization; with `from_original` the
same figure includes the quantization error, and a second figure against the 16-bit original base +
adapter (unmerged) measures the merge alone. Prompts come from the run's eval data (or a prompts
file), formatted as the run was trained; `quality_line` says it all in one line.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError
from ..outputs.prompts import Prompt, PromptFormat, data_prompt, read_prompts, render
from ..outputs.rundir import ADAPTER_WEIGHTS, load_stack
from .dequantize import bnb_kind

if TYPE_CHECKING:  # torch, transformers and peft load lazily: the checks of bad input answer fast
    import torch

log = logging.getLogger(__name__)

MAX_COMPARE_TOKENS = 64  # per prompt: the logits of every position are kept for the comparison
DEFAULT_COMPARE_PROMPTS = 8
GENERIC_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def to_fp32_reference(model) -> None:
    """Run the quantized stack in fp32: non-quantized parameters upcast (exactly), 4-bit layers and 4-bit
    MoE experts dequantized to and computing in fp32, so only the merge (not bf16 rounding) separates it from
    the merged model loaded in fp32."""
    import torch

    from ..model.moe_experts import is_4bit

    for module in model.modules():
        if bnb_kind(module) == "4bit":
            module.compute_dtype = torch.float32
            module.compute_type_is_set = True
            module.weight.quant_state.dtype = torch.float32
        if bnb_kind(module) == "8bit" and module.weight.device.type == "cpu":
            # bitsandbytes' CPU int8 path used in training multiplies by the dequantized weight; its
            # inference path also quantizes the activations. The layer itself has no dropout.
            module.train()
        for param in module._parameters.values():
            if is_4bit(param):  # a 4-bit MoE expert weight: dequantized to fp32 in the experts' forward
                param.quant_state.dtype = torch.float32
            elif (
                param is not None
                and param.is_floating_point()
                and param.dtype != torch.float32
                and not bnb_kind(module)
            ):
                param.data = param.data.float()
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[name] = buf.float()


def _reload_saved_modules(model, run_dir: Path) -> None:
    """modules_to_save copies were trained (and saved) in fp32 but load into the base's dtype; once
    upcast, load their saved values again so they are exactly the trained ones."""
    from peft import set_peft_model_state_dict
    from peft.utils.other import ModulesToSaveWrapper
    from safetensors.torch import load_file

    if any(isinstance(m, ModulesToSaveWrapper) for m in model.modules()):
        set_peft_model_state_dict(model, load_file(str(run_dir / "adapter" / ADAPTER_WEIGHTS)))


def prompt_logits(model, batches: list[dict], pad_id: int = 0) -> list[torch.Tensor]:
    """fp32 CPU logits of each prompt, all prompts in one right-padded forward (causal attention: the
    padding after a prompt cannot change its positions); the padded positions are dropped. Prompts with
    images go one forward each, with their pixels (in the vision tower's dtype)."""
    import torch

    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    if any("pixel_values" in b for b in batches):
        return [_image_logits(model, b, device) for b in batches]
    lengths = [b["input_ids"].shape[1] for b in batches]
    ids = torch.full((len(batches), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, b in enumerate(batches):
        ids[i, : lengths[i]] = b["input_ids"][0]
        mask[i, : lengths[i]] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    return [logits[i, :n].float().cpu() for i, n in enumerate(lengths)]


def _image_logits(model, batch: dict, device) -> torch.Tensor:
    import torch

    from ..outputs.images import vision_dtype

    dtype = vision_dtype(model)
    inputs = {k: v.to(device, dtype=dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits[0].float().cpu()


def logit_diff(merged: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    import torch

    diffs = [(m - r).abs() for m, r in zip(merged, ref, strict=True)]
    allref = torch.cat([r.flatten() for r in ref])
    agree = sum(int((m.argmax(-1) == r.argmax(-1)).sum()) for m, r in zip(merged, ref, strict=True))
    tokens = sum(r.shape[0] for r in ref)
    return {
        "max_abs_diff": max(float(d.max()) for d in diffs),
        "mean_abs_diff": float(sum(float(d.sum()) for d in diffs) / sum(d.numel() for d in diffs)),
        "ref_logit_absmax": float(allref.abs().max()),
        "ref_logit_std": float(allref.std()),
        "argmax_agreement": agree / tokens,
    }


def _run_prompts(cfg) -> tuple[list[Prompt], str]:
    """A few prompts of the run's eval data (its train data without one), or generic ones when the
    data cannot be read."""
    from .. import data

    try:
        train_ds, eval_ds, stats = data.load_splits(cfg.data, None, cfg.trainer.seq_len, cfg.seed)
        ds = eval_ds if eval_ds is not None else train_ds
        if stats["format"] == "text":
            prompts = [Prompt("formatted", t) for t in ds.select(range(min(DEFAULT_COMPARE_PROMPTS, len(ds))))["text"]]
        else:
            pairs = data.generation_pairs(ds, stats["format"], DEFAULT_COMPARE_PROMPTS)
            prompts = [data_prompt(p) for p, _ in pairs]
        split = "eval" if eval_ds is not None else "train"
        source = f"{split} data of the run ({stats['eval_source'] if eval_ds is not None else stats['source']})"
    except UserError as err:
        log.warning("the run's data cannot be read (%s); comparing on generic prompts", err)
        prompts = [Prompt("text", t) for t in GENERIC_PROMPTS]
        source = "generic prompts (the run's data is unavailable)"
    return prompts, source


def _image_batches(cfg, processor) -> tuple[list[dict], str]:
    """A vision-language run's comparison prompts: a few of its held-out image rows (its train rows
    without an eval split), rendered with their images by the processor as `qlora generate --image` does;
    never cut (a cut would split an image's tokens from its pixels)."""
    from ..data.images import held_out_rows
    from ..outputs.images import image_inputs
    from ..run.metrics import image_pairs

    rows, source = held_out_rows(cfg.data, cfg.seed)
    pairs = image_pairs(rows, DEFAULT_COMPARE_PROMPTS)
    if not pairs:
        raise UserError(f"{source}: no row with a turn before its answer to compare the merge on; pass --prompts FILE")
    return [dict(image_inputs(processor, prompt)) for prompt, _ in pairs], source


def _image_batch(processor, prompt: Prompt, style) -> dict:
    from ..outputs.images import image_inputs, image_prompt, open_images

    asked = image_prompt(prompt, PromptFormat.of(style), open_images(prompt.images, "prompt image"))
    return dict(image_inputs(processor, asked))


def compare_prompts(
    cfg, tokenizer, prompts_file: str | None, style: str | PromptFormat, processor=None
) -> tuple[list[dict], str]:
    """Tokenized prompts for the comparison (at most MAX_COMPARE_TOKENS each) and where they came from.
    Plain lines of a prompts file are wrapped in the run's prompt format (`style`: runs.run_prompt_format),
    as `qlora generate` wraps them. A vision-language run (`processor`) compares on its image rows."""
    if processor is not None and not prompts_file:
        return _image_batches(cfg, processor)
    if processor is not None and prompts_file:
        prompts = read_prompts(prompts_file)
        if any(p.images for p in prompts):  # image rows: asked with their own images
            return [_image_batch(processor, p, style) for p in prompts], str(prompts_file)
    if prompts_file:
        prompts, source = read_prompts(prompts_file), str(prompts_file)
    else:
        prompts, source = _run_prompts(cfg)
    batches = []
    for prompt in prompts:
        text, special = render(tokenizer, prompt, style)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=special)["input_ids"][:, :MAX_COMPARE_TOKENS]
        if ids.shape[1]:
            batches.append({"input_ids": ids})
    if not batches:
        raise UserError(f"{source}: every prompt is empty after tokenization; give prompts with text")
    return batches, source


def reference_logits(cfg, run_dir: Path, adapter_cfg: dict, batches: list[dict], pad_id: int):
    """(the stack the run trained, in fp32; its logits; the base's alone, for scale)."""
    model = load_stack(cfg, run_dir, adapter_cfg)
    to_fp32_reference(model)
    _reload_saved_modules(model, run_dir)
    ref = prompt_logits(model, batches, pad_id)
    with model.disable_adapter():
        base_only = prompt_logits(model, batches, pad_id)
    return model, ref, base_only


def compare_dtype(total_bytes: int, saved_dtype: torch.dtype) -> torch.dtype:
    """fp32 for the merged model's forward when an fp32 copy fits comfortably, else its saved dtype."""
    import psutil
    import torch

    fp32 = total_bytes * 4 // torch.tensor([], dtype=saved_dtype).element_size()
    budget = 0.6 * psutil.virtual_memory().available
    if torch.cuda.is_available():
        budget += sum(0.8 * torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
    return torch.float32 if fp32 < budget else saved_dtype


def _device_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    import torch

    kwargs: dict[str, Any] = {"dtype": dtype}
    if torch.cuda.is_available():
        kwargs["device_map"] = "auto"
    return kwargs


def original_logits(cfg, run_dir: Path, batches: list[dict], pad_id: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits of the 16-bit original base + adapter, unmerged: the reference for the merge alone."""
    from ..model import expert_lora, loading
    from ..model.vision import is_vision_language

    auto = _auto_class(is_vision_language(cfg.model))
    original = auto.from_pretrained(**loading.source(cfg.model), **_device_kwargs(dtype))
    original = expert_lora.load_adapter(original, str(run_dir / "adapter")).eval()
    logits = prompt_logits(original, batches, pad_id)
    original = None
    free_memory()
    return logits


def merged_logits(
    folder: Path, batches: list[dict], pad_id: int, dtype: torch.dtype, trust_remote_code: bool = False
) -> list[torch.Tensor]:
    """Logits of the merged model as anyone would load it: plain transformers, no quantization config
    (a vision-language model through AutoModelForImageTextToText); its own code (a base that ships one)
    runs only when the run trusted it."""
    from ..outputs.generation import merged_is_vision

    kwargs = _device_kwargs(dtype)
    auto = _auto_class(merged_is_vision(folder))
    model = auto.from_pretrained(str(folder), trust_remote_code=trust_remote_code, **kwargs)
    model.eval()
    return prompt_logits(model, batches, pad_id)


def _auto_class(vision: bool):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def comparison(
    logits: dict, batches: list[dict], source: str, dtype: torch.dtype, bits: str | None, from_original: bool
):
    """The report's `compare` section. logits: merged, reference, base_only and (with --from-original) original."""
    got, ref = logits["merged"], logits["reference"]
    compare = {
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": len(batches),
        "tokens": sum(b["input_ids"].shape[1] for b in batches),
        "prompts_source": source,
        "vs_base_plus_adapter": {
            **logit_diff(got, ref),
            "reference": f"{bits} base + adapter" if bits else "base + adapter",
            "includes_quantization_error": bool(from_original and bits),
        },
        # how far the adapter moves the base's logits: the scale a merge error is small against
        "adapter_effect": {
            k: v for k, v in logit_diff(ref, logits["base_only"]).items() if k in ("max_abs_diff", "mean_abs_diff")
        },
    }
    if logits.get("original") is not None:
        compare["vs_original_plus_adapter"] = {
            **logit_diff(got, logits["original"]),
            "reference": "16-bit original base + adapter",
        }
    return compare


def _fmt(x: float) -> str:
    return f"{x:.2e}"


def quality_line(report: dict) -> str:
    """One line for the terminal: the merge's logit difference, and what it includes."""
    c = report["compare"]
    main = c["vs_base_plus_adapter"]
    line = (
        f"merge quality: max |dlogit| {_fmt(main['max_abs_diff'])}, mean {_fmt(main['mean_abs_diff'])} "
        f"(logit absmax {main['ref_logit_absmax']:.3g}, argmax agrees {100 * main['argmax_agreement']:.1f}%) "
        f"vs {main['reference']} on {c['prompts']} prompts / {c['tokens']} tokens, {c['dtype']}"
    )
    if "vs_original_plus_adapter" in c:
        orig = c["vs_original_plus_adapter"]
        line += (
            f"; this includes the {report['quant']} quantization error: vs the 16-bit original + adapter "
            f"max {_fmt(orig['max_abs_diff'])}, mean {_fmt(orig['mean_abs_diff'])}"
        )
    return line
