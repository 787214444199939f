"""A training run that never loses work: atomic checkpoints, resume, preemption, NaN and OOM.

- `GuardedTrainer` is TRL's SFTTrainer with two changes: each checkpoint is written into a staging
  dir and renamed into place only when complete (a crash or `kill -9` mid-save leaves the previous
  checkpoint loadable), and a non-finite loss stops the run at the step it appears.
- `find_checkpoint` / `check_resume_config` implement `resume=auto` and its stack check.
- `train_with_oom_ladder` catches out-of-memory during training and retries with the next rung
  that can be applied in-process (halve the micro-batch and double accumulation, then gradient
  checkpointing), resuming from the newest checkpoint.
"""

import gc
import json
import logging
import os
import re
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints
from trl import SFTTrainer

from .errors import UserError

log = logging.getLogger(__name__)
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STAGING = ".partial"

# Keys that may differ between a run and its resumption without changing what is trained.
RESUME_SAFE_PREFIXES = (
    "resume.",
    "force",
    "cache_dir",
    "trainer.max_steps",
    "trainer.epochs",
    "trainer.logging_steps",
    "trainer.eval_steps",
    "trainer.save_steps",
    "trainer.save_total_limit",
    "trainer.memory_log_steps",
    "trainer.progress_bar",
    "trainer.eval_batch_size",
    "trainer.activation_offloading",  # where activations wait for backward, not what is trained
    "data.metric_examples",
    "data.max_new_tokens",
    "offload.",
)


class NonFiniteLoss(UserError):
    pass


class Preempted(Exception):
    def __init__(self, signame: str, step: int, checkpoint: str | None):
        super().__init__(f"{signame} at step {step}")
        self.signame, self.step, self.checkpoint = signame, step, checkpoint


# ---------------------------------------------------------------- fault injection (tests only)
def faults() -> dict[str, int]:
    """QLORA_RECIPES_FAULTS="oom_above_micro_batch=2,nan_at_step=3,sigterm_at_step=4" makes the
    run fail on purpose, so the guards are tested on CPU through the real entry point."""
    spec = os.environ.get("QLORA_RECIPES_FAULTS", "")
    return {k: int(v) for k, v in (item.split("=") for item in spec.split(",") if item)}


class GuardedTrainer(SFTTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TRL casts a quantized model's trainable adapter weights to bf16. We keep fp32 master
        # weights (what peft creates and what the planner counts): a bf16 master copy loses small
        # updates, and a resumed run, which reloads fp32 from the checkpoint, would diverge.
        for param in self.model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()

    def training_step(self, model, inputs, num_items_in_batch=None):
        injected = faults()
        if self.args.per_device_train_batch_size > injected.get("oom_above_micro_batch", 1 << 30):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by QLORA_RECIPES_FAULTS)")
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self.state.global_step + 1
        if injected.get("nan_at_step") == step:
            loss = loss * float("nan")
        if not torch.isfinite(loss).all():
            best = find_checkpoint(Path(self.args.output_dir))
            raise NonFiniteLoss(
                f"training loss became {loss.item()} at step {step}; the run stopped and kept its last good "
                f"checkpoint ({best or 'none yet'}); lower optim.lr, raise optim.warmup_ratio or use precision=bf16"
            )
        return loss

    def _save_checkpoint(self, model, trial):
        root = self.args.output_dir
        staging = os.path.join(root, STAGING)
        shutil.rmtree(staging, ignore_errors=True)
        self.args.output_dir = staging  # HF writes checkpoint-N here ...
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.output_dir = root
        if not self.args.should_save:
            return
        name = f"checkpoint-{self.state.global_step}"
        target = os.path.join(root, name)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)  # ... and it appears in one rename
        shutil.rmtree(staging, ignore_errors=True)
        if self.state.best_model_checkpoint:
            self.state.best_model_checkpoint = self.state.best_model_checkpoint.replace(staging, root)
        rotate_checkpoints(root, self.args.save_total_limit, self.state.best_model_checkpoint)


def find_checkpoint(checkpoints_dir: Path) -> str | None:
    """The newest complete checkpoint (staging dirs are never complete)."""
    if not checkpoints_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in checkpoints_dir.iterdir() if (m := CHECKPOINT.match(p.name)) and p.is_dir()]
    return str(max(found)[1]) if found else None


def _flatten(node, prefix="") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def stack_changes(saved: DictConfig, current: DictConfig) -> list[str]:
    """Keys whose change alters what is trained (micro-batch/accumulation may trade off when the
    effective batch is kept: the data position stays exact)."""
    a = _flatten(OmegaConf.to_container(saved, resolve=True))
    b = _flatten(OmegaConf.to_container(current, resolve=True))
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(RESUME_SAFE_PREFIXES)]
    batch_keys = {"trainer.micro_batch_size", "trainer.grad_accum"}
    same_effective = a.get("trainer.micro_batch_size", 0) * a.get("trainer.grad_accum", 0) == b.get(
        "trainer.micro_batch_size", 0
    ) * b.get("trainer.grad_accum", 0)
    return [k for k in changed if not (k in batch_keys and same_effective)]


