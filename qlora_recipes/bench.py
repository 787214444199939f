"""Benchmark harness library: measure stacks in fresh processes, compare with the plain way and the plan.

`scripts/bench.py` runs the suites in `bench/suites/`; this module holds the parts it is built from,
importable and unit-tested on their own:

- statistics: `median`, `fit_line`, `extrapolate_layers` (the per-layer slope of the 70B-shape runs),
  `pct_error`, `ratio`;
- where we are: `describe_device` (without touching CUDA in this process), `environment`, `load_average`;
- real-shape models with random weights, built from a model option's figures and written tensor by
  tensor, one safetensors shard per decoder layer (`build_random_model`), in bf16 (loaded through the
  real 4-bit path by `from_pretrained`) or pre-quantized NF4 (a 70B that never exists in memory at
  once); a word-level tokenizer of the model's vocabulary size and synthetic text data;
- runs: `run_child` (wall time and peak RSS of one child process, from `wait4`), `read_ours` (what a
  `train.py` run dir holds), `read_baseline`, `steady_step_s`, `summarize`, `baseline_argv` (the same
  job for `scripts/baseline_qlora.py`);
- output: `render_markdown`, `update_readme`.

Definitions, the same for ours and the baseline: wall_s = the child process from start to exit;
train_s = trainer construction + `train()`; tokens_per_s = TRL's `num_tokens` / train_s;
s_per_step = the mean time per optimizer step after the warm-up steps (from step-end times);
tokens_per_s_steady = (num_tokens / steps) / s_per_step; peak memory: on a GPU
`max_memory_allocated` (and `max_memory_reserved`), on a CPU the child's peak RSS.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------
def median(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return statistics.median(xs) if xs else None


def ratio(ours: float | None, base: float | None) -> float | None:
    if ours is None or base is None or base == 0:
        return None
    return ours / base


def pct_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in %: positive when the prediction is above the measurement."""
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict:
    """Least-squares y = intercept + slope * x; r2 and the largest absolute residual."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit_line needs at least 2 (x, y) pairs of equal length, got {len(xs)} and {len(ys)}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs at least 2 different x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    residuals = [y - (intercept + slope * x) for x, y in zip(xs, ys, strict=True)]
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum(r * r for r in residuals)
    return {
        "slope": slope,
        "intercept": intercept,
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        "max_abs_residual": max(abs(r) for r in residuals),
    }


def extrapolate_layers(points: Mapping[int, float], target_layers: int) -> dict:
    """Fit value = intercept + slope * layers over measured {layers: value} and evaluate at target_layers.

    Peak memory and seconds/step of a decoder-only model grow by the same amount per identical layer
    (weights, adapters, the checkpointed layer input), plus a constant (embeddings, lm_head, logits, one
    layer's working set), so a line through a few reduced-layer runs predicts the full depth."""
    good = {int(k): float(v) for k, v in points.items() if v is not None}
    fit = fit_line(sorted(good), [good[k] for k in sorted(good)])
    return {
        "points": {str(k): good[k] for k in sorted(good)},
        "per_layer": fit["slope"],
        "constant": fit["intercept"],
        "r2": fit["r2"],
        "max_abs_residual": fit["max_abs_residual"],
        "target_layers": target_layers,
        "at_target": fit["intercept"] + fit["slope"] * target_layers,
    }


def steady_step_s(step_end_s: Mapping[int, float], warmup: int) -> float | None:
    """Mean seconds per step after the first `warmup` steps: (end of the last step - end of step
    `warmup`) / the steps between. `step_end_s` maps step numbers (1-based) to cumulative times; it
    needs only some steps (train.py logs every trainer.memory_log_steps): the first logged step at or
    after `warmup` starts the interval. None with fewer than 2 usable points."""
    steps = sorted(k for k in step_end_s if k >= max(1, warmup))
    if len(steps) < 2:
        return None
    first, last = steps[0], steps[-1]
    return (step_end_s[last] - step_end_s[first]) / (last - first)


# ---------------------------------------------------------------------------------------------
# Where we are
# ---------------------------------------------------------------------------------------------
def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


_GPU_QUERY = (
    "import json, torch\n"
    "ok = torch.cuda.is_available()\n"
    "p = torch.cuda.get_device_properties(0) if ok else None\n"
    "print(json.dumps({'gpu': ok, 'name': p.name if ok else None, 'total': p.total_memory if ok else None,"
    " 'count': torch.cuda.device_count() if ok else 0, 'cuda': torch.version.cuda}))\n"
)


def describe_device(force_cpu: bool = False) -> dict:
    """The device the benchmark runs on. The GPU is asked about in a child process, so this process
    never holds a CUDA context while the measured children run."""
    gpu = None
    if not force_cpu and os.environ.get("CUDA_VISIBLE_DEVICES", None) not in ("", "-1"):
        try:
            out = subprocess.run([sys.executable, "-c", _GPU_QUERY], capture_output=True, text=True, timeout=120)
            gpu = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            gpu = None
    if gpu and gpu.get("gpu"):
        name = gpu["name"]
        return {
            "kind": "cuda",
            "name": name,
            "slug": slug(name),
            "total_bytes": int(gpu["total"]),
            "count": gpu["count"],
            "cuda": gpu["cuda"],
        }
    name = f"cpu: {cpu_model_name()}, {cpu_cores()} cores"
    return {"kind": "cpu", "name": name, "slug": slug(name), "total_bytes": None, "count": 0, "cuda": None}


def busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of the machine have used (Linux /proc/stat, idle and iowait excluded)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict:
    """Versions of the stack and the commit measured."""
    from importlib import metadata

    env: dict[str, Any] = {"python": platform.python_version()}
    for name in (
        "torch",
        "transformers",
        "peft",
        "trl",
        "bitsandbytes",
        "accelerate",
        "datasets",
        "liger-kernel",
        "flash-attn",
    ):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        env["git"] = f"{commit}{' (with uncommitted changes)' if dirty else ''}" if commit else None
    except (OSError, subprocess.TimeoutExpired):
        env["git"] = None
    return env


def today() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------
# Real-shape models with random weights
# ---------------------------------------------------------------------------------------------
FIGURE_KEYS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "vocab_size",
    "tie_embeddings",
    "max_position_embeddings",
)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def figures_of(model_cfg: Mapping[str, Any], **changes: Any) -> dict:
    """The architecture figures of a model option (a dict or DictConfig), with `changes` applied."""
    fig = {k: model_cfg[k] for k in FIGURE_KEYS if k in model_cfg}
    fig["head_dim"] = model_cfg.get("head_dim") if hasattr(model_cfg, "get") else None
    arch = model_cfg.get("architecture", "llama") if hasattr(model_cfg, "get") else "llama"
    if arch != "llama":
        raise ValueError(f"random-weight models are built for the llama architecture only, not {arch}")
    fig.update({k: v for k, v in changes.items() if v is not None})
    if not fig.get("head_dim"):
        fig["head_dim"] = fig["hidden_size"] // fig["num_heads"]
    return fig


