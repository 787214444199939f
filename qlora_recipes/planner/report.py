"""What a plan says to people: the console table (GiB per component and device, the verdict and
the ladder), the one-line refusal when a stack does not fit, and plan.json in a run dir.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path

from ..errors import UserError
from ..units import GiB
from .peaks import COMPONENTS, worst_device
from .placement import dev_name

_LABELS = {
    "quantized_weights": "quantized weights",
    "other_params": "other params",
    "buffers": "buffers",
    "checkpoint_pages": "checkpoint pages (CPU, mapped)",
    "lora_weights": "adapter weights (fp32)",
    "gradients": "gradients (fp32)",
    "optimizer_state": "optimizer state",
    "activations": "activations kept",
    "layer_working": "* layer working set",
    "lm_head_loss": "* loss (fused LM head)",
    "reference_forward": "* reference forward",
    "kl_forward": "* KL forward (no grad)",
    "sampling": "* sampling (generate)",
    "vision_forward": "* vision tower forward (no grad)",
    "dequant_scratch": "* dequant scratch",
    "optimizer_scratch": "* optimizer step",
    "eval_transient": "* eval batch",
    "load_transient": "* loading (checkpoint pages, upcast)",
    "offload_staging": "offload staging",
    "cuda_context": "CUDA context",
    "process_baseline": "process baseline",
    "cpu_kernels": "bf16 CPU kernels (after loading)",
    "allocator_overhead": "allocator overhead",
}

_SHORT_PHASES = {
    "train: loss": "loss",
    "train: layer backward": "backward",
    "train: reference forward": "reference",
    "train: KL forward": "KL",
    "train: sampling": "sampling",
    "optimizer step": "optim step",
    "eval": "eval",
    "load": "load",
    "offloaded weights": "weights",
    "static": "weights",
}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _g(n: float) -> str:
    return f"{n / GiB:.2f}"


def render_table(plan: dict) -> str:
    """The plan as a plain-text table (GiB) for the console."""
    return "\n".join(_header(plan) + [""] + _grid(plan) + _footer(plan))


def _header(plan: dict) -> list[str]:
    """What was planned: model, hardware, stack and batch."""
    m, st = plan["model"], plan["stack"]
    lines = [
        f"memory plan: {m['name_or_path']} ({m['architecture']}, {_count(plan['counts']['params_total'])} params, "
        f"figures from {m['figures_from']})"
    ]
    hw = st.get("hardware") or {}
    gpus = hw.get("gpus") or []
    where = (
        ", ".join(f"{n} x {g / GiB:.1f} GiB" for g, n in Counter(gpus).items())
        + " GPU"
        + ("s" if len(gpus) > 1 else "")
        if gpus
        else "no GPU"
    )
    if hw:
        lines.append(
            f"hardware: {where}, host RAM {hw['host_ram'] / GiB:.1f} GiB"
            f" ({'declared' if hw.get('declared') else 'this machine'})"
        )
    target = st["target_modules"] if isinstance(st["target_modules"], str) else ",".join(st["target_modules"])
    lines.append(
        f"stack: {st['quant']} | {st['peft']} r={st['r']} on {target} ({plan['counts']['lora_params']:,} params) | "
        f"{st['optim']} | {st['dtype']} | attention {st['attention']}"
    )
    lines.append(
        f"batch: {st['micro_batch_size']} x {st['seq_len']} tokens, accum {st['grad_accum']}"
        f"{' x ' + str(st['world_size']) + ' ranks' if st['world_size'] > 1 else ''} -> effective batch "
        f"{plan['effective_batch']}, {plan['tokens_per_step']:,} tokens/step | checkpointing "
        f"{_checkpointing_word(st['gradient_checkpointing'], plan['model']['num_layers'])}"
    )
    return lines


def _grid(plan: dict) -> list[str]:
    """A row per component and the device rows (peak, budget, max_memory, headroom, phase)."""
    devs = [d["device"] for d in plan["devices"]]
    width = max(12, *(len(d) + 2 for d in devs))
    head = f"{'GiB':<26}" + "".join(f"{d:>{width}}" for d in devs)
    lines = [head, "-" * len(head)]
    bf16_adapters = plan.get("stack", {}).get("adapter_dtype") == "bfloat16"
    for key in COMPONENTS:
        row = plan["components"].get(key)
        if not row:
            continue
        label = _LABELS[key].replace("(fp32)", "(bf16)") if bf16_adapters else _LABELS[key]
        lines.append(f"{label:<26}" + "".join(f"{_g(row.get(d, 0)) if row.get(d) else '-':>{width}}" for d in devs))
    lines.append("-" * len(head))
    by = {d["device"]: d for d in plan["devices"]}
    lines.append(f"{'peak':<26}" + "".join(f"{_g(by[d]['peak']):>{width}}" for d in devs))
    if any("peak_allocated" in by[d] for d in devs):
        lines.append(
            f"{'peak allocated':<26}"
            + "".join(f"{_g(by[d]['peak_allocated']) if 'peak_allocated' in by[d] else '-':>{width}}" for d in devs)
        )
    lines.append(f"{'budget':<26}" + "".join(f"{_g(by[d]['budget']):>{width}}" for d in devs))
    if any("max_memory" in by[d] for d in devs):
        lines.append(
            f"{'max_memory (weights)':<26}"
            + "".join(f"{_g(by[d]['max_memory']) if 'max_memory' in by[d] else '-':>{width}}" for d in devs)
        )
    lines.append(f"{'headroom %':<26}" + "".join(f"{by[d]['headroom_pct']:>{width}.1f}" for d in devs))
    lines.append(
        f"{'peak phase':<26}"
        + "".join(f"{_SHORT_PHASES.get(by[d]['peak_phase'], by[d]['peak_phase'])[: width - 1]:>{width}}" for d in devs)
    )
    return lines


def _footer(plan: dict) -> list[str]:
    """The device map's spread, the notes, the verdict and the ladder."""
    lines = ["* transient: only the largest phase (train / optimizer step / eval) counts toward the peak"]
    dm = plan["device_map"]
    if len(dm) > 1:
        spread: dict[str, int] = defaultdict(int)
        for v in dm.values():
            spread[dev_name(v)] += 1
        lines.append("device map: " + ", ".join(f"{k}: {v} modules" for k, v in spread.items()))
    for note in plan["notes"]:
        lines.append(f"note: {note}")
    worst = worst_device(plan["devices"])
    verdict = "FITS" if plan["fits"] else "DOES NOT FIT"
    lines.append(
        f"{verdict}: peak {plan['peak_gib']:.2f} GiB{_allocated(plan)}; tightest {worst['device']} "
        f"{_g(worst['peak'])} of {_g(worst['budget'])} GiB ({worst['headroom_pct']:.1f} % headroom)"
    )
    if plan["ladder"]:
        lines.append("ladder (cumulative, cheapest first):")
        for i, r in enumerate(plan["ladder"], 1):
            lines.append(
                f"  {i}. {r['change']:<14} peak {r['worst_peak_gib']:7.2f} GiB on {r['worst_device']}"
                f" {'fits' if r['fits'] else 'no fit'}  cost {r['cost']:<8} {r['overrides']}"
            )
    return lines


