"""Per optimizer step: device->host syncs and kernels of our trainer against the plain script's.

    python -m bench syncs                  # -> bench/results/per-step-syncs.json / .md
    python -m bench syncs --steps 3 --warmup 1 --no-write

Two fresh processes train the same tiny model on the same data and settings: ours through
`qlora_recipes.run.training.train` (the trainer train.py builds: guards, callbacks, our arguments),
the baseline through `bench/baseline.py` (SFTTrainer as the docs show it, its arguments from the
same composed config: bench/runner.baseline_argv). After `--warmup` optimizer steps, each of the
next `--steps` steps is counted by a TorchDispatchMode from the moment its micro-batches are in
hand (the data loader's host-side collation is not counted) to the end of its logging:

- syncs: what makes the host wait for the device on a GPU: `_local_scalar_dense` (`.item()`,
  `bool()`/`int()`/`float()` of a tensor, `if tensor:`), ops whose output size depends on values
  (`nonzero`, `masked_select`, `unique`, indexing by a boolean mask, `repeat_interleave` without a
  size), `equal`, and `.tolist()`, `.cpu()`, `.numpy()` of a tensor;
- kernels: every other aten (or custom, e.g. bitsandbytes) op dispatched, but views and
  allocations, which launch nothing.

The count runs on real CPU tensors: the fake CUDA device of bench/trace holds no values, and the
trainer's loop reads them (losses, NaN checks, logging). Both processes take the same CPU code
paths, so the difference between them is ours; on a GPU each counted sync is a device->host wait
and each kernel a launch (bitsandbytes' CPU 4-bit kernels stand in for its CUDA ones).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# The job counted: the GPU suite's 8B stack (bench/suites/gpu.yaml: NF4, paged 8-bit AdamW,
# checkpointing, bf16, loss on every token) on the tiny model and its sample rows, with padded
# micro-batches of two rows and two of them per step, so per-micro-batch work shows twice.
JOB = [
    "model.name_or_path=assets/tiny-llama",
    "data.path=assets/data/order/train.jsonl",
    "data.format=prompt_completion",
    "data.completion_only_loss=false",
    "data.eval_path=null",
    "data.eval_fraction=0",
    "data.metric=null",
    "quant=nf4",
    "optim=paged8bit",
    "precision=bf16",
    "trainer=smoke",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=2",
    "trainer.grad_accum=2",
    "trainer.gradient_checkpointing=true",
    "trainer.save_steps=0",
    "trainer.eval_steps=0",
]
# Ours as it is (bf16 adapters under this bf16 job, as TRL and the baseline train them: peft.adapter_dtype=auto),
# with float32 master adapters, whose LoRA layers add casts to the compute dtype, and padding-free
# (the rows packed into one flat row through sdpa_varlen, whose sequence bounds are read from the device):
VARIANTS = {
    "ours": [],
    "ours-fp32-adapters": ["peft.adapter_dtype=float32"],
    "ours-padding-free": ["data.packing=true", "data.packing_strategy=bfd", "model.attn_implementation=auto"],
}
# Where ours' TrainingArguments may differ from the plain script's, and why; any other is a finding.
RUN_PATHS = ("output_dir", "logging_dir", "run_name")  # each side's own run dir
ARGS_DIFFER = {
    "project": "the logger group's project (trackio)",
    "dataset_kwargs": "skip_prepare_dataset: our SFT rows come labelled and truncated (run/sft_rows.py), not re-passed row by row",
    "logging_nan_inf_filter": "off: a NaN loss must show, not be averaged away (on, it costs 2 syncs per micro-batch)",
    "num_train_epochs": "trainer.epochs; trainer.max_steps decides",
    "per_device_eval_batch_size": "trainer.eval_batch_size (no evaluation here)",
    "save_total_limit": "trainer.save_total_limit (no checkpoints here)",
}
SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten._unique.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
}
NO_KERNEL = {  # metadata and allocation: nothing runs on the device
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.empty_like.default",
    "aten._unsafe_view.default",
    "aten.lift_fresh.default",
    "aten.set_.source_Storage_storage_offset",
    "aten.resize_.default",
    "aten.is_same_size.default",
    "aten.sym_size.int",
    "aten.sym_stride.int",
    "aten.sym_numel.default",
    "aten.sym_storage_offset.default",
}
HOST_READS = ("tolist", "cpu", "numpy")  # Tensor methods that copy to the host


def _bool_index(name: str, args: tuple) -> bool:
    """Indexing by a boolean mask: its output size is the mask's count (a nonzero inside)."""
    import torch

    if name not in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default") or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())


