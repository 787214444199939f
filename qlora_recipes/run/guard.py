"""The guard every objective's TRL trainer wears: `Guarded`, a mixin over whichever TRL trainer follows
it in a class's bases (run/guarded_sft.py, guarded_dpo.py, guarded_kto.py, guarded_grpo.py; lifecycle.guarded
picks the objective's and imports it alone). Its changes: each checkpoint is written into a staging dir, sealed
(its files fsynced and listed with size and sha256 in `qlora_state.json`, beside the LR schedule, the data and
base fingerprints and the step totals) and renamed into place only when complete: a crash, `kill -9` or a full
disk mid-save leaves the previous checkpoint loadable and no staging dir. It records the best checkpoint by its
final path, so rotation keeps protecting it after a resume. A non-finite loss stops the run where it is logged
(the step it appears at trainer.logging_steps=1; a weight or optimizer state gone NaN is never saved). A resumed
run whose total steps changed continues its LR schedule by the policy of `continue_schedule`.

No TRL trainer is imported here: each is a module of its own (about 0.1 s of CPU each), and a run uses one.
"""

import json
import logging
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
from transformers.trainer_utils import rotate_checkpoints

from ..errors import UserError
from ..units import fmt_bytes
from .checkpoints import (
    RECORD,
    STAGING,
    disk_full,
    find_checkpoint,
    first_nonfinite,
    free_bytes,
    fsync_dir,
    newest_finite,
    recorded_bytes,
    sync_file,
    tensors_in,
    trainer_state,
)
from .dist import zero_adapter_state
from .preemption import faults
from .schedule import continue_schedule, scheduler_for

log = logging.getLogger(__name__)


class NonFiniteLoss(UserError):
    pass