def figure_overrides(fig: Mapping[str, Any]) -> list[str]:
    """train.py overrides that describe `fig` (so the composed config and the model dir agree)."""
    keys = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "intermediate_size",
        "vocab_size",
        "tie_embeddings",
        "max_position_embeddings",
        "head_dim",
    )
    return [f"model.{k}={str(fig[k]).lower() if isinstance(fig[k], bool) else fig[k]}" for k in keys if k in fig]


def llama_tensor_shapes(fig: Mapping[str, Any]) -> tuple[list[tuple[str, tuple]], list[list[tuple[str, tuple]]]]:
    """(non-layer tensors, per-layer tensors) of a Llama in the HF checkpoint layout: (name, shape)."""
    h, f, v = fig["hidden_size"], fig["intermediate_size"], fig["vocab_size"]
    hd = fig.get("head_dim") or h // fig["num_heads"]
    q, kv = fig["num_heads"] * hd, fig["num_kv_heads"] * hd
    top = [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,))]
    if not fig.get("tie_embeddings"):
        top.append(("lm_head.weight", (v, h)))
    layers = []
    for i in range(fig["num_layers"]):
        p = f"model.layers.{i}."
        layers.append(
            [
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (f, h)),
                (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f)),
            ]
        )
    return top, layers


def model_disk_bytes(fig: Mapping[str, Any], quantize: str | None) -> int:
    """About what `build_random_model` writes: bf16, or for the layers' linears NF4 (0.5 B/param, a uint8
    absmax per 64, ~2 KiB of maps and state per tensor)."""
    top, layers = llama_tensor_shapes(fig)
    total = 0
    for name, shape in top + [t for layer in layers for t in layer]:
        n = math.prod(shape)
        if quantize and len(shape) == 2 and ".layers." in name:
            total += int(n * (0.5 + 1 / 64)) + 2048  # + the quant maps, nested absmax and packed state
        else:
            total += 2 * n
    return total


