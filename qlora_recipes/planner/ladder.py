"""The OOM ladder: when a plan leaves less than HEADROOM_TARGET headroom on a device, cumulative
overrides, cheapest first (eval batch, frozen parts in the compute dtype, micro-batch,
checkpointing (the fewest first layers, then all), 8-bit optimizer, activation offloading, the lean
options - bf16 adapters, lean RMSNorms, embeddings in host RAM, tiled MLPs - and only then the quality
cuts, sequence length and rank, then CPU and disk offload), each re-planned, with the Hydra overrides that make the stack fit and what each costs in
speed or quality; for an FSDP plan, offloading the shards.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..config import devices as _dev
from ..config.adapters import BF16_ADAPTER_OPTIMS
from ..errors import UserError
from ..families import traits
from ..units import GiB
from .components import attention_fix, eager
from .constants import DEVICE_MAP_STRATEGIES, HEADROOM_TARGET, OPTIMIZERS
from .peaks import device_peak, ok, pressure, worst_device
from .sharded import plan_sharded
from .single import plan_single

if TYPE_CHECKING:
    from ..config.schema import DistConfig
from .spec import StackSpec

COSTS = {
    "attention": (
        "none",
        "sdpa / flash-attention: the same attention without eager's batch x heads x seq_len^2 fp32 scores "
        "(kept per layer for backward and recomputed under checkpointing); usually faster",
    ),
    "eval_batch": ("none", "evaluation runs in smaller batches"),
    "frozen_dtype": (
        "none",
        "frozen parts in bf16: embeddings, lm_head and norms in the compute dtype, not fp32 (torchtune, "
        "unsloth); no slower, norms and the residual stream round to bf16/fp16: a small numeric change",
    ),
    "micro_batch": ("small", "same effective batch; lower GPU utilisation, ~5-20 % slower"),
    "checkpointing": (
        "moderate",
        "recomputes the checkpointed layers' forward in backward: every layer 1.57x the step time of none "
        "(H100, 8B NF4, 2,048 tokens: 0.756 vs 0.480 s/step, bench/results/nvidia-h100-80gb-hbm3-2026-11-26.md); "
        "the first N layers only, about N/layers of that",
    ),
    "optimizer": ("none", "8-bit paged AdamW: same speed, no quality loss (QLoRA paper)"),
    "activation_offload": (
        "small",
        "checkpointed layer inputs go to pinned host RAM and back over PCIe, overlapped on a side stream; with "
        "bf16 frozen parts no slower (H100, 8B at 16k tokens: 4,190 vs 3,870 tokens/s, "
        "bench/results/long-context-nvidia-h100-80gb-hbm3-2026-11-26.md)",
    ),
    "adapter_dtype": (
        "none",
        "adapters and their gradients in bf16, as the QLoRA paper and TRL train them: loss within 0.0002 on "
        "average of fp32 adapters (bench/results/lean-effect-adapter-dtype-*.md), and faster (H200, 8B NF4, "
        "2,048 tokens: 0.580 vs 0.669 s/step, bench/results/nvidia-h200-2026-11-28-gpu-check.md)",
    ),
    "lean_rmsnorm": (
        "small",
        "RMSNorms keep their 16-bit input and recompute the fp32 pass in backward: the same gradients within "
        "fp32 rounding, loss within 0.0001 on average (bench/results/lean-effect-lean-rmsnorm-*.md); an "
        "elementwise pass per norm, not timed on a GPU",
    ),
    "host_embeddings": (
        "small",
        "the frozen input embeddings in host RAM, looked up there: a batch's rows cross PCIe per step (not "
        "timed on a GPU)",
    ),
    "tiled_mlp": (
        "moderate",
        "each MLP runs over tiles and recomputes them in backward: one more MLP forward per step, about a sixth "
        "of a checkpointed step (not timed on a GPU); the same loss within 0.0002 "
        "(bench/results/lean-effect-tiled-mlp-*.md)",
    ),
    "seq_len": ("quality", "examples longer than the new length are truncated"),
    "rank": ("quality", "fewer adapter parameters"),
    "cpu_offload": ("large", "offloaded layers cross PCIe every step: several times slower"),
    "disk_offload": ("severe", "offloaded layers are read from disk every step: 10x or more slower"),
}
LADDER_ORDER = (
    "attention",
    "frozen_dtype",
    "micro_batch",
    "checkpointing",
    "optimizer",
    "activation_offload",
    "adapter_dtype",
    "lean_rmsnorm",
    "host_embeddings",
    "tiled_mlp",
    "seq_len",
    "rank",
    "cpu_offload",
    "disk_offload",
)


def _candidates(kind: str, st: StackSpec, hw: _dev.Hardware, plan: dict) -> list[tuple[StackSpec, dict[str, Any]]]:
    """Changes of one kind, mildest first, each as (new spec, override key -> value)."""
    out: list[tuple[StackSpec, dict[str, Any]]] = []
    if kind == "eval_batch":
        e = st.eval_batch // 2
        while st.evaluates and e >= 1:
            out.append((replace(st, eval_batch=e), {"trainer.eval_batch_size": e}))
            e //= 2
    elif kind == "micro_batch":
        total = st.micro_batch * st.grad_accum
        least = 2 if st.kl_batch else 1  # kto's KL batch pairs rows of one micro-batch (config/checks.py)
        for m in range(st.micro_batch - 1, least - 1, -1):
            if total % m == 0:
                out.append(
                    (
                        replace(st, micro_batch=m, grad_accum=total // m),
                        {"trainer.micro_batch_size": m, "trainer.grad_accum": total // m},
                    )
                )
    elif kind == "frozen_dtype":
        if st.upcast_frozen and st.frozen_bytes > st.act_bytes:  # k-bit prep's fp32 upcast is on and does something
            out.append((replace(st, upcast_frozen=False), {"precision.upcast_frozen": "false"}))
    elif kind == "activation_offload":
        if hw.has_gpu and st.device_map != "cpu" and st.checkpointing:
            on = {"trainer.activation_offloading": "true"}
            if not st.activation_offloading:
                out.append((replace(st, activation_offloading=True), on))
            if st.offload_stash > 1:  # then only the layer input in flight stays on the GPU
                least = replace(st, activation_offloading=True, offload_stash=1)
                out.append((least, {**on, "trainer.activation_offload_stash": 1}))
    elif kind == "checkpointing":
        out += _checkpointing_candidates(st, hw)
    elif kind in LEAN:
        out += _lean_candidates(kind, st, hw)
    elif kind == "optimizer":
        if OPTIMIZERS[st.optim] in ("adam32_torch", "adam32_torch_fused", "adam32_bnb_paged"):
            if hw.has_gpu and st.device_map != "cpu":
                out.append((replace(st, optim="paged_adamw_8bit"), {"optim": "paged8bit"}))
            else:
                out.append((replace(st, optim="adamw_bnb_8bit"), {"optim": "adamw8bit"}))
    elif kind == "attention":
        fix = attention_fix(st, hw.has_gpu)
        if fix:
            out.append((replace(st, attn=fix), {"model.attn_implementation": fix}))
    elif kind == "seq_len":
        s = st.seq_len // 2
        while s >= 128:
            out.append((replace(st, seq_len=s), {"trainer.seq_len": s}))
            s //= 2
        longest = _longest_eager_fit(st, hw) if eager(st) else None
        if longest:  # eager's seq^2 scores: the exact length that fits, not a halving
            out.insert(0, (replace(st, seq_len=longest), {"trainer.seq_len": longest}))
    elif kind == "rank":
        r = st.r // 2
        while r >= 4:
            ratio = r / st.r
            alpha = st.alpha * (math.sqrt(ratio) if st.peft == "rslora" else ratio)
            alpha_v = int(alpha) if float(alpha).is_integer() else round(alpha, 4)
            out.append((replace(st, r=r, alpha=alpha), {"peft.r": r, "peft.alpha": alpha_v}))
            r //= 2
    return out


def _checkpointing_candidates(st: StackSpec, hw: _dev.Hardware) -> list[tuple[StackSpec, dict[str, Any]]]:
    """The fewest first decoder layers to checkpoint that fit with headroom (model/checkpointing.py), then all."""
    layers = st.fig.num_layers
    if st.checkpointing and st.ckpt_layers is None:
        return []
    every = (replace(st, checkpointing=True, ckpt_layers=None), {"trainer.gradient_checkpointing": "true"})
    have = (st.ckpt_layers or 0) if st.checkpointing else 0

    def kept_fit(k: int) -> bool:  # k layers left unchanged: not checkpointed
        p = _try_plan(replace(st, checkpointing=True, ckpt_layers=layers - k), hw)
        return p is not None and ok(p, False)

    kept = _largest(1, layers - have - 1, kept_fit)
    if kept is None:
        return [every]
    n = layers - kept
    return [(replace(st, checkpointing=True, ckpt_layers=n), {"trainer.gradient_checkpointing": n}), every]


LEAN = ("adapter_dtype", "lean_rmsnorm", "host_embeddings", "tiled_mlp")


def _lean_candidates(kind: str, st: StackSpec, hw: _dev.Hardware) -> list[tuple[StackSpec, dict[str, Any]]]:
    """The lean options where config/checks.py allows them (one process; bf16 adapters with the 8-bit
    optimizers and LoRA; Llama's RMSNorm form; untied, untrained embeddings on a GPU)."""
    if st.world_size > 1:
        return []
    if kind == "adapter_dtype" and st.adapter_bytes == 4 and st.peft != "dora" and st.optim in BF16_ADAPTER_OPTIMS:
        return [(replace(st, adapter_bytes=2), {"peft.adapter_dtype": "bfloat16"})]
    if kind == "lean_rmsnorm" and not st.lean_norms and traits(st.fig.architecture).llama_rmsnorm:
        return [(replace(st, lean_norms=True), {"trainer.lean_rmsnorm": "true"})]
    trained = "embed" in " ".join(st.modules_to_save) + str(st.target_modules)
    if kind == "host_embeddings" and hw.has_gpu and st.device_map is None and not st.embeddings_on_host:
        if not st.fig.tie_embeddings and not trained:
            return [(replace(st, embeddings_on_host=True), {"offload.embeddings": "true"})]
    if kind == "tiled_mlp" and not st.mlp_tile:
        return [(replace(st, mlp_tile=max(1, st.fig.hidden_size)), {"trainer.tiled_mlp": "true"})]
    return []


def _longest_eager_fit(st: StackSpec, hw: _dev.Hardware, granularity: int = 64) -> int | None:
    """The longest multiple of `granularity` below seq_len at which the stack trains with headroom."""

    def good(k: int) -> bool:
        p = _try_plan(replace(st, seq_len=k * granularity), hw)
        return p is not None and ok(p, False)

    k = _largest(1, (st.seq_len - 1) // granularity, good)
    return k * granularity if k else None


def _offloaded(st: StackSpec, option: str, gpu: str | None, cpu: str) -> tuple[StackSpec, dict[str, Any]]:
    """The spec with layers offloaded (device_map auto) under these budgets, and its overrides."""
    mm = dict(st.max_memory) if st.device_map in DEVICE_MAP_STRATEGIES else {}
    ov: dict[str, Any] = {}
    if st.offload_option != option and not (option == "cpu" and st.offload_option == "disk"):
        ov["offload"] = option  # conf/offload/{cpu,disk}.yaml: device_map auto, gpu and cpu budgets auto
        mm = {"gpu": "auto", "cpu": "auto"}
    present = set(mm)
    changes: dict[str, str] = {}
    if gpu is not None:
        for k in [k for k in mm if k.isdigit()] + ["gpu"]:
            changes[k] = gpu  # an explicit per-GPU budget would win over "gpu"
    if cpu != "auto" or "cpu" not in mm:
        changes["cpu"] = cpu
    for k, v in changes.items():
        mm[k] = v
        # max_memory is a typed dict in struct mode: a key it lacks needs Hydra's ++ (add or override)
        ov[f"{'' if k in present else '++'}offload.max_memory.{k}"] = v
    folder = st.offload_folder or ("offload" if option == "disk" else None)
    if option == "disk" and not st.offload_folder and "offload" not in ov:
        ov["offload.folder"] = folder
    new = replace(
        st,
        device_map="auto",
        max_memory=tuple(mm.items()),
        offload_folder=folder,
        offload_option="disk" if folder else "cpu",
    )
    return new, ov


def _largest(lo: int, hi: int, good) -> int | None:
    """Largest x in [lo, hi] with good(x), assuming good is monotone (true below some x)."""
    if hi < lo or not good(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if good(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _offload_rung(st: StackSpec, hw: _dev.Hardware, option: str):
    """Largest GPU budget (whole GiB) at which the GPUs fit with headroom; for disk offload then the
    largest CPU budget at which host RAM does too. Each probe is a full re-plan."""
    cache: dict = {}

    def plan_at(gpu: int | None, cpu: int | None):
        key = (gpu, cpu)
        if key not in cache:
            new, ov = _offloaded(st, option, f"{gpu}GiB" if gpu else None, f"{cpu}GiB" if cpu else "auto")
            cache[key] = (new, ov, _try_plan(new, hw))
        return cache[key]

    def gpus_ok(p) -> bool:
        return p is not None and all(
            device_peak(d, False) <= d["budget"] * (1 - HEADROOM_TARGET)
            for d in p["devices"]
            if d["device"].startswith("cuda")
        )

    gpu = None
    if hw.has_gpu:
        if st.device_map == "cpu":
            return None
        gpu = _largest(1, int(min(hw.gpus) // GiB), lambda x: gpus_ok(plan_at(x, None)[2]))
        if gpu is None:
            return None
    if option == "cpu":
        new, ov, p = plan_at(gpu, None)
        return (new, ov, p) if p is not None and ok(p, False) else None
    cpu_top = int(hw.host_ram * _dev.AUTO_CPU_FRACTION // GiB)
    cpu = _largest(1, cpu_top, lambda y: (lambda p: p is not None and ok(p, False))(plan_at(gpu, y)[2]))
    if cpu is None:
        return None
    return plan_at(gpu, cpu)


def ladder_rungs(st: StackSpec, hw: _dev.Hardware, plan: dict) -> list[dict]:
    """Cumulative rungs, cheapest first, until every device has HEADROOM_TARGET headroom.

    Training-phase rungs are judged on the training phases (an oversized eval batch must not make
    the ladder shrink the training micro-batch); a too-large eval batch gets its own free rung."""
    rungs: list[dict] = []
    cum: dict[str, Any] = {}
    state = {"st": st, "plan": plan}

    def add(kind: str, new_st: StackSpec, ov: dict, p: dict, with_eval: bool) -> None:
        if pressure(p, with_eval) >= pressure(state["plan"], with_eval) * 0.999:
            return  # costs something, gains nothing
        cum.update(ov)
        rungs.append(_rung(kind, ov, cum, p))
        state["st"], state["plan"] = new_st, p

    def eval_rung() -> None:
        if ok(state["plan"]) or not ok(state["plan"], with_eval=False):
            return
        chosen = _first_ok(_candidates("eval_batch", state["st"], hw, state["plan"]), hw, True)
        if chosen:
            add("eval_batch", *chosen, with_eval=True)

    eval_rung()
    for kind in LADDER_ORDER:
        if ok(state["plan"], with_eval=False):
            break
        if kind in ("cpu_offload", "disk_offload"):
            chosen = _offload_rung(state["st"], hw, "cpu" if kind == "cpu_offload" else "disk")
        else:
            chosen = _first_ok(_candidates(kind, state["st"], hw, state["plan"]), hw, False)
            if chosen and kind in ("seq_len", "rank") and not ok(chosen[2], False):
                continue  # costs quality and still does not fit: leave it to the offload rungs
        if chosen:
            add(kind, *chosen, with_eval=False)
    eval_rung()
    return rungs


def offload_params_rungs(base: dict, st: StackSpec, dist: DistConfig, ws: int, ranks_here: int, host_ram: int | None):
    """The FSDP ladder: the plan with `dist.offload_params=true` (shards and optimizer step in host RAM)."""
    alt = plan_sharded(base, st, dist, ws, ranks_here, offload=True, host_ram=host_ram)
    ov = {"dist.offload_params": "true"}
    return [_rung("cpu_offload", ov, ov, alt)]


def _rung(kind: str, adds: dict[str, Any], overrides: dict[str, Any], p: dict) -> dict:
    """A rung of plan.json's ladder: what it adds, the overrides so far, and the plan they give."""
    cost, why = COSTS[kind]
    worst = worst_device(p["devices"])
    return {
        "change": kind,
        "adds": " ".join(f"{k}={v}" for k, v in adds.items()),
        "overrides": " ".join(f"{k}={v}" for k, v in overrides.items()),
        "peak_gib": p["peak_gib"],
        "worst_device": worst["device"],
        "worst_peak_gib": round(worst["peak"] / GiB, 3),
        "headroom_pct": worst["headroom_pct"],
        "fits": p["fits"],
        "cost": cost,
        "cost_note": why,
    }


def _first_ok(cands: list, hw: _dev.Hardware, with_eval: bool):
    """The mildest candidate that is ok, else the one with the least pressure."""
    tried = []
    for new_st, ov in cands:
        p = _try_plan(new_st, hw)
        if p is None:
            continue
        tried.append((new_st, ov, p))
        if ok(p, with_eval):
            return tried[-1]
    return min(tried, key=lambda t: pressure(t[2], with_eval)) if tried else None


def _try_plan(st: StackSpec, hw: _dev.Hardware) -> dict | None:
    try:
        return plan_single(st, hw)
    except UserError:
        return None