class Guarded:
    """The guards, over whichever TRL trainer follows it in the class's bases (every method calls super())."""

    def __init__(self, *args, **kwargs):
        trainable = dict(_trainable(kwargs["model"])) if kwargs.get("model") is not None else {}
        # their values on the host where TRL's bf16 cast would round them (bf16 ones it leaves as they are):
        # an earlier stage's adapter (init_from) exactly, and no host copy of bf16 adapters
        kept = {n: p.detach().to("cpu", copy=True) for n, p in trainable.items() if p.dtype != torch.bfloat16}
        dtypes = {n: p.dtype for n, p in trainable.items()}
        super().__init__(*args, **kwargs)
        # TRL casts a quantized model's trainable adapter weights to bf16. We keep them in
        # peft.adapter_dtype as resolved (what the planner counts): fp32 ones stay master weights that keep
        # small updates, and a resumed run, which reloads the checkpoint's dtype, does not diverge. The
        # values come back as they were, not rounded through bf16.
        for name, param in self.model.named_parameters():
            if name in kept and param.dtype != kept[name].dtype:
                param.data = kept[name].to(param.device)
        self._adapter_dtypes = dtypes  # what the saved adapter holds
        self.data_fingerprint: dict | None = None  # recorded in each checkpoint (train_with_oom_ladder)
        self.base_fingerprint: dict | None = None  # likewise: the base weights
        self._resumed_from: str | None = None
        self._steps_per_epoch: int | None = None
        self._schedule: dict | None = None
        self._eval_wait_s = 0  # faults(): eval_wait_s
        self._logged_step: int | None = None  # the last step whose loss was logged (and so checked)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._resumed_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        if self._resumed_from is not None and self._no_step_left(self._resumed_from):
            return self._finish_from(self._resumed_from)
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        if not math.isfinite(result.training_loss):  # steps after the last logged one
            raise self._nonfinite_stop(f"training loss became {result.training_loss} {self._unlogged_steps()}")
        bad = self._nonfinite_values()
        if bad:  # the last update was NaN and no checkpoint save saw it (trainer.save_steps=0)
            raise self._nonfinite_stop(
                f"training made {bad} NaN/Inf by step {self.state.global_step}; no adapter was saved"
            )
        return result

    def _no_step_left(self, checkpoint: str) -> bool:
        """Whether the checkpoint is at (or past) the run's total; transformers would train one
        more step from there (it checks the total only after a step)."""
        total = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
        return int(trainer_state(checkpoint).get("global_step", 0)) >= total

    def _finish_from(self, checkpoint: str):
        """No step to train: the checkpoint's weights and state, as a train() that ran 0 steps."""
        from transformers.trainer_callback import TrainerState
        from transformers.trainer_utils import TrainOutput

        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        log.warning(
            "resume: %s is at step %d, the run's total: no step left to train; finishing from it",
            Path(checkpoint).name,
            self.state.global_step,
        )
        losses = [e["loss"] for e in self.state.log_history if "loss" in e]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else 0.0, {})

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._keep_adapter_dtypes()

    def _keep_adapter_dtypes(self) -> None:
        """peft's load_adapter, which transformers' resume calls, upcasts bf16 adapters to fp32: a resumed run
        would go on computing in another dtype than the run it continues. Cast back to the dtype the run
        trains in; bf16 -> fp32 -> bf16 is exact, so the checkpoint's values are kept bit for bit."""
        for name, param in self.model.named_parameters():
            dtype = self._adapter_dtypes.get(name)
            if dtype is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        self._steps_per_epoch = values[1]  # optimizer steps per epoch: turns trainer.epochs into steps
        return values

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self._schedule = continue_schedule(self._resumed_from, self.args, num_training_steps)
            # the total changed on resume (the continued schedule), or a warmup that would train nothing dropped
            own = scheduler_for(self._schedule, self.args, optimizer or self.optimizer, self._resumed_from is not None)
            if own is not None:
                self.lr_scheduler = own
                self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        injected = faults()
        if self.args.per_device_train_batch_size > injected.get("oom_above_micro_batch", 1 << 30):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by QLORA_RECIPES_FAULTS)")
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self.state.global_step + 1
        if injected.get("nan_at_step") == step:
            loss = loss * float("nan")
        if injected.get("nan_grads_at_step") == step:  # a finite loss whose update is NaN (backward overflowed)
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.fill_(float("nan"))
        return loss  # checked where the trainer fetches it anyway: at logging (log) and at the end (train)

    def log(self, logs, *args, **kwargs):
        # The logged loss is the window's sum fetched once (a NaN in any micro-batch of it shows): a
        # check here costs no device sync of its own, where one per micro-batch stalled every step.
        loss = logs.get("loss")
        if loss is not None and not math.isfinite(loss):
            raise self._nonfinite_stop(f"training loss became {loss} {self._unlogged_steps()}")
        if loss is not None:
            self._logged_step = self.state.global_step
        return super().log(logs, *args, **kwargs)

    def _unlogged_steps(self) -> str:
        """Where a non-finite loss appeared: its step, or the steps since the last logged one."""
        first = max(self._logged_step or 0, getattr(self, "_initial_global_step", 0)) + 1
        last = self.state.global_step
        if first >= last:
            return f"at step {last}"
        return f"in steps {first}-{last} (a loss is checked where it is logged, every trainer.logging_steps)"

    def _optimizer_state(self) -> list:
        return list(getattr(self.optimizer, "state", {}).values()) if self.optimizer is not None else []

    def _nonfinite_values(self) -> str | None:
        """The first trainable weight or optimizer-state tensor holding NaN or Inf, or None. Ranks
        agree (each checks its own shard): one that stops alone would leave the others waiting."""
        weights = ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)
        found = first_nonfinite(weights) or first_nonfinite(tensors_in(self._optimizer_state(), "optimizer state."))
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return found
        flag = torch.tensor([1.0 if found else 0.0], device=self.args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return found or ("a trainable tensor of another rank" if flag.item() else None)

    def _nonfinite_stop(self, what: str) -> "NonFiniteLoss":
        """The stop: the newest checkpoint whose values are finite is kept, newer ones that are not are
        removed, and the advice fits this stack (its learning rate, warmup and precision)."""
        kept, removed = newest_finite(Path(self.args.output_dir), remove=self.args.should_save)
        gone = f"; removed {', '.join(removed)}" if removed else ""
        args = self.args
        tips = [f"lower optim.lr (now {args.learning_rate:g})"]
        if not args.warmup_steps:
            tips.append("add warmup (optim.warmup_ratio=0.03)")
        if args.fp16:  # fp16 overflows where bf16, with fp32's range, does not
            tips.append("use precision=bf16 where the GPU has it")
        return NonFiniteLoss(
            f"{what}; the run stopped and kept its last good checkpoint ({kept or 'none yet'}; its values are "
            f"finite{gone}); {', '.join(tips[:-1]) + ' or ' if len(tips) > 1 else ''}{tips[-1]}"
        )

    def evaluate(self, *args, **kwargs):
        self._eval_wait_s = faults().get("eval_wait_s", 0)
        return super().evaluate(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        if self._eval_wait_s:  # tests: an evaluation that lasts, for a signal to land in
            time.sleep(self._eval_wait_s)
            self._eval_wait_s = 0
        return super().prediction_step(*args, **kwargs)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # With save_total_limit=1 and a best checkpoint, transformers deletes every other checkpoint
        # at the end, the newest too: a resume would then redo the steps after the best. We keep the
        # newest plus the best, as rotation does during the run.
        limit = self.args.save_total_limit
        if limit == 1:
            self.args.save_total_limit = 2
        try:
            return super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self.args.save_total_limit = limit

    def save_model(self, output_dir=None, _internal_call=False):
        # DeepSpeed's own save is its bf16 compute copy in bf16 mode: the adapter is saved from the
        # fp32 master in peft.adapter_dtype instead, as every other strategy saves it
        state = zero_adapter_state(self, self._adapter_dtypes) if self.is_deepspeed_enabled else None
        if state is None:
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)

    def _save_checkpoint(self, model, trial):
        root = self.args.output_dir
        staging = os.path.join(root, STAGING)
        name = f"checkpoint-{self.state.global_step}"
        bad = self._nonfinite_values()
        if bad:  # a NaN update shows in the weights a step before the loss: never saved as a checkpoint
            raise self._nonfinite_stop(
                f"training made {bad} NaN/Inf at step {self.state.global_step}, so {name} was not saved"
            )
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()  # ranks: none writes into staging before it is cleared
        self.args.output_dir = staging  # HF writes checkpoint-N here ...
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every rank's files (shards, rng_state_R) are in
            self._final_best_path(staging, root)
            if self.args.should_save:
                self._seal(Path(staging) / name)
        except BaseException as err:
            self.args.output_dir = root
            self._final_best_path(staging, root)
            shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays behind
            if disk_full(err):
                raise UserError(self._disk_full_line(name, root)) from None
            raise
        finally:
            self.args.output_dir = root
        if not self.args.should_save:
            return
        target = os.path.join(root, name)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staging, name), target)  # ... and it appears in one rename
        fsync_dir(root)
        shutil.rmtree(staging, ignore_errors=True)
        rotate_checkpoints(root, self.args.save_total_limit, self.state.best_model_checkpoint)

    def _disk_full_line(self, name: str, root: str) -> str:
        """What a checkpoint needs (the previous one's size; without one, the trainable weights and
        optimizer state it would hold) against what is free, and what was kept."""
        previous = find_checkpoint(Path(root))
        needed = recorded_bytes(previous)
        if needed is None:
            weights = [p for p in self.model.parameters() if p.requires_grad]
            tensors = weights + [t for _, t in tensors_in(self._optimizer_state()) if torch.is_tensor(t)]
            needed = sum(t.numel() * t.element_size() for t in tensors)
        free = free_bytes(root)
        space = f"a checkpoint needs about {fmt_bytes(needed)}" + (
            f", {fmt_bytes(free)} free" if free is not None else ""
        )
        return (
            f"disk full while saving {name} in {root} ({space}): nothing of it was kept and the previous checkpoint "
            f"({previous or 'none yet'}) is intact; free space (or lower trainer.save_total_limit) and relaunch "
            "with resume=auto"
        )

    def _final_best_path(self, staging: str, root: str) -> None:
        """HF records the best checkpoint where it wrote it (the staging dir); it lives in root."""
        best = self.state.best_model_checkpoint
        if best and os.path.dirname(os.path.normpath(best)) == os.path.normpath(staging):
            self.state.best_model_checkpoint = os.path.join(root, os.path.basename(os.path.normpath(best)))

    def _seal(self, folder: Path) -> None:
        """Before the rename: trainer_state.json again (it names the best checkpoint by its final
        path), every file fsynced and listed with its size and sha256 in RECORD, itself fsynced."""
        self.state.save_to_json(str(folder / "trainer_state.json"))
        files = {str(f.relative_to(folder)): sync_file(f) for f in sorted(folder.rglob("*")) if f.is_file()}
        record = {
            "step": self.state.global_step,
            "max_steps": self.args.max_steps,
            "epochs": self.args.num_train_epochs,
            "total_steps": self.state.max_steps,
            "steps_per_epoch": self._steps_per_epoch,
            "world_size": self.args.world_size,  # ranks: a resume on another number would change the global batch
            "schedule": self._schedule,
            "data": self.data_fingerprint,
            "base": self.base_fingerprint,
            "files": files,
        }
        with open(folder / RECORD, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for sub in sorted({f.parent for f in folder.rglob("*")} | {folder}, reverse=True):
            fsync_dir(sub)


def _trainable(model):
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point())


def quiet_checkpointing_toggles() -> None:
    """TRL's reference forward turns checkpointing off and on by transformers 5's deprecated names
    (trl.models.utils.disable_gradient_checkpointing): a warning per step that says nothing to a user."""
    warnings.filterwarnings(
        "ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning
    )


def drop_ref_adapter(model) -> None:
    if model is not None and "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