def write_tokenizer(out: Path, vocab_size: int, max_length: int = 1 << 20) -> None:
    """A word-level tokenizer with exactly `vocab_size` entries: the 4 specials, then w4 ... w{V-1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )
    tok.save_pretrained(out)


def build_random_model(
    fig: Mapping[str, Any],
    out: Path,
    quantize: str | None = None,
    device: str = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """Write a Llama of these figures with random weights (normal(0, std) matrices, unit norms) to `out`,
    one safetensors shard per decoder layer, so no more than one layer is ever in memory. quantize=None
    writes bf16 (from_pretrained quantizes it at load: the real 4-bit path); quantize="nf4" writes a
    pre-quantized NF4 + double-quant checkpoint in the layout bitsandbytes/transformers save.
    Reuses `out` when a previous build with the same figures completed."""
    import torch
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig, LlamaConfig

    out = Path(out)
    stamp = {"figures": dict(fig), "quantize": quantize, "seed": seed, "std": std}
    marker = out / "bench-model.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    cfg = LlamaConfig(
        vocab_size=fig["vocab_size"],
        hidden_size=fig["hidden_size"],
        intermediate_size=fig["intermediate_size"],
        num_hidden_layers=fig["num_layers"],
        num_attention_heads=fig["num_heads"],
        num_key_value_heads=fig["num_kv_heads"],
        head_dim=fig.get("head_dim") or None,
        max_position_embeddings=fig.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(fig.get("tie_embeddings")),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
    )
    if quantize:
        if quantize != "nf4":
            raise ValueError(f"pre-quantized models are built in nf4 only, not {quantize}")
        cfg.quantization_config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ).to_dict()
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)
    write_tokenizer(out, fig["vocab_size"])

    gen = torch.Generator(device=device).manual_seed(seed)
    top, layers = llama_tensor_shapes(fig)
    shards = [top] + layers
    weight_map: dict[str, str] = {}
    total = 0
    for idx, tensors in enumerate(shards):
        name = f"model-{idx + 1:05d}-of-{len(shards):05d}.safetensors"
        data: dict[str, Any] = {}
        for key, shape in tensors:
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                t = torch.randn(shape, generator=gen, dtype=torch.bfloat16, device=device).mul_(std)
            if quantize and len(shape) == 2 and ".layers." in key:
                import bitsandbytes.functional as bnbf

                packed, state = bnbf.quantize_4bit(
                    t, blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
                )
                data[key] = packed.cpu().contiguous()
                for sub, value in state.as_dict(packed=True).items():
                    data[f"{key}.{sub}"] = value.cpu().contiguous()
                del packed, state
            else:
                data[key] = t.cpu().contiguous()
            del t
        save_file(data, str(out / name), metadata={"format": "pt"})
        for key, value in data.items():
            weight_map[key] = name
            total += value.numel() * value.element_size()
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    marker.write_text(json.dumps(stamp))
    return out


def write_text_data(path: Path, vocab_size: int, rows: int, min_words: int, max_words: int, seed: int = 0) -> Path:
    """`rows` lines of {"text": "w17 w4051 ..."}; lengths log-uniform in [min_words, max_words] (equal
    bounds: every row that long). Word ids avoid the 4 special tokens."""
    import random

    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lo, hi = math.log(min_words), math.log(max_words)
    with open(path, "w") as f:
        for _ in range(rows):
            n = min_words if min_words == max_words else int(round(math.exp(rng.uniform(lo, hi))))
            words = " ".join(f"w{rng.randrange(len(SPECIAL_TOKENS), vocab_size)}" for _ in range(n))
            f.write(json.dumps({"text": words}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------
def child_env(extra: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "HYDRA_FULL_ERROR": "1",
        }
    )
    env.update(extra or {})
    return env


def run_child(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    cwd: Path = REPO,
) -> dict:
    """Run one child to completion, its output to `log_path`. Returns rc, wall_s and the child's own
    peak RSS (wait4's ru_maxrss: per process, unlike RUSAGE_CHILDREN)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(str(a) for a in argv) + "\n")
        log.flush()
        load_1min = (load_average() or [None])[0]
        busy0 = busy_cpu_seconds()
        started = time.perf_counter()
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else child_env(),
            process_group=0,  # its own group (killed whole on timeout), in our session
        )
        timed_out = False
        deadline = None if timeout_s is None else started + timeout_s
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if deadline is not None and time.perf_counter() > deadline:
                    timed_out = True
                    _kill_group(proc.pid)
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.05)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the child must not outlive us
            _kill_group(proc.pid)
            raise
        wall = time.perf_counter() - started
        busy1 = busy_cpu_seconds()
        cpu_s = usage.ru_utime + usage.ru_stime
        proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "peak_rss_gib": usage.ru_maxrss / 2**20,
        "cpu_s": cpu_s,  # CPU time of the process: less sensitive to other load than wall time
        "load_1min": load_1min,  # the machine's 1-minute load average as the child started
        # cores the rest of the machine kept busy meanwhile (all busy CPU time less the child's, per second)
        "others_cores": max(0.0, (busy1 - busy0 - cpu_s) / wall) if busy0 is not None and wall > 0 else None,
        "timed_out": timed_out,
        "log": str(log_path.relative_to(REPO)) if log_path.is_relative_to(REPO) else str(log_path),
    }


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path: str | Path, lines: int = 4) -> str:
    path = Path(path) if Path(path).is_absolute() else REPO / path
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    useful = [ln for ln in text if ln.strip() and "Warning" not in ln and "warnings.warn" not in ln]
    return " | ".join(useful[-lines:])[-600:]


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finish(rec: dict, warmup: int, step_ends: Mapping[int, float], gpu: bool) -> dict:
    steps = rec.get("steps") or 0
    rec["s_per_step"] = steady_step_s(step_ends, warmup)
    if rec["s_per_step"] is None and steps and rec.get("train_s"):
        rec["s_per_step"] = rec["train_s"] / steps
        rec["s_per_step_note"] = "train_s / steps (too few steps after warm-up)"
    tokens = rec.get("tokens")
    rec["tokens_per_s_steady"] = (
        (tokens / steps / rec["s_per_step"]) if tokens and steps and rec["s_per_step"] else None
    )
    rec["peak_gib"] = rec.get("peak_allocated_gib") if gpu else rec.get("peak_rss_gib")
    return rec


