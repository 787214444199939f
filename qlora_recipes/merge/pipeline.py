"""The whole merge step: check the run, stream the merged weights into `<out>`, measure the merge, report.

    merge(run_dir, out=None, from_original=False, shard_size="2GB", prompts_file=None, dtype=None,
          push_to_hub=None, private=None, revision=None) -> report

Everything that can be checked without loading a model (the run dir, its config, --shard-size,
--dtype, the prompts file, the adapter's base, the output dir) is checked first. Then: the stack the
run trained gives the reference logits (quality), its merged tensors stream into shards (tensors,
export; their progress on stderr), and the merged model's logits are compared (quality). The report lands in
`<out>/merge_report.json` with the model, and its model card in `<out>/README.md`. With `push_to_hub`,
the finished dir goes to that hub repo in one commit (the token and the hub are checked first).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from ..errors import UserError
from ..outputs.prompts import read_prompts
from ..outputs.rundir import (
    check_adapter_base,
    load_run_config,
    resolve_dir,
    run_prompt_format,
    run_prompt_style,
    run_tokenizer,
)
from ..units import PRECISION_DTYPE, dtype_name, torch_dtype
from . import export, quality
from .progress import MergeProgress
from .tensors import merged_tensors, original_merged_tensors, original_vision, vision_keys

OUT_DTYPES = tuple(PRECISION_DTYPE.values())  # bfloat16, float16, float32: what a merged model is saved in
QUANT_BITS = {"nf4": "4-bit nf4", "fp4": "4-bit fp4", "int8": "int8"}  # quant.method -> words for the report


def _out_dtype(name: str) -> str:
    """The canonical name of the dtype the merged weights are saved in."""
    if dtype_name(name) not in OUT_DTYPES:
        raise UserError(f"--dtype {name}: use one of {', '.join(OUT_DTYPES)}")
    return dtype_name(name)


def merge(
    run_dir: str | Path,
    out: str | Path | None = None,
    from_original: bool = False,
    shard_size: str | int = "2GB",
    prompts_file: str | Path | None = None,
    dtype: str | None = None,
    push_to_hub: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
) -> dict:
    """Merge the run's adapter, save the standalone model in `out` (default `<run_dir>/merged`),
    compare logits, write `merge_report.json` and the model card there, push it when asked; returns
    the report (with `pushed_to`, the commit's URL, after a push)."""
    started = time.time()
    _, run_dir = resolve_dir(run_dir, allow_merged=False)
    cfg = load_run_config(run_dir)
    max_bytes = export.shard_bytes(shard_size)
    dtype = _out_dtype(dtype or cfg.precision.dtype)
    if prompts_file:
        read_prompts(prompts_file)  # a bad prompts file fails before any work
    out = Path(out).expanduser() if out else run_dir / "merged"
    adapter_cfg = check_adapter_base(cfg, run_dir)
    if push_to_hub is not None:
        from ..integrations.hub import check_push

        check_push(push_to_hub, revision, flag="--push-to-hub")
    with export.out_lock(out):  # one merge into `out` at a time
        how = (from_original, max_bytes, prompts_file, dtype)
        report = _merge_out(out, run_dir, cfg, adapter_cfg, how, (started, push_to_hub))
    if push_to_hub is not None:
        from ..integrations.modelcard import base_model

        report["pushed_to"] = export.push(out, push_to_hub, private, revision, report, base_model(cfg.model)[0])
    return report


def _merge_out(out: Path, run_dir: Path, cfg, adapter_cfg: dict, how: tuple, card: tuple) -> dict:
    """The merge into `<out>.partial`, renamed to `out` when complete; a full disk is one line naming the
    dir and the space the merged model needs, with nothing of it left and an earlier merge in `out` intact."""
    from ..run.checkpoints import disk_full

    partial = export.prepare_out(out, run_dir)
    sizes: dict = {}  # the merged model's bytes, once the stack is loaded
    try:
        report = _merge_into(partial, run_dir, cfg, adapter_cfg, *how, sizes)
        started, push_to_hub = card
        report["out_dir"] = str(out)
        report["wall_s"] = time.time() - started
        export.write_card(partial, run_dir, report, quality.quality_line(report), push_to_hub)
        export.finish_out(partial, out, report)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if disk_full(err):
            raise UserError(_disk_full_line(out, sizes.get("need"))) from None
        raise
    return report


def _disk_full_line(out: Path, need: int | None) -> str:
    free = shutil.disk_usage(out.parent).free
    needs = f"it needs about {need / 2**30:.2f} GiB there" if need else "it needs the merged model's size there"
    kept = f"; the earlier merge in {out} is intact" if out.exists() else ""
    return (
        f"no space left on the device of {out.parent} while writing the merged model: {needs}, "
        f"{free / 2**30:.2f} GiB are free; free space or choose --out on another disk{kept}"
    )


def _processor(cfg, run_dir: Path):
    """A vision-language run's processor (one line when it is missing beside the adapter); None otherwise."""
    from ..model.vision import is_vision_language
    from ..outputs.generation import load_processor_of

    return load_processor_of(run_dir, "run", cfg.model.trust_remote_code) if is_vision_language(cfg.model) else None


def _merged_bytes(model, out_dtype) -> int:
    """About what the merged weights take in `out_dtype`: every base weight (a 4-bit one at its full
    shape) at that dtype's size; the LoRA factors merge into them."""
    import math

    import torch

    size = torch.tensor([], dtype=out_dtype).element_size()
    total = 0
    for name, param in model.get_base_model().named_parameters():
        if "lora_" not in name:
            shape = getattr(getattr(param, "quant_state", None), "shape", None)
            total += (math.prod(shape) if shape is not None else param.numel()) * size
    return total


def _write_merged(model, cfg, partial: Path, max_bytes: int, out_dtype, from_original: bool):
    """Stream the merged tensors into shards, module by module (decoder layer by decoder layer), and
    write config.json; returns (the closed writer, the shard file names)."""
    import torch

    writer = export.ShardWriter(partial, max_bytes, out_dtype)
    # the original checkpoint is read in its own layout; the loaded stack's tensors go back to it
    tensors = (
        original_merged_tensors(model, cfg) if from_original else export.checkpoint_layout(model, merged_tensors(model))
    )
    vision = vision_keys(model)  # a VLM's vision tower and projector: the base's tensors, bit for bit
    tensors = original_vision(cfg, vision, tensors)
    with MergeProgress(model) as progress:  # layers merged, shards written: on stderr
        for name, tensor in tensors:
            progress.tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise UserError(f"the merged {name} has NaN/inf values; the adapter is broken (check the run's loss)")
            writer.add(name, tensor, keep_dtype=name in vision)
            progress.shards(len(writer.files))
        files = writer.close()
        progress.shards(len(files))
    export.write_config(model, partial, out_dtype, writer.names)
    return writer, files


def _merge_into(
    partial: Path,
    run_dir: Path,
    cfg,
    adapter_cfg: dict,
    from_original: bool,
    max_bytes: int,
    prompts_file,
    dtype: str,
    sizes: dict,
) -> dict:
    out_dtype = torch_dtype(dtype)
    style = run_prompt_style(run_dir, cfg)
    prompt_format = run_prompt_format(run_dir, cfg, style)  # plain --prompts lines wrapped as generate does
    processor = _processor(cfg, run_dir)  # a VLM's, saved beside its adapter; None for a text model
    tokenizer = processor.tokenizer if processor is not None else run_tokenizer(cfg, run_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pad_id = tokenizer.pad_token_id
    batches, prompts_source = quality.compare_prompts(
        cfg, tokenizer, str(prompts_file) if prompts_file else None, prompt_format, processor
    )

    # 1. The stack the run trained, in fp32: reference logits (and the base alone, for scale).
    model, ref, base_only = quality.reference_logits(cfg, run_dir, adapter_cfg, batches, pad_id)

    # 2. The merged weights, streamed into shards, with config and tokenizer.
    sizes["need"] = _merged_bytes(model, out_dtype)
    merge_started = time.time()
    writer, files = _write_merged(model, cfg, partial, max_bytes, out_dtype, from_original)
    (processor or tokenizer).save_pretrained(str(partial))  # a VLM's processor: tokenizer, image processor, template
    merge_s = time.time() - merge_started
    base_name = model.get_base_model().config._name_or_path
    model = None  # the 4-bit stack goes before the next model loads
    quality.free_memory()

    # 3. With --from-original: the 16-bit original base + adapter (unmerged), the merge-only reference.
    # 4. The merged model as anyone would load it.
    forward_dtype = quality.compare_dtype(writer.total, out_dtype)
    logits = {"reference": ref, "base_only": base_only}
    if from_original:
        logits["original"] = quality.original_logits(cfg, run_dir, batches, pad_id, forward_dtype)
    logits["merged"] = quality.merged_logits(partial, batches, pad_id, forward_dtype, cfg.model.trust_remote_code)

    bits = QUANT_BITS.get(cfg.quant.method)
    return {
        "run_dir": str(run_dir),
        "merged_into": "original 16-bit weights" if from_original else (f"dequantized {bits} base" if bits else "base"),
        "base": base_name or cfg.model.name_or_path,
        "quant": cfg.quant.method,
        "peft": cfg.peft.method,
        "dtype": dtype,
        "files": files,
        "total_bytes": writer.total,
        "shard_size_bytes": max_bytes,
        "prompt_style": style,
        "prompt_format": dataclasses.asdict(prompt_format),  # what generate wraps plain prompts in
        "max_new_tokens": cfg.data.max_new_tokens,
        "compare": quality.comparison(logits, batches, prompts_source, forward_dtype, bits, from_original),
        "merge_s": merge_s,
    }
