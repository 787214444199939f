"""Generate from a finished run (its 4-bit base + adapter, as trained) or from a merged model.

    load_for_generation(path) -> (model, tokenizer, info)   # info: kind, style, format, max_new_tokens, ...
    generate(model, tokenizer, prompts, style, max_new_tokens, temperature=None) -> [str]

The one generation loop of the package: scripts/generate.py and the training metric (exact match of
greedy generations) both call `generate`. Prompts are formatted by `prompts.render`, the way the run's
data was (its chat template, the Alpaca template, or the prefix/suffix its prompts shared), as the run
recorded it in metrics.json (a run dir from before that record: as its config.yaml's data gives it); a
merged dir carries it in its merge_report.json; without either, prompts go in as they are (`--chat`
forces the template). A vision-language model's dir comes with its processor (info["processor"], one
line when it is missing); prompts with images go through `outputs.images`, which shares the stop tokens.

Bounds: each prompt is cut to its last `max_prompt_tokens` tokens (the run's trainer.seq_len; the BOS
kept), and at most `max_new_tokens` are generated. Generation stops on any of the stop tokens
(`stop_token_ids`): the tokenizer's EOS, every id of the model's generation_config.eos_token_id (chat
models end turns with <|eot_id|>, <|im_end|>; Gemma lists [1, 107]), and the chat template's end-of-turn
token; an end-of-turn marker that is not a single token stops on its text.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import UserError
from .prompts import Prompt, PromptFormat, load_prompt_format, render
from .rundir import (
    MERGE_REPORT,
    check_adapter_base,
    load_run_config,
    load_stack,
    resolve_dir,
    run_prompt_format,
    run_prompt_style,
    run_tokenizer,
)
from .runfiles import check_manifest, read_json

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 64


def _merge_report(folder: Path) -> dict:
    """A merged dir's merge_report.json ({} when it has none); a UserError naming it when it is damaged."""
    path = folder / MERGE_REPORT
    return read_json(path, "merge the run again") if path.is_file() else {}


def check_merged(folder: Path) -> None:
    """A merged dir's files as merge wrote them (its manifest), the report readable, the weights whole."""
    from ..model.check import check_weight_files

    check_manifest(folder, "merge the run again")
    _merge_report(folder)
    check_weight_files(folder, str(folder))


def _load_merged(folder: Path, trust_remote_code: bool) -> tuple[Any, Any, str, int]:
    """A merged dir with plain transformers: (model, tokenizer, prompt style, max_new_tokens), the
    last two from its merge_report.json when there is one. The dir's own code (config.json's auto_map)
    runs only with `trust_remote_code`: never a prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    check_merged(folder)
    if not trust_remote_code:
        _refuse_own_code(folder)
    report = _merge_report(folder)
    vision = merged_is_vision(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        kwargs: dict[str, Any] = {"dtype": "auto", "trust_remote_code": trust_remote_code}
        if torch.cuda.is_available():
            kwargs["device_map"] = "auto"
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError) as err:
        if "custom code" in str(err) and not trust_remote_code:
            raise _own_code_error(folder) from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{folder}: the merged model could not be loaded ({first}); merge the run again") from None
    model.eval()
    return model, tokenizer, report.get("prompt_style", "plain"), report.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS


def _own_code_error(folder: Path) -> UserError:
    return UserError(
        f"{folder}: the model ships its own code (auto_map in its config.json) and transformers has no class of "
        "its own for it; pass --trust-remote-code if you trust that code"
    )


def _refuse_own_code(folder: Path) -> None:
    """A dir whose model type only its own code knows, refused before transformers would ask to run it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = read_json(folder / "config.json", "merge the run again")
    if "auto_map" in config and config.get("model_type") not in CONFIG_MAPPING_NAMES:
        raise _own_code_error(folder)


def merged_is_vision(folder: Path) -> bool:
    """A merged dir of a vision-language model (its config.json's shape)."""
    from ..model.vision import config_is_vision_language

    return config_is_vision_language(read_json(folder / "config.json", "merge the run again"))


def is_vision_dir(path: str | Path) -> bool:
    """Whether a run dir or merged dir holds a vision-language model, read from its config alone."""
    from ..model.vision import is_vision_language

    kind, folder = resolve_dir(path, allow_merged=True)
    return is_vision_language(load_run_config(folder).model) if kind == "run" else merged_is_vision(folder)