def read_ours(run_dir: Path, child: dict, warmup: int, gpu: bool) -> dict:
    """One `train.py` run: metrics.json, memory.jsonl (a line per step with trainer.memory_log_steps=1)
    and plan.json of its run dir, plus the harness's wall time and peak RSS of the process."""
    rec: dict[str, Any] = {
        "rc": child["rc"],
        "wall_s": child["wall_s"],
        "cpu_s": child.get("cpu_s"),
        "load_1min": child.get("load_1min"),
        "others_cores": child.get("others_cores"),
        "peak_rss_gib": child["peak_rss_gib"],
        "log": child["log"],
    }
    metrics_path = run_dir / "metrics.json"
    m = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if child["rc"] != 0 or m.get("status") != "ok":
        rec["status"] = "error"
        rec["error"] = m.get("error") or log_tail(child["log"]) or f"exit status {child['rc']}"
        if child.get("timed_out"):
            rec["error"] = "timed out; " + rec["error"]
        return rec
    rec.update(
        status="ok",
        steps=m.get("steps"),
        train_s=m.get("train_s"),
        proc_wall_s=m.get("wall_s"),
        loss_first=m.get("train_loss_first"),
        loss_last=m.get("train_loss_last"),
        loss_mean=m.get("train_loss_mean"),
        tokens_per_s=m.get("tokens_per_s"),
        micro_batch_size=m.get("micro_batch_size"),
        grad_accum=m.get("grad_accum"),
    )
    if rec["tokens_per_s"] and rec["train_s"]:
        rec["tokens"] = rec["tokens_per_s"] * rec["train_s"]
    samples = _jsonl(run_dir / "memory.jsonl")
    by_step: dict[int, float] = {}
    for s in samples:
        by_step.setdefault(int(s["step"]), float(s["t_s"]))  # the last step is logged twice (train end)
    if gpu:
        rec["peak_allocated_gib"] = m.get("peak_mem_gib")
        reserved = [s["reserved_gib"] for s in samples if "reserved_gib" in s]
        rec["peak_reserved_gib"] = max(reserved) if reserved else None
    if (run_dir / "oom.json").exists():  # lifecycle.OomRecord: an out-of-memory retry changed the stack
        rec["note"] = "out of memory during the run; the OOM ladder changed the stack (oom.json)"
        rec["oom"] = True
    return _finish(rec, warmup, by_step, gpu)