def counting_mode():
    """A TorchDispatchMode that counts ops while `active`: `syncs` and `kernels` (Counters by op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.active = False
            self.syncs: Counter = Counter()
            self.kernels: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.active:
                name = str(func)
                if name in SYNC_OPS or _bool_index(name, args):
                    self.syncs[name] += 1
                elif not (func.is_view or name in NO_KERNEL):
                    self.kernels[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


class StepWindow:
    """Counts optimizer steps warmup+1 .. warmup+steps of whichever Trainer trains in this process:
    each from the return of `get_batch_samples` (its micro-batches fetched) to the end of
    `_maybe_log_save_evaluate` (its logging done); later fetches inside the window are not counted."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.mode = counting_mode()
        self.per_step: dict[int, dict] = {}
        self._step: int | None = None
        self.args: dict = {}  # the trainer's TrainingArguments, as it trains

    def install(self) -> None:
        import torch
        from transformers import Trainer

        window, mode = self, self.mode
        train, fetch, log = Trainer.train, Trainer.get_batch_samples, Trainer._maybe_log_save_evaluate

        def counted_train(trainer, *args, **kwargs):
            window.args = json.loads(json.dumps(trainer.args.to_dict(), default=str))
            with mode:
                return train(trainer, *args, **kwargs)

        def counted_fetch(trainer, *args, **kwargs):
            was, mode.active = mode.active, False
            out = fetch(trainer, *args, **kwargs)
            step = trainer.state.global_step
            mode.active = was or window.warmup <= step < window.warmup + window.steps
            if mode.active and window._step is None:
                window._step = step + 1
            return out

        def counted_log(trainer, *args, **kwargs):
            out = log(trainer, *args, **kwargs)
            if window._step is not None and trainer.state.global_step >= window._step:
                window.close()
            return out

        Trainer.train, Trainer.get_batch_samples, Trainer._maybe_log_save_evaluate = (
            counted_train,
            counted_fetch,
            counted_log,
        )
        for method in HOST_READS:
            setattr(torch.Tensor, method, _host_read(getattr(torch.Tensor, method), f"Tensor.{method}", mode))

    def close(self) -> None:
        mode = self.mode
        self.per_step[self._step] = {
            "syncs": sum(mode.syncs.values()),
            "kernels": sum(mode.kernels.values()),
            "sync_ops": dict(mode.syncs.most_common()),
            "kernel_ops": dict(mode.kernels.most_common()),
        }
        mode.syncs.clear()
        mode.kernels.clear()
        mode.active, self._step = False, None


def _host_read(original, name: str, mode):
    def read(self, *args, **kwargs):
        if mode.active:
            mode.syncs[name] += 1
        return original(self, *args, **kwargs)

    return read


def _quiet() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("transformers", "peft", "trl", "bitsandbytes", "accelerate", "train", "qlora_recipes"):
        logging.getLogger(name).setLevel(logging.ERROR)


def child(side: str, spec: dict) -> dict:
    """One side's training run in this process, counted; the per-step counts."""
    _quiet()
    window = StepWindow(spec["warmup"], spec["steps"])
    window.install()
    out = Path(spec["out"])
    if side == "ours":
        from qlora_recipes.config.loader import load
        from qlora_recipes.run.training import train

        train(load(spec["overrides"]), out / "ours")
    else:
        from bench import baseline

        baseline.main(spec["baseline_argv"])
    return {"steps": {str(k): v for k, v in sorted(window.per_step.items())}, "args": window.args}


def _summary(per_step: dict) -> dict:
    n = max(1, len(per_step))
    syncs = Counter()
    kernels = Counter()
    for s in per_step.values():
        syncs.update(s["sync_ops"])
        kernels.update(s["kernel_ops"])
    return {
        "syncs_per_step": sum(syncs.values()) / n,
        "kernels_per_step": sum(kernels.values()) / n,
        "sync_ops_per_step": {k: v / n for k, v in syncs.most_common()},
        "kernel_ops_per_step": {k: v / n for k, v in kernels.most_common()},
        "steps": {k: {"syncs": v["syncs"], "kernels": v["kernels"]} for k, v in per_step.items()},
    }


def _run_side(side: str, spec: dict, tmp: Path, timeout: float) -> dict:
    """One side in a fresh process from the repository root: its per-step counts, summarised."""
    repo = Path(__file__).resolve().parents[2]
    spec_path, out = tmp / f"{side}.spec.json", tmp / f"{side}.counts.json"
    spec_path.write_text(json.dumps({**spec, "out": str(tmp / side)}))
    kind = "baseline" if side == "baseline" else "ours"
    cmd = [sys.executable, "-m", "bench.trace.syncs", "_child", kind, str(spec_path), str(out)]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{side} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    counted = json.loads(out.read_text())
    per_step = counted["steps"]
    if len(per_step) != spec["steps"]:
        raise RuntimeError(f"{side}: counted steps {sorted(per_step)}, expected {spec['steps']} after {spec['warmup']}")
    return {**_summary(per_step), "args": counted["args"]}