def _allocated(plan: dict) -> str:
    """The allocated peak for the verdict line, named by what measures it on that device."""
    allocated = plan.get("peak_allocated_gib")
    if allocated is None:
        return ""
    if any(d["device"].startswith("cuda") for d in plan["devices"]):
        return f" (allocated {allocated:.2f} GiB: what torch.cuda.max_memory_allocated measures)"
    return f" (allocated {allocated:.2f} GiB by torch; RSS adds the process baseline)"


def vllm_note(modules_to_save) -> str | None:
    """What vLLM's LoRA loader refuses (full module copies beside the LoRA factors), said where it is planned."""
    if not modules_to_save:
        return None
    return (
        f"peft.modules_to_save={list(modules_to_save)} saves full copies beside the LoRA factors, and vLLM's "
        "--enable-lora cannot load such an adapter: leave peft.modules_to_save unset to serve the adapter with vLLM, "
        "or merge the run (qlora merge RUN) and serve the merged model"
    )


class DoesNotFit(UserError):
    """The plan says the stack does not fit its devices (a sweep records the job as skipped)."""


def refuse_unless_fits(plan: dict, force: bool) -> None:
    """Raise UserError (one line, with the first fitting rung) unless the plan fits or force is set."""
    if plan["fits"] or force:
        return
    over = [d for d in plan["devices"] if d["peak"] > d["budget"]]
    worst = worst_device(over)
    ladder = plan.get("ladder") or []
    good = next((r for r in ladder if r["fits"]), None)
    if good:
        hint = f"try: {good['overrides']} (see plan.json ladder)"
    elif ladder:
        hint = f"even {ladder[-1]['overrides']} does not fit (see plan.json ladder); use a larger device"
    else:
        hint = "no override makes it fit; use a larger device"
    raise DoesNotFit(
        f"stack does not fit: peak {worst['peak'] / GiB:.1f} GiB > budget {worst['budget'] / GiB:.1f} GiB on "
        f"{worst['device']}{_eager_why(plan)}; {hint}; force=true to start anyway"
    )


def _eager_why(plan: dict) -> str:
    """What eager attention adds at this length: its seq^2 scores, kept per layer for backward."""
    scores = plan["stack"].get("eager_scores_bytes")
    if not scores:
        return ""
    st = plan["stack"]
    return (
        f" (attention eager keeps batch x heads x seq_len^2 scores: {scores / GiB:.1f} GiB per layer at "
        f"{st['micro_batch_size']} x {st['seq_len']:,} tokens)"
    )


def write_plan(plan: dict, run_dir: str | os.PathLike) -> Path:
    """Write plan.json into run_dir (created if needed); returns its path."""
    path = Path(run_dir) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2, sort_keys=False) + "\n")
    return path


def _checkpointing_word(value, num_layers: int) -> str:
    """on, off, or the first N of the decoder layers (trainer.gradient_checkpointing=N)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value} of {num_layers} layers"