def read_baseline(metrics_path: Path, child: dict, warmup: int, gpu: bool) -> dict:
    rec: dict[str, Any] = {
        "rc": child["rc"],
        "wall_s": child["wall_s"],
        "cpu_s": child.get("cpu_s"),
        "load_1min": child.get("load_1min"),
        "others_cores": child.get("others_cores"),
        "peak_rss_gib": child["peak_rss_gib"],
        "log": child["log"],
    }
    m = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if child["rc"] != 0 or m.get("status") != "ok":
        rec["status"] = "error"
        rec["error"] = log_tail(child["log"]) or f"exit status {child['rc']}"
        if child.get("timed_out"):
            rec["error"] = "timed out; " + rec["error"]
        return rec
    rec.update(
        status="ok",
        steps=m.get("steps"),
        train_s=m.get("train_s"),
        proc_wall_s=m.get("wall_s"),
        loss_first=m.get("train_loss_first"),
        loss_last=m.get("train_loss_last"),
        loss_mean=m.get("train_loss_mean"),
        tokens=m.get("tokens"),
        tokens_per_s=m.get("tokens_per_s"),
    )
    if gpu:
        rec["peak_allocated_gib"] = m.get("peak_mem_gib")
        rec["peak_reserved_gib"] = m.get("peak_reserved_gib")
    ends = m.get("step_end_s") or []
    return _finish(rec, warmup, {i + 1: t for i, t in enumerate(ends)}, gpu)


SUMMARY_KEYS = (
    "wall_s",
    "cpu_s",
    "train_s",
    "s_per_step",
    "tokens_per_s",
    "tokens_per_s_steady",
    "peak_gib",
    "peak_rss_gib",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "loss_first",
    "loss_last",
    "loss_mean",
    "steps",
)