def count(overrides: list[str], warmup: int = 2, steps: int = 2, variants=None, timeout: float = 900) -> dict:
    """The baseline and each variant of ours (extra overrides on `overrides`), each counted in a fresh
    process: {"sides": {name: summary}, "logging_steps": ...}."""
    from bench.runner import baseline_argv
    from qlora_recipes.config.loader import load

    variants = VARIANTS if variants is None else variants
    total = [f"trainer.max_steps={warmup + steps}"]
    cfg = load([*overrides, *total])
    sides: dict = {}
    with tempfile.TemporaryDirectory(prefix="syncs-") as tmp:
        base = baseline_argv(cfg, Path(tmp) / "baseline", Path(tmp) / "baseline.json")[3:]
        common = {"warmup": warmup, "steps": steps, "baseline_argv": base}
        for side, extra in {**variants, "baseline": []}.items():
            spec = {**common, "overrides": [*overrides, *extra, *total]}
            sides[side] = _run_side(side, spec, Path(tmp), timeout)
    return {
        "sides": sides,
        "variants": variants,
        "logging_steps": int(cfg.trainer.logging_steps),
        "args_differ": args_differ(sides["ours"]["args"], sides["baseline"]["args"]),
    }


def args_differ(ours: dict, base: dict) -> dict:
    """The TrainingArguments ours trains with that the baseline's do not: {key: [ours, baseline]};
    where each writes its files (its run dir) left out."""
    keys = sorted((set(ours) | set(base)) - set(RUN_PATHS))
    return {k: [ours.get(k), base.get(k)] for k in keys if ours.get(k) != base.get(k)}


def markdown(results: dict) -> str:
    sides = results["sides"]
    names = list(sides)
    head = "| op | " + " | ".join(names) + " |"
    rule = "|---" * (len(names) + 1) + "|"
    lines = [
        "### Device->host syncs and kernels per optimizer step: ours vs the plain script",
        "",
        f"- `{results['command']}` at {results['date']}; device {results['device']}",
        f"- {results['versions']}",
        f"- job: `{' '.join(results['overrides'])}`; {results['warmup']} warm-up steps, "
        f"{results['steps']} counted (a loss logged every {results['logging_steps']})",
        *(f"- {name}: `{' '.join(extra) or 'the job, nothing added'}`" for name, extra in results["variants"].items()),
        "- baseline: `python -m bench.baseline` with the job's model, data and settings (bench/runner.baseline_argv)",
        "",
        "| run | syncs / step | kernels / step |",
        "|---|---|---|",
        *(f"| {n} | {s['syncs_per_step']:g} | {s['kernels_per_step']:g} |" for n, s in sides.items()),
        "",
        "Syncs by op, per step:",
        "",
        head,
        rule,
    ]
    for table, key in ((lines, "sync_ops_per_step"), (None, "kernel_ops_per_step")):
        if table is None:
            lines += ["", "Kernels whose count differs between the runs, per step:", "", head, rule]
        ops = sorted({op for s in sides.values() for op in s[key]})
        for op in ops:
            counts = [s[key].get(op, 0) for s in sides.values()]
            if key == "sync_ops_per_step" or len(set(counts)) > 1:
                lines.append(f"| `{op}` | " + " | ".join(f"{c:g}" for c in counts) + " |")
    lines += ["", "TrainingArguments that differ (ours, baseline), and why:", "", "| key | ours | baseline | why |"]
    lines.append("|---|---|---|---|")
    for key, (o, b) in results["args_differ"].items():
        lines.append(f"| `{key}` | `{o}` | `{b}` | {ARGS_DIFFER.get(key, '**no reason recorded**')} |")
    return "\n".join(lines) + "\n"


def _versions() -> str:
    from importlib.metadata import version

    names = ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate")
    return ", ".join(f"{n} {version(n)}" for n in names)


def main(argv: list[str] | None = None, prog: str = "python -m bench syncs") -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        side, spec_path, out = argv[1:4]
        counts = child(side, json.loads(Path(spec_path).read_text()))
        Path(out).write_text(json.dumps(counts))
        return None
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config overrides after the default job (see JOB)")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before counting")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps counted")
    p.add_argument("--results-dir", default="bench/results")
    p.add_argument("--no-write", action="store_true", help="print the table; write no results file")
    args = p.parse_args(argv)
    overrides = [*JOB, *args.overrides]
    started = time.time()
    results = count(overrides, args.warmup, args.steps)
    results.update(
        command=" ".join([prog, *argv]),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        device=f"cpu ({os.cpu_count()} cores)",
        versions=_versions(),
        overrides=overrides,
        warmup=args.warmup,
        steps=args.steps,
        wall_s=round(time.time() - started, 1),
    )
    table = markdown(results)
    print(table)
    if not args.no_write:
        out = Path(args.results_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "per-step-syncs.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "per-step-syncs.md").write_text(table)
    return results


if __name__ == "__main__":
    main()