def resume_checkpoint(cfg: DictConfig, run_dir: Path) -> str | None:
    """The checkpoint to resume from (None: start fresh), after checking it belongs to this stack."""
    r = cfg.resume
    if not r.auto and not r.checkpoint:
        return None
    if r.checkpoint:
        checkpoint = Path(r.checkpoint)
        if not CHECKPOINT.match(checkpoint.name) or not (checkpoint / "trainer_state.json").is_file():
            raise UserError(
                f"resume.checkpoint={checkpoint}: not a complete checkpoint dir (checkpoint-N with trainer_state.json)"
            )
        owner = checkpoint.parent.parent
    else:
        found = find_checkpoint(run_dir / "checkpoints")
        if found is None:
            log.warning("resume=auto: no complete checkpoint in %s; starting fresh", run_dir / "checkpoints")
            return None
        checkpoint, owner = Path(found), run_dir
    saved = owner / "config.yaml"
    if not saved.is_file():
        raise UserError(f"resume: {owner} has no config.yaml, so it is not a run dir of this repository")
    changed = stack_changes(OmegaConf.load(saved), cfg)
    if changed and not r.allow_changes:
        raise UserError(
            f"resume: this stack differs from the one that wrote {checkpoint} in {', '.join(changed)}; "
            "relaunch with the original values, or set resume.allow_changes=true"
        )
    return str(checkpoint)


# ---------------------------------------------------------------- preemption
class PreemptionCallback(TrainerCallback):
    """SIGTERM (preemption, SLURM time limit) or SIGINT (Ctrl-C): finish the current step, save a
    checkpoint there, stop. The caller turns that into a resume hint."""

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def on_step_end(self, args, state, control, **kwargs):
        if faults().get("sigterm_at_step") == state.global_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.received:
            control.should_save = True
            control.should_training_stop = True
        return control


# ---------------------------------------------------------------- OOM ladder
@dataclass
class OomRecord:
    attempts: list = field(default_factory=list)

    def write(self, run_dir: Path, cfg: DictConfig) -> None:
        t = cfg.trainer
        fit = {
            "trainer.micro_batch_size": t.micro_batch_size,
            "trainer.grad_accum": t.grad_accum,
            "trainer.gradient_checkpointing": t.gradient_checkpointing,
        }
        (run_dir / "oom.json").write_text(json.dumps({"attempts": self.attempts, "fit": fit}, indent=2) + "\n")


def next_in_process_rung(cfg: DictConfig) -> tuple[DictConfig, str] | None:
    """Halve the micro-batch (doubling accumulation keeps the effective batch), else turn on
    gradient checkpointing; None when neither is left."""
    cfg = cfg.copy()
    t = cfg.trainer
    if t.micro_batch_size > 1:
        t.micro_batch_size, t.grad_accum = t.micro_batch_size // 2, t.grad_accum * 2
        return cfg, f"trainer.micro_batch_size={t.micro_batch_size} trainer.grad_accum={t.grad_accum}"
    if not t.gradient_checkpointing:
        t.gradient_checkpointing = True
        return cfg, "trainer.gradient_checkpointing=true"
    return None


def train_with_oom_ladder(
    cfg: DictConfig, model, make_trainer, run_dir: Path, resume_from: str | None, relaunch_rungs: list[str]
):
    """Run make_trainer(cfg).train(); on out-of-memory apply the next in-process rung and go on
    from the newest checkpoint. Returns (trainer, result, cfg that fit)."""
    record = OomRecord()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    while True:
        trainer = make_trainer(cfg)
        try:
            result = trainer.train(resume_from_checkpoint=resume_from)
            if record.attempts:
                record.write(run_dir, cfg)
            return trainer, result, cfg
        except torch.OutOfMemoryError:
            step = trainer.state.global_step
            del trainer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rung = next_in_process_rung(cfg)
            record.attempts.append(
                {
                    "step": step,
                    "micro_batch_size": cfg.trainer.micro_batch_size,
                    "grad_accum": cfg.trainer.grad_accum,
                    "next": rung[1] if rung else None,
                }
            )
            record.write(run_dir, cfg)
            if rung is None:
                hint = "; ".join(relaunch_rungs) or "offload=cpu"
                raise UserError(
                    f"out of memory at step {step} even with micro-batch 1 and gradient checkpointing; "
                    f"relaunch with one of: {hint} (see plan.json ladder)"
                ) from None
            cfg, applied = rung
            log.warning("out of memory at step %d: retrying with %s", step, applied)
            resume_from = find_checkpoint(run_dir / "checkpoints")
            if resume_from is None:  # nothing saved yet: restart from the untrained adapter
                model.load_state_dict(initial, strict=False)
            if cfg.trainer.gradient_checkpointing and not model.is_gradient_checkpointing:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": cfg.trainer.checkpointing_mode == "reentrant"}
                )
                model.enable_input_require_grads()
