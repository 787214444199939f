"""The model card (huggingface_hub's ModelCard) of an adapter or a merged model, from what its run dir holds.

    run_card(run_dir, kind="adapter" | "merged", repo_id=None, merge=None) -> ModelCard
    write_card(card, folder)             README.md, written aside and renamed into place

A card names the base model by its hub id (model.hub_id, else a hub name_or_path, else the local dir's
config.json `_name_or_path` when that is a hub id) and never by a local path: the shipped tiny model is
named by its asset name, any other local dir by its own name. It says which data (a hub dataset id, or
the file's name), the stack (the group options and the keys that matter), planned vs measured peak
memory, the eval results, and the command that reproduces the run. Every path in it is shortened the
same way, so no absolute path of this machine leaves with the card.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from ..config.objectives import OBJECTIVES
from ..config.schema import DataConfig, ModelConfig, TrainConfig
from ..resources import ROOT
from .trackers import run_overrides, stack_overrides
from .vision_card import is_vision_run, vision_lines, vision_usage

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name"; one-part legacy ids are not guessed
METHOD_NAMES = {"lora": "LoRA", "dora": "DoRA", "rslora": "rsLoRA"}
STACK_GROUPS = ("recipe", "model", "data", "quant", "peft", "optim", "offload", "precision", "trainer", "dist")


def portable(value: object) -> str:
    """A path as the card may show it: relative to the shipped files when it is one of them, else its
    own name; anything that is not an absolute path unchanged."""
    text = str(value)
    if not (text.startswith(("/", "~")) or re.match(r"^[A-Za-z]:[\\/]", text)):
        return text
    path = Path(text).expanduser()
    try:
        return path.resolve().relative_to(ROOT.resolve()).as_posix()
    except ValueError:
        return path.name or text


def _local(path: str) -> Path | None:
    candidate = Path(path).expanduser()
    return candidate if candidate.exists() else None


def base_model(model: ModelConfig) -> tuple[str | None, str]:
    """(the base's hub id or None, how the card names it)."""
    if model.hub_id:
        return str(model.hub_id), f"[`{model.hub_id}`](https://huggingface.co/{model.hub_id})"
    name = str(model.name_or_path)
    local = _local(name)
    if local is None and HUB_ID.match(name):
        return name, f"[`{name}`](https://huggingface.co/{name})"
    if local is not None and (local / "config.json").is_file():
        try:
            recorded = str(json.loads((local / "config.json").read_text()).get("_name_or_path") or "")
        except (OSError, ValueError):
            recorded = ""
        if HUB_ID.match(recorded) and _local(recorded) is None:
            return recorded, f"[`{recorded}`](https://huggingface.co/{recorded})"
    shown = portable(name)
    if shown.startswith("assets/"):  # the embedded default's model
        return None, f"the local tiny model `{shown}` shipped with qlora-recipes (not on the hub)"
    return None, f"a local model dir `{shown}` (not on the hub; `model.hub_id=ORG/NAME` names its hub id)"


def dataset(data: DataConfig) -> tuple[str | None, str]:
    """(the training data's hub dataset id or None, how the card names it)."""
    path = str(data.path)
    if _local(path) is None and HUB_ID.match(path):
        return path, f"[`{path}`](https://huggingface.co/datasets/{path})"
    shown = portable(path)
    return (
        None,
        f"`{shown}` (local{', the sample task shipped with qlora-recipes' if shown.startswith('assets/') else ''})",
    )


def _stack(cfg: TrainConfig, choices: dict) -> list[str]:
    """The groups' options and the keys that shape the result, as markdown lines."""
    t, o, p, q = cfg.trainer, cfg.optim, cfg.peft, cfg.quant
    targets = p.target_modules if isinstance(p.target_modules, str) else ", ".join(map(str, p.target_modules))
    options = ", ".join(f"{g}={choices[g]}" for g in STACK_GROUPS if choices.get(g) not in (None, "null"))
    lines = [f"- groups: `{options}`"] if options else []
    quant = q.method if q.method == "none" else f"{q.method} (double quant {q.double_quant}, compute {q.compute_dtype})"
    lines += [
        f"- quantization: {quant}",
        f"- adapter: {p.method}, r {p.r}, alpha {p.alpha}, dropout {p.dropout}, targets {targets}",
        f"- optimizer: {o.name}, lr {o.lr}, {o.scheduler} schedule, weight decay {o.weight_decay}",
        f"- precision: {cfg.precision.name}; distributed: {cfg.dist.strategy}; offload: {cfg.offload.device_map or 'none'}",
        f"- batch: {t.micro_batch_size} x {t.grad_accum} accumulation, sequence length {t.seq_len}, "
        f"gradient checkpointing {t.gradient_checkpointing}; seed {cfg.seed}",
    ]
    return lines


def _objective(cfg: TrainConfig) -> str:
    o = cfg.objective
    if o.name == "dpo":
        reference = "precomputed log-probs" if o.precompute_ref_log_probs else "the base with the adapter off"
        if o.ref_adapter:
            reference = f"the earlier stage's adapter, frozen{', its log-probs precomputed' if o.precompute_ref_log_probs else ''}"
        sft = f" + sft x {o.sft_weight:g}" if o.sft_weight else ""
        return f"dpo (loss {o.loss_type}{sft}, beta {o.beta}, reference: {reference})"
    if o.name == "kto":
        reference = "precomputed log-probs" if o.precompute_ref_log_probs else "the base with the adapter off"
        weights = f"desirable weight {o.desirable_weight}, undesirable weight {o.undesirable_weight}"
        return f"kto (beta {o.beta}, {weights}, reference: {reference})"
    if o.name == "grpo":
        reference = "the base with the adapter off" if o.beta else "none"
        rewards = ", ".join(o.rewards or ())
        return f"grpo (rewards {rewards}, {o.num_generations} completions per prompt, beta {o.beta}, reference: {reference})"
    return o.name


def _stage(init_from: dict | None) -> list[str]:
    """A stage's card names the run its adapter started from (init_from) and that run's objective."""
    if not init_from:
        return []
    return [
        f"Stage: the adapter started from run `{portable(init_from['path'])}` (objective {init_from['objective']}).",
        "",
    ]


def _number(value, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _memory(metrics: dict) -> list[str]:
    if "planned_peak_gib" not in metrics:
        return ["Not recorded (the run has no memory figures in metrics.json)."]
    return [
        f"Device: {metrics.get('device', 'n/a')}; the quantity compared: {metrics.get('peak_quantity', 'n/a')}.",
        "",
        "| | GiB |",
        "|---|---|",
        f"| planned peak (plan.json) | {_number(metrics.get('planned_peak_gib'))} |",
        f"| measured peak | {_number(metrics.get('peak_mem_gib'))} |",
        f"| measured / planned | {_number(metrics.get('plan_ratio'), 3)} |",
    ]


def _results(metrics: dict) -> list[str]:
    rows = [
        ("eval loss", metrics.get("eval_loss")),
        ("eval perplexity", metrics.get("eval_perplexity")),
        ("eval exact match, before training", metrics.get("eval_exact_match_before")),
        ("eval exact match", metrics.get("eval_exact_match")),
        ("eval reward accuracy, before training", metrics.get("eval_reward_accuracy_before")),
        ("eval reward accuracy", metrics.get("eval_reward_accuracy")),
        ("eval reward margin", metrics.get("eval_reward_margin")),
        ("mean reward, first logged step", metrics.get("reward_first")),
        ("mean reward, last logged step", metrics.get("reward_last")),
        ("train loss, first logged", metrics.get("train_loss_first")),
        ("train loss, last logged", metrics.get("train_loss_last")),
        ("optimizer steps", metrics.get("steps")),
    ]
    rows += [(f"lm-eval {task}", score) for task, score in (metrics.get("lm_eval") or {}).items()]
    shown = [(name, value) for name, value in rows if value is not None]
    if not shown:
        return ["Not recorded (no metrics.json in the run dir)."]
    return ["| metric | value |", "|---|---|", *[f"| {name} | {_number(value)} |" for name, value in shown]]


def _eval_results(metrics: dict, data_id: str | None, data_name: str):
    from huggingface_hub import EvalResult

    found = []
    for key, kind, label in (("eval_loss", "loss", "eval loss"), ("eval_exact_match", "exact_match", "exact match")):
        if isinstance(metrics.get(key), (int, float)):
            found.append(
                EvalResult(
                    task_type="text-generation",
                    dataset_type=data_id or data_name,
                    dataset_name=data_name,
                    metric_type=kind,
                    metric_value=float(metrics[key]),
                    metric_name=label,
                )
            )
    return found


def reproduce(overrides: list[str] | None, choices: dict) -> str:
    """The `qlora train` line of this run: its command-line overrides (paths shortened to names),
    or, when they were not recorded, its group options."""
    if overrides is None:
        overrides = [f"{g}={choices[g]}" for g in STACK_GROUPS if choices.get(g) not in (None, "null")]
    shown = []
    for item in stack_overrides(overrides):
        key, eq, value = item.partition("=")
        shown.append(key + eq + portable(value) if eq else item)
    return " ".join(["qlora train", *map(shlex.quote, shown)])


def _choices(run_dir: Path) -> dict:
    """The run's group options, from the Hydra files of its run dir ({} without them)."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    choices = OmegaConf.select(OmegaConf.load(path), "hydra.runtime.choices", default=None)
    found = OmegaConf.to_container(choices) if choices else {}
    return {str(k): str(v) for k, v in found.items() if v is not None}


def run_card(run_dir: Path, kind: str = "adapter", repo_id: str | None = None, merge: dict | None = None):
    """The card of the run's adapter (kind "adapter") or of a merged model made from it ("merged"; `merge`:
    the merge report plus its "quality" line)."""
    from huggingface_hub import ModelCard, ModelCardData

    from ..outputs.rundir import load_run_config, run_metrics

    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    metrics = run_metrics(run_dir)
    choices = _choices(run_dir)
    base_id, base_text = base_model(cfg.model)
    data_id, data_text = dataset(cfg.data)
    name = repo_id or f"{run_dir.parent.name}/{run_dir.name}"
    tags = ["qlora", "qlora-recipes", cfg.peft.method, "trl", cfg.objective.name]
    if cfg.quant.method != "none":
        tags.append(f"bnb-{cfg.quant.method}")
    if base_id and kind == "adapter":
        tags.append(f"base_model:adapter:{base_id}")
    card_data = ModelCardData(
        base_model=base_id,
        datasets=[data_id] if data_id else None,
        library_name="peft" if kind == "adapter" else "transformers",
        pipeline_tag="image-text-to-text" if is_vision_run(cfg) else "text-generation",
        tags=tags,
        model_name=name,
        eval_results=_eval_results(metrics, data_id, portable(cfg.data.path)) or None,
    )
    body = _body(cfg, kind, name, base_id, base_text, data_text, metrics, choices, run_dir, merge)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}\n")


def _body(cfg: TrainConfig, kind, name, base_id, base_text, data_text, metrics, choices, run_dir, merge) -> str:
    method = METHOD_NAMES.get(cfg.peft.method, cfg.peft.method)
    what = (
        f"A {method} adapter" if kind == "adapter" else f"A standalone model: a {method} adapter merged into its base,"
    )
    rows = metrics.get("data", {}).get("rows", {})
    counts = f" ({rows.get('train')} train rows, {rows.get('eval')} eval rows)" if rows else ""
    sections = [
        f"# {name}",
        "",
        f"{what} trained with QLoRA (TRL {OBJECTIVES[cfg.objective.name].trainer}, peft, bitsandbytes) by "
        f"qlora-recipes; objective: {_objective(cfg)}.",
        "",
        *_stage(metrics.get("init_from")),
        "## Base model",
        "",
        base_text + (f", revision `{cfg.model.revision}`" if cfg.model.revision else ""),
        "",
        *vision_lines(cfg, run_dir, kind),
        "## Training data",
        "",
        f"{data_text}{counts}, format {metrics.get('data', {}).get('format', cfg.data.format)}.",
        "",
        "## Stack",
        "",
        *_stack(cfg, choices),
        "",
        "## Memory: planned vs measured peak",
        "",
        *_memory(metrics),
        "",
        "## Evaluation",
        "",
        *_results(metrics),
        "",
        *_lm_eval_section(run_dir),
        *(_merge_section(merge) if merge else []),
        "## Reproduce",
        "",
        "```bash",
        reproduce(run_overrides(run_dir), choices),
        *(_merge_command(merge) if merge else []),
        "```",
        "",
        *(vision_usage(kind, name, base_id, cfg) if is_vision_run(cfg) else _usage(kind, name, base_id)),
    ]
    return "\n".join(sections)


def _lm_eval_section(run_dir: Path) -> list[str]:
    """`qlora eval`'s table (RUN_DIR/eval.json), base vs tuned (vs merged); nothing before an eval."""
    from ..outputs.evaluation import EVAL_FILE, table_rows
    from ..outputs.runfiles import read_json

    path = Path(run_dir) / EVAL_FILE
    if not path.is_file():
        return []
    report = read_json(path, "run qlora eval again")
    header, rows = table_rows(report)
    return [
        "## lm-eval: base vs fine-tuned",
        "",
        f"lm-evaluation-harness {report.get('lm_eval', '')}, in-process on the 4-bit base with the adapter off "
        "(base), on (tuned) and merged; written by `qlora eval`.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _merge_section(merge: dict) -> list[str]:
    lines = [
        "## Merge",
        "",
        f"The adapter was merged into the {merge.get('merged_into', 'base')} and saved in {merge.get('dtype')} "
        f"({len(merge.get('files', []))} safetensors file(s), {merge.get('total_bytes', 0) / 2**20:.1f} MiB).",
    ]
    if merge.get("quality"):
        lines += ["", merge["quality"]]
    return [*lines, ""]


def _merge_command(merge: dict) -> list[str]:
    flags = " --from-original" if str(merge.get("merged_into", "")).startswith("original") else ""
    return [f"qlora merge RUN_DIR{flags} --dtype {merge.get('dtype')}   # RUN_DIR: the run dir the line above writes"]


def _usage(kind: str, name: str, base_id: str | None) -> list[str]:
    if kind == "adapter" and base_id is None:
        return []  # the base is not on the hub: nothing a reader could load by name
    loader = (
        "from peft import AutoPeftModelForCausalLM as Auto"
        if kind == "adapter"
        else "from transformers import AutoModelForCausalLM as Auto"
    )
    return [
        "## Use",
        "",
        "```python",
        loader,
        "from transformers import AutoTokenizer",
        "",
        f'model = Auto.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        "```",
        "",
    ]


def write_card(card, folder: Path) -> Path:
    """README.md in `folder`, written aside and renamed, so the folder never holds half a card."""
    target = Path(folder) / "README.md"
    staging = target.with_name("README.md.partial")
    staging.write_text(str(card), encoding="utf-8")
    os.replace(staging, target)
    return target
