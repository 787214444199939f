"""Trainer callbacks: memory timeline (memory.jsonl, TensorBoard scalars, memory.png)."""

import json
import resource
import time
from pathlib import Path

import psutil
import torch
from transformers import TrainerCallback

GiB = 2**30


def memory_sample() -> dict:
    """GPU: allocated / reserved / peak allocated. CPU: current and peak RSS of this process."""
    if torch.cuda.is_available():
        return {
            "allocated_gib": torch.cuda.memory_allocated() / GiB,
            "reserved_gib": torch.cuda.memory_reserved() / GiB,
            "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        }
    return {
        "rss_gib": psutil.Process().memory_info().rss / GiB,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


class MemoryLogger(TrainerCallback):
    def __init__(self, run_dir: Path, every: int, tb_writer=None):
        self.path, self.every, self.tb = run_dir / "memory.jsonl", max(1, every), tb_writer
        self.png = run_dir / "memory.png"
        self.started = time.time()

    def _record(self, step: int) -> None:
        sample = {"step": step, "t_s": round(time.time() - self.started, 3), **memory_sample()}
        with open(self.path, "a") as f:
            f.write(json.dumps(sample) + "\n")
        if self.tb is not None:
            for key, value in sample.items():
                if key.endswith("_gib"):
                    self.tb.add_scalar(f"memory/{key}", value, step)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step % self.every == 0:
            self._record(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self._record(state.global_step)
        plot_timeline(self.path, self.png)


def plot_timeline(jsonl: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key in sorted({k for r in rows for k in r if k.endswith("_gib")}):
        ax.plot([r["step"] for r in rows], [r.get(key) for r in rows], label=key.removesuffix("_gib"), marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_title("memory over the run")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