def summarize(runs: list[dict]) -> dict:
    """Medians over the successful runs; status error when none succeeded."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        errors = [r.get("error") for r in runs if r.get("error")]
        return {"status": "error", "n": 0, "error": errors[0] if errors else "no run"}
    out: dict[str, Any] = {"status": "ok", "n": len(ok)}
    for key in SUMMARY_KEYS:
        out[key] = median(r.get(key) for r in ok)
    others = [r["others_cores"] for r in runs if r.get("others_cores") is not None]
    out["max_others_cores"] = max(others) if others else None
    notes = sorted({r["note"] for r in ok if r.get("note")})
    if notes:
        out["note"] = "; ".join(notes)
    return out


RATIO_KEYS = ("wall_s", "cpu_s", "train_s", "s_per_step", "tokens_per_s", "tokens_per_s_steady", "peak_gib")


def ratios(ours: Mapping[str, Any], base: Mapping[str, Any]) -> dict:
    return {k: ratio(ours.get(k), base.get(k)) for k in RATIO_KEYS}


def plan_summary(plan: Mapping[str, Any]) -> dict:
    """The planner's figures compared with a measurement: its peak, the CUDA context and allocator
    overhead it includes (a GPU run's max_memory_reserved sees neither the context nor, for
    max_memory_allocated, the allocator overhead)."""
    dev = max(plan["devices"], key=lambda d: d["peak"]) if plan.get("devices") else None
    name = dev["device"] if dev else None
    comps = plan.get("components", {})
    ctx = comps.get("cuda_context", {}).get(name, 0) if name else 0
    alloc = comps.get("allocator_overhead", {}).get(name, 0) if name else 0
    return {
        "device": name,
        "peak_gib": plan.get("peak_gib"),
        "peak_phase": dev.get("peak_phase") if dev else None,
        "cuda_context_gib": ctx / GiB,
        "allocator_overhead_gib": alloc / GiB,
        "fits": plan.get("fits"),
    }


def plan_errors(plan: Mapping[str, Any], measured: Mapping[str, Any], gpu: bool) -> dict:
    """Planner error in %. CPU: planned peak vs the process's peak RSS. GPU: planned peak less the CUDA
    context vs max_memory_reserved (the headline), and less the allocator overhead too vs
    max_memory_allocated."""
    if not plan or measured.get("status") != "ok":
        return {}
    peak = plan.get("peak_gib")
    if not gpu:
        return {
            "vs_peak_rss": pct_error(peak, measured.get("peak_rss_gib")),
            "headline": pct_error(peak, measured.get("peak_rss_gib")),
        }
    ctx, alloc = plan.get("cuda_context_gib") or 0.0, plan.get("allocator_overhead_gib") or 0.0
    reserved = pct_error(peak - ctx, measured.get("peak_reserved_gib")) if peak is not None else None
    allocated = pct_error(peak - ctx - alloc, measured.get("peak_allocated_gib")) if peak is not None else None
    return {"vs_reserved": reserved, "vs_allocated": allocated, "headline": reserved}


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def baseline_argv(cfg: Any, out_dir: Path, metrics_path: Path) -> list[str]:
    """The same job as `train.py` with this composed config, as arguments of scripts/baseline_qlora.py."""
    t, o, p, q, d = cfg.trainer, cfg.optim, cfg.peft, cfg.quant, cfg.data
    if p.method != "lora":
        raise ValueError(f"the baseline runs plain LoRA, not peft={p.method}")
    if t.max_steps <= 0:
        raise ValueError("the baseline needs trainer.max_steps > 0")
    targets = p.target_modules if isinstance(p.target_modules, str) else ",".join(p.target_modules)
    argv = [
        sys.executable,
        str(REPO / "scripts" / "baseline_qlora.py"),
        "--model",
        str(cfg.model.name_or_path),
        "--data",
        str(d.path),
        "--out",
        str(out_dir),
        "--metrics-json",
        str(metrics_path),
        "--steps",
        str(t.max_steps),
        "--batch",
        str(t.micro_batch_size),
        "--grad-accum",
        str(t.grad_accum),
        "--seq-len",
        str(t.seq_len),
        "--quant",
        q.method,
        "--dtype",
        _DTYPES[cfg.precision.name],
        "--optim",
        o.name,
        "--lr",
        str(o.lr),
        "--scheduler",
        o.scheduler,
        "--warmup-ratio",
        str(o.warmup_ratio),
        "--weight-decay",
        str(o.weight_decay),
        "--max-grad-norm",
        str(o.max_grad_norm),
        "--r",
        str(p.r),
        "--alpha",
        str(p.alpha),
        "--dropout",
        str(p.dropout),
        "--target-modules",
        targets,
        "--attn",
        cfg.model.attn_implementation,
        "--seed",
        str(cfg.seed),
        "--logging-steps",
        str(cfg.trainer.logging_steps),
    ]
    if not q.double_quant:
        argv.append("--no-double-quant")
    if not t.gradient_checkpointing:
        argv.append("--no-gradient-checkpointing")
    if t.checkpointing_mode == "reentrant":
        argv.append("--reentrant")
    if d.packing:
        argv.append("--packing")
    if not d.completion_only_loss:
        argv.append("--no-completion-only-loss")
    return argv


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}{suffix}"
    return str(value)


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value:+.1f} %"


def _x(value: Any) -> str:
    return "–" if value is None else f"{value:.3f}"


def _stack_rows(stacks: list[dict], gpu: bool) -> list[str]:
    mem = "alloc / reserved GiB" if gpu else "peak RSS GiB"
    lines = [
        f"| stack | run | n | others | wall s | CPU s | train s | s/step | tokens/s | tokens/s steady | {mem} | plan GiB | "
        "plan err | loss first → last |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in stacks:
        if s.get("status") == "skipped":
            lines.append(f"| {s['name']} | skipped: {s.get('reason', '')} | | | | | | | | | | | | |")
            continue
        for side in ("ours", "baseline"):
            r = s.get(side)
            if not r:
                continue
            if r.get("status") != "ok":
                lines.append(f"| {s['name']} | {side}: error | | | | | | | | | | | | {str(r.get('error', ''))[:160]} |")
                continue
            m = (
                f"{_f(r.get('peak_allocated_gib'), 2)} / {_f(r.get('peak_reserved_gib'), 2)}"
                if gpu
                else _f(r.get("peak_rss_gib"), 3)
            )
            err = (s.get("plan_error_pct") or {}).get(side, {}).get("headline")
            lines.append(
                f"| {s['name']} | {side} | {r.get('n')} | {_f(r.get('max_others_cores'), 2)} | {_f(r.get('wall_s'), 1)} | "
                f"{_f(r.get('cpu_s'), 1)} | "
                f"{_f(r.get('train_s'), 2)} | "
                f"{_f(r.get('s_per_step'), 3)} | {_f(r.get('tokens_per_s'), 0)} | {_f(r.get('tokens_per_s_steady'), 0)} | "
                f"{m} | {_f((s.get('plan') or {}).get('peak_gib'), 2)} | {_pct(err)} | "
                f"{_f(r.get('loss_first'), 3)} → {_f(r.get('loss_last'), 3)} |"
            )
    return lines


def _ratio_rows(stacks: list[dict]) -> list[str]:
    with_base = [s for s in stacks if s.get("ratios")]
    if not with_base:
        return []
    lines = [
        "",
        "Ours / baseline (medians; < 1 is faster or smaller for time and memory, > 1 is faster for tokens/s):",
        "",
        "| stack | wall | CPU time | train | s/step | tokens/s | tokens/s steady | peak memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in with_base:
        r = s["ratios"]
        lines.append(
            f"| {s['name']} | {_x(r.get('wall_s'))} | {_x(r.get('cpu_s'))} | {_x(r.get('train_s'))} | "
            f"{_x(r.get('s_per_step'))} | "
            f"{_x(r.get('tokens_per_s'))} | {_x(r.get('tokens_per_s_steady'))} | {_x(r.get('peak_gib'))} |"
        )
    return lines


def render_markdown(res: Mapping[str, Any]) -> str:
    """One results JSON as markdown: header, stacks, ratios, timings, GPU sections, goals."""
    gpu = res.get("device", {}).get("kind") == "cuda"
    lines = [f"### {res.get('suite')} suite — {res['device']['name']} — {res.get('date')}", ""]
    for run in res.get("runs", []):
        load = run.get("load_avg_before")
        after = run.get("load_avg_after")
        lines.append(
            f"- `{run.get('command')}` at {run.get('started')}; load average (1, 5, 15 min) before "
            f"{load}, after {after}{'; SHRINK mode (small shapes, not real figures)' if run.get('shrink') else ''}"
        )
    env = res.get("environment", {})
    lines.append("- " + ", ".join(f"{k} {v}" for k, v in env.items() if v))
    s = res.get("settings", {})
    if s:
        lines.append(
            f"- {s.get('steps')} optimizer steps per run, the first {s.get('warmup_steps')} excluded from "
            f"s/step; ours and baseline alternated (ABAB), {s.get('repeats')} pair(s) per stack unless "
            "the stack says n; medians"
        )
    stacks = res.get("stacks", [])
    if stacks:
        lines += ["", *_stack_rows(stacks, gpu), *_ratio_rows(stacks)]
    timings = res.get("timings", [])
    if timings:
        lines += ["", "| timing | command | runs (s) | median s | goal | |", "|---|---|---|---|---|---|"]
        for t in timings:
            runs = ", ".join(_f(x, 2) for x in t.get("runs_s", []))
            ok = "–" if t.get("pass") is None else ("pass" if t["pass"] else "FAIL")
            lines.append(
                f"| {t['name']} | `{t.get('command')}` | {runs} | {_f(t.get('median_s'), 2)} | "
                f"< {t.get('goal_s')} s | {ok} |"
            )
            if t.get("error"):
                lines.append(f"| | error: {str(t['error'])[:200]} | | | | |")
    for sec in res.get("slope", []):
        lines += [
            "",
            f"Per-layer slope: {sec['name']} (layers {', '.join(sec.get('layers', []) and map(str, sec['layers']))}"
            f" → {sec.get('target_layers')})",
            "",
        ]
        lines += [
            "| quantity | per layer | constant | r² | at target | planner at target | planner err |",
            "|---|---|---|---|---|---|---|",
        ]
        for q in sec.get("fits", []):
            if q.get("error"):
                lines.append(f"| {q['quantity']} | {q['error']} | | | | | |")
                continue
            lines.append(
                f"| {q['quantity']} | {_f(q.get('per_layer'), 4)} | {_f(q.get('constant'), 3)} | "
                f"{_f(q.get('r2'), 4)} | {_f(q.get('at_target'), 2)} | {_f(q.get('planner'), 2)} | "
                f"{_pct(q.get('planner_err_pct'))} |"
            )
    for sec in res.get("seq_search", []):
        lines += [
            "",
            f"Longest sequence: {sec['name']} — mode {sec.get('mode')}: longest that fits "
            f"**{sec.get('longest_seq')}** (planner: {sec.get('planner_longest_seq')}); probes:",
            "",
        ]
        lines += ["| seq | fits | predicted / measured GiB | note |", "|---|---|---|---|"]
        for p in sec.get("probes", []):
            lines.append(f"| {p['seq_len']} | {_f(p.get('fits'))} | {_f(p.get('peak_gib'), 2)} | {p.get('note', '')} |")
    goals = res.get("goals", [])
    if goals:
        lines += ["", "| goal | target | measured | |", "|---|---|---|---|"]
        for g in goals:
            ok = "–" if g.get("pass") is None else ("pass" if g["pass"] else "FAIL")
            lines.append(f"| {g['claim']} | {g['target']} | {g.get('measured', '–')} | {ok} |")
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, res: Mapping[str, Any], markdown: str, results_file: str) -> None:
    """Replace (or add) this device and suite's section of bench/README.md with the latest table."""
    key = f"{res['device']['slug']}:{res.get('suite')}"
    begin, end = f"<!-- BEGIN {key} -->", f"<!-- END {key} -->"
    block = f"{begin}\n{markdown}\nFull results: [`{results_file}`]({results_file})\n{end}"
    text = readme.read_text() if readme.is_file() else "# Benchmarks\n\n## Latest results\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        anchor = "<!-- RESULTS -->"
        if anchor in text:
            text = text.replace(anchor, anchor + "\n\n" + block, 1)
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)