def load_processor_of(folder: Path, kind: str, trust_remote_code: bool = False):
    """The processor saved beside a VLM run's adapter (or in a merged dir): one line when it is missing."""
    from transformers import ProcessorMixin

    from ..model import processor as processors

    where = folder / "adapter" if kind == "run" else folder
    fix = "re-run training (train.py saves it beside the adapter)" if kind == "run" else "merge the run again"
    try:  # image-only without torchvision, as training loaded it
        processor = processors.from_pretrained(
            {"pretrained_model_name_or_path": str(where), "trust_remote_code": trust_remote_code}
        )
    except ImportError as err:
        first, package = processors.import_failure(err)
        raise UserError(
            f"{where}: the vision-language model's processor could not be loaded ({first}); install {package}"
        ) from None
    except (OSError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"{where}: the vision-language model's processor could not be loaded ({first}); {fix}"
        ) from None
    if not isinstance(processor, ProcessorMixin):
        raise UserError(
            f"{where}: a vision-language model without its processor (no processor_config.json there, only a "
            f"{type(processor).__name__}); {fix}"
        )
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def load_for_generation(
    path: str | Path, chat: bool | None = None, trust_remote_code: bool = False
) -> tuple[Any, Any, dict]:
    """A run dir: its base loaded as the run loaded it (quantized) + the adapter (its own code runs as the
    run's model.trust_remote_code says). A merged dir: the standalone model with plain transformers (its own
    code runs only with `trust_remote_code`). info: kind, dir, style, format (the PromptFormat plain
    prompts are wrapped in), max_new_tokens, max_prompt_tokens (the run's seq_len; None when unknown),
    processor (a vision-language model's, checked before the model loads; None for a text model)."""
    from ..model.vision import is_vision_language

    kind, folder = resolve_dir(path, allow_merged=True)  # bad input answers before the heavy imports
    cfg = load_run_config(folder) if kind == "run" else None
    vision = is_vision_language(cfg.model) if cfg is not None else merged_is_vision(folder)
    remote = bool(cfg.model.trust_remote_code) if cfg is not None else trust_remote_code
    processor = load_processor_of(folder, kind, remote) if vision else None
    if cfg is not None:
        check_adapter_base(cfg, folder)
        tokenizer = processor.tokenizer if processor is not None else run_tokenizer(cfg, folder)
        model = load_stack(cfg, folder)
        style = run_prompt_style(folder, cfg)
        max_new = cfg.data.max_new_tokens
        run_dir: Path | None = folder
        max_prompt = int(cfg.trainer.seq_len)
    else:
        model, tokenizer, style, max_new = _load_merged(folder, trust_remote_code)
        report_run = _merge_report(folder).get("run_dir")
        run_dir = Path(report_run) if report_run else None
        max_prompt = _run_seq_len(run_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat is not None:
        style = "chat" if chat else ("plain" if style == "chat" else style)
    info = {
        "kind": kind,
        "dir": str(folder),
        "style": style,
        "format": _prompt_format(folder, cfg, run_dir, style),
        "max_new_tokens": max_new,
        "max_prompt_tokens": max_prompt,
        "processor": processor,
    }
    return model, tokenizer, info


def _prompt_format(folder: Path, cfg, run_dir: Path | None, style: str) -> PromptFormat:
    """A run dir's prompt format (runs.run_prompt_format); a merged dir's from its merge_report.json, else
    from the run it came from while that run dir is still there, else the style alone."""
    if cfg is not None:
        return run_prompt_format(folder, cfg, style)
    recorded = _merge_report(folder).get("prompt_format")
    if isinstance(recorded, dict):
        return load_prompt_format(None, style, recorded)
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        try:
            return run_prompt_format(run_dir, load_run_config(run_dir), style)
        except UserError:
            pass
    return load_prompt_format(None, style)


def _run_seq_len(run_dir: Path | None) -> int | None:
    """trainer.seq_len of the run a merged dir came from, when that run dir is still there."""
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None
    try:
        return int(load_run_config(run_dir).trainer.seq_len)
    except (UserError, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------------------------------
# Stop tokens
# --------------------------------------------------------------------------------------------------


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value if v is not None]
    try:
        return [int(value)]
    except (TypeError, ValueError):
        return []


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token that ends a generation: the tokenizer's EOS, the model's generation_config (and config)
    eos_token_id, int or list, and the chat template's end-of-turn token when it is one token."""
    from ..data.chat import end_of_turn

    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids += _ids(getattr(holder, "eos_token_id", None))
    marker = end_of_turn(tokenizer)
    if marker and marker in tokenizer.get_vocab():
        ids.append(int(tokenizer.convert_tokens_to_ids(marker)))
    return list(dict.fromkeys(ids))


def stop_strings(tokenizer: Any, fmt: PromptFormat) -> list[str]:
    """Chat prompts: the template's end-of-turn marker when it is no single token (the model learned its
    pieces), to stop on as text."""
    from ..data.chat import end_of_turn

    if fmt.style != "chat":
        return []
    marker = end_of_turn(tokenizer)
    return [marker] if marker and marker not in tokenizer.get_vocab() else []


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def generate(
    model,
    tokenizer,
    prompts: list[Prompt],
    style: str | PromptFormat,
    max_new_tokens: int,
    temperature: float | None = None,
    top_p: float = 1.0,
    batch_size: int = 1,
    max_batch_tokens: int | None = None,
    max_prompt_tokens: int | None = None,
) -> list[str]:
    """One completion per prompt (greedy unless `temperature` is given), without the prompt, cut at the
    first stop marker.

    Each prompt is tokenized once and cut to its last `max_prompt_tokens` tokens (keeping a leading BOS);
    at most `max_new_tokens` follow. Prompts go `batch_size` at a time, left-padded (generation continues
    on the right). With `max_batch_tokens`, a batch also holds at most that many positions (prompts padded
    to the longest, plus max_new_tokens each), so its KV cache and prefill are bounded whatever the
    prompt lengths (the memory planner counts that bound); a longer prompt goes alone."""
    import torch

    device = _compute_device(model)
    fmt = PromptFormat.of(style)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature else {"do_sample": False}
    sampling.update(no_router_logits(model))
    stops = stop_strings(tokenizer, fmt)
    if stops:
        sampling.update(stop_strings=stops, tokenizer=tokenizer)
    eos_ids = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    encoded = [_encode(tokenizer, *render(tokenizer, prompt, fmt)) for prompt in prompts]
    encoded, cut = _truncate(encoded, max_prompt_tokens, tokenizer.bos_token_id)
    if cut:
        log.warning(
            "%d of %d prompts are longer than %d tokens; generating from their last %d tokens",
            cut,
            len(encoded),
            max_prompt_tokens,
            max_prompt_tokens,
        )
    outputs: list[str] = []
    for batch_ids in _batches(encoded, batch_size, max_batch_tokens, max_new_tokens):
        longest = max(len(ids) for ids in batch_ids)
        input_ids = torch.full((len(batch_ids), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(batch_ids):  # left padding
            if ids:
                input_ids[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[i, longest - len(ids) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                use_cache=True,
                pad_token_id=pad_id,
                eos_token_id=eos_ids or None,
                **sampling,
            )
        texts = tokenizer.batch_decode(out[:, longest:], skip_special_tokens=True)
        outputs += [_cut_at(text, stops) for text in texts]
    return outputs


def no_router_logits(model) -> dict[str, Any]:
    """generate's argument that turns an MoE model's router logits off where its config turns them on (TRL
    does, for the load-balancing loss): every forward would keep each layer's logits of all its tokens and
    score them against the whole attention mask, which fails on a batch's decode steps (transformers 5.23).
    Nothing for a model whose config leaves them off, or has none."""
    return (
        {"output_router_logits": False}
        if getattr(getattr(model, "config", None), "output_router_logits", False)
        else {}
    )


def _compute_device(model):
    """Where the decoder computes, and so where the ids go: the LM head's device (offload.embeddings
    keeps the input table in host RAM, so the first parameter may be on the host), else the first
    placed parameter's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    return next(p.device for p in model.parameters() if p.device.type != "meta")


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _truncate(encoded: list[list[int]], limit: int | None, bos_id: int | None) -> tuple[list[list[int]], int]:
    """Each prompt's last `limit` tokens (a leading BOS stays first); how many were cut."""
    if not limit or limit < 1:
        return encoded, 0
    out, cut = [], 0
    for ids in encoded:
        if len(ids) <= limit:
            out.append(ids)
            continue
        cut += 1
        if bos_id is not None and ids and ids[0] == bos_id and limit > 1:
            out.append([bos_id] + ids[len(ids) - (limit - 1) :])
        else:
            out.append(ids[len(ids) - limit :])
    return out, cut


def _cut_at(text: str, stops: list[str]) -> str:
    for stop in stops:
        if stop in text:
            text = text.split(stop, 1)[0]
    return text


def _batches(encoded: list[list[int]], size: int, max_tokens: int | None, new: int) -> list[list[list[int]]]:
    """Consecutive tokenized prompts, `size` at a time and, with `max_tokens`, no more than keep
    len(batch) * (longest prompt + new) <= max_tokens."""
    if not max_tokens:
        return [encoded[i : i + size] for i in range(0, len(encoded), size)]
    out: list[list[list[int]]] = []
    longest = 0
    for ids in encoded:
        n = len(ids)
        grown = max(longest, n)
        if out and len(out[-1]) < size and (len(out[-1]) + 1) * (grown + new) <= max_tokens:
            out[-1].append(ids)
            longest = grown
        else:
            out.append([ids])
            longest = n
    return out
