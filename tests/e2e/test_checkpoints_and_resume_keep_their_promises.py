"""Regression tests for what a run claims: the output head stays unquantized, the LR schedule across a
resume that changes the total, the best checkpoint across a resume, the OOM restart, resume that
never lies (already complete, data fingerprint, corrupt newest checkpoint, fsync), the run-dir lock
and a full disk during a save. Each goes through the real entry point on the tiny model."""

import errno
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import REPO, SMOKE, compose_cfg, sample_subset
from safetensors.torch import load_file
from transformers import Trainer

from qlora_recipes.errors import UserError
from qlora_recipes.model import hf_configs, loading
from qlora_recipes.run import resume
from qlora_recipes.run.checkpoints import RECORD, checkpoint_problem, find_checkpoint
from qlora_recipes.run.lifecycle import GuardedTrainer, Preempted
from qlora_recipes.run.lock import RunDirLock
from qlora_recipes.run.resume import AlreadyComplete, resume_checkpoint
from qlora_recipes.run.training import train

BASE = [
    *SMOKE,
    "trainer.logging_steps=1",
    "trainer.micro_batch_size=4",
    "trainer.grad_accum=1",
]


def state(checkpoint) -> dict:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def preempt(run_dir, monkeypatch, at: int, *overrides: str) -> None:
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", f"sigterm_at_step={at}")
    with pytest.raises(Preempted):
        train(compose_cfg(*BASE, *overrides), run_dir)
    monkeypatch.delenv("QLORA_RECIPES_FAULTS")


def copied(run_dir: Path, tmp_path: Path) -> Path:
    """A test's own copy of a module's run (mtimes kept), for a test that resumes or changes it."""
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


# ---------------------------------------------------------------- runs several tests read
@pytest.fixture(scope="module")
def module_data(tmp_path_factory) -> list[str]:
    """`small_data` for the module's shared runs (tests that change the data keep their own)."""
    return sample_subset(tmp_path_factory.mktemp("data"), "", 64, 8)


FINISHED = ["trainer.max_steps=4", "trainer.save_steps=2", "optim.scheduler=constant_with_warmup"]


class Finished(NamedTuple):
    run_dir: Path
    fs_events: list[tuple]  # ("fsync", path) and ("rename", src, dst), in the order the run made them


@pytest.fixture(scope="module")
def finished(module_data, tmp_path_factory) -> Finished:
    """FINISHED trained whole (checkpoints 2 and 4), every fsync and rename it made recorded."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst, *args, **kwargs)

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", fsync)
        patch.setattr(os, "replace", replace)
        train(compose_cfg(*BASE, *module_data, *FINISHED), run_dir)
    return Finished(run_dir, events)


STOPPED = ["trainer.max_steps=6", "trainer.save_steps=2"]


@pytest.fixture(scope="module")
def stopped_at_4(module_data, tmp_path_factory) -> Path:
    """STOPPED preempted by SIGTERM during step 4: checkpoints 2 and 4, no adapter yet."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    with pytest.MonkeyPatch.context() as patch:
        preempt(run_dir, patch, 4, *module_data, *STOPPED)
    return run_dir


# ---------------------------------------------------------------- 1. quant.skip_modules
def test_skip_modules_keep_the_output_head_unquantized(small_data, tmp_path):
    import bitsandbytes as bnb

    cfg = compose_cfg(
        *BASE, *small_data, "quant.skip_modules=[down_proj]", "trainer.max_steps=2", "trainer.save_steps=0"
    )
    assert {"down_proj", "lm_head"} <= set(
        hf_configs.bnb_config(cfg.quant, cfg.offload, cfg.model).llm_int8_skip_modules
    )
    default = compose_cfg(*BASE, *small_data)
    assert hf_configs.bnb_config(default.quant, default.offload, default.model).llm_int8_skip_modules is None
    model = loading.load_model(cfg, tmp_path)
    assert type(model.lm_head) is torch.nn.Linear
    mlp = model.model.layers[0].mlp
    assert type(mlp.down_proj) is torch.nn.Linear and isinstance(mlp.up_proj, bnb.nn.Linear4bit)
    del model
    # The reported failure: TRL's fused LM head crashed on a Linear4bit lm_head.
    assert train(cfg, tmp_path / "run")["steps"] == 2


# ---------------------------------------------------------------- 2. LR schedule across a resume
def test_a_resume_with_a_longer_total_continues_the_lr_schedule_without_going_back_up(
    stopped_at_4, module_data, tmp_path, monkeypatch
):
    from transformers.optimization import get_scheduler

    run_dir = copied(stopped_at_4, tmp_path)  # stopped at step 4 of 6
    m = train(compose_cfg(*BASE, *module_data, "trainer.max_steps=8", "trainer.save_steps=2", "resume=auto"), run_dir)
    assert m["steps"] == 8 and m["resumed_from"].endswith("checkpoint-4")

    final = run_dir / "checkpoints" / "checkpoint-8"
    logged = {e["step"]: e["learning_rate"] for e in state(final)["log_history"] if "learning_rate" in e}
    assert sorted(logged) == list(range(1, 9))
    # The documented policy (schedule.continue_schedule): the original schedule (cosine over 6 steps,
    # 1 warmup step) up to the resume step, then its rest stretched over the new remaining steps.
    lr = compose_cfg(*BASE, *module_data).optim.lr
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    original = get_scheduler("cosine", probe, num_warmup_steps=1, num_training_steps=6).lr_lambdas[0]
    for step in range(1, 9):  # step N runs at the LR the scheduler gives after N - 1 steps
        t = step - 1
        at = t if t <= 4 else 4 + (t - 4) * (6 - 4) / (8 - 4)
        assert math.isclose(logged[step], lr * original(at), rel_tol=1e-6, abs_tol=1e-12), (step, logged)
    assert logged[1] == 0.0 and logged[2] == lr  # the warmup step, then the peak
    assert all(logged[s] > logged[s + 1] > 0 for s in range(2, 8)), logged  # past warmup: down, never up
    assert json.loads((final / RECORD).read_text())["schedule"]["warps"] == [[4, 6, 8]]

    # The finished run resumed without more steps: already complete. More steps after a cosine
    # schedule has ended run at LR 0, and the run says so.
    with pytest.raises(AlreadyComplete):
        resume_checkpoint(compose_cfg(*BASE, *module_data, "trainer.max_steps=8", "resume=auto"), run_dir)
    caught = []
    monkeypatch.setattr(resume.log, "warning", lambda msg, *a: caught.append(msg % a))
    more = compose_cfg(*BASE, *module_data, "trainer.max_steps=10", "resume=auto")
    assert resume_checkpoint(more, run_dir).endswith("-8")
    assert any("learning rate is 0" in line for line in caught), caught


# ---------------------------------------------------------------- 3. best checkpoint across a resume
def test_the_best_checkpoint_survives_resume_and_rotation(small_data, tmp_path, monkeypatch):
    losses = {1: 2.0, 2: 1.0}  # best at step 2, worse after

    def scripted_evaluate(self, *args, **kwargs):
        return {"eval_loss": losses.get(self.state.global_step, 3.0)}

    monkeypatch.setattr(GuardedTrainer, "evaluate", scripted_evaluate)
    run_dir = tmp_path / "run"
    keys = ["trainer.max_steps=6", "trainer.save_steps=1", "trainer.eval_steps=1", "trainer.save_total_limit=2"]
    preempt(run_dir, monkeypatch, 2, *small_data, *keys)  # stops where the best checkpoint is the newest
    best = run_dir / "checkpoints" / "checkpoint-2"
    assert state(best)["best_model_checkpoint"] == str(best)  # the final path, not the staging dir's

    m = train(compose_cfg(*BASE, *small_data, *keys, "resume=auto"), run_dir)
    assert m["steps"] == 6
    assert checkpoints(run_dir) == ["checkpoint-2", "checkpoint-6"]  # newest 2 ... plus the best
    assert state(run_dir / "checkpoints" / "checkpoint-6")["best_model_checkpoint"] == str(best)


def test_save_total_limit_1_keeps_the_newest_checkpoint_beside_the_best(small_data, tmp_path, monkeypatch):
    losses = {1: 1.0}

    def scripted_evaluate(self, *args, **kwargs):
        return {"eval_loss": losses.get(self.state.global_step, 3.0)}

    monkeypatch.setattr(GuardedTrainer, "evaluate", scripted_evaluate)
    keys = ["trainer.max_steps=3", "trainer.save_steps=1", "trainer.eval_steps=1", "trainer.save_total_limit=1"]
    train(compose_cfg(*BASE, *small_data, *keys), tmp_path / "run")
    # transformers deletes all but the best at the end with limit 1; the newest must stay for resume.
    assert checkpoints(tmp_path / "run") == ["checkpoint-1", "checkpoint-3"]
    with pytest.raises(AlreadyComplete):
        resume_checkpoint(compose_cfg(*BASE, *small_data, *keys, "resume=auto"), tmp_path / "run")


# ---------------------------------------------------------------- 4. OOM restart
def test_an_oom_restart_before_any_checkpoint_resets_every_trainable_tensor(small_data, tmp_path, monkeypatch):
    keys = ["peft.modules_to_save=[lm_head]", "trainer.max_steps=4", "trainer.save_steps=0"]
    straight = train(
        compose_cfg(*BASE, *small_data, *keys, "trainer.micro_batch_size=2", "trainer.grad_accum=2"), tmp_path / "a"
    )

    # Micro-batch 4 runs steps 1-2 (step 1 is the warmup step at LR 0; at step 2 the adapters and the
    # lm_head copy move), then runs out of memory at step 3, before any checkpoint.
    real_step = GuardedTrainer.training_step

    def oom_at_step_3(self, *args, **kwargs):
        if self.args.per_device_train_batch_size > 2 and self.state.global_step + 1 == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected at step 3)")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(GuardedTrainer, "training_step", oom_at_step_3)
    retried = train(compose_cfg(*BASE, *small_data, *keys), tmp_path / "b")
    assert (retried["micro_batch_size"], retried["grad_accum"], retried["steps"]) == (2, 2, 4)
    assert json.loads((tmp_path / "b" / "oom.json").read_text())["attempts"][0]["step"] == 2

    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert any("lm_head" in k for k in a) and sorted(a) == sorted(b)
    for k in a:  # the restart is a fresh start: equal to a run with the fitted batch shape from step 0
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert retried["train_losses"] == pytest.approx(straight["train_losses"], abs=1e-5)


# ---------------------------------------------------------------- 5. resume that never lies
def test_resuming_a_finished_run_is_already_complete_and_changes_nothing(finished, module_data, tmp_path):
    run_dir = copied(finished.run_dir, tmp_path)
    first = json.loads((run_dir / "metrics.json").read_text())
    watched = [run_dir / "metrics.json", *sorted((run_dir / "adapter").iterdir())]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in watched}
    listing = checkpoints(run_dir)

    again = train(compose_cfg(*BASE, *module_data, *FINISHED, "resume=auto"), run_dir)
    assert again == first  # the finished run's metrics, not a new run's
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in watched} == before
    assert checkpoints(run_dir) == listing  # no extra step, no new checkpoint

    # The command line: exit 0 and one line saying so.
    proc = subprocess.run(
        [sys.executable, "train.py", *BASE, *module_data, *FINISHED, "resume=auto", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "already completed 4 steps" in proc.stdout + proc.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in watched} == before

    # More steps: it goes on from the last checkpoint (constant schedule: at the final LR).
    more = compose_cfg(*BASE, *module_data, *FINISHED, "trainer.max_steps=6", "resume=auto")
    assert resume_checkpoint(more, run_dir).endswith("checkpoint-4")


def test_a_run_stopped_at_its_last_step_finishes_without_an_extra_step(small_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    keys = ["trainer.max_steps=2", "trainer.save_steps=1"]
    preempt(run_dir, monkeypatch, 2, *small_data, *keys)  # SIGTERM during the last step: saved, no adapter yet
    last = run_dir / "checkpoints" / "checkpoint-2"
    m = train(compose_cfg(*BASE, *small_data, *keys, "resume=auto"), run_dir)
    assert m["steps"] == 2 and m["resumed_from"] == str(last) and len(m["train_losses"]) == 2
    assert checkpoints(run_dir) == ["checkpoint-1", "checkpoint-2"]  # transformers alone trains a step 3
    saved = load_file(str(last / "adapter_model.safetensors"))
    final = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(final) and all(torch.equal(saved[k], final[k]) for k in saved)


def test_resume_refuses_changed_data_under_the_same_path(small_data, tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"  # the `small_data` fixture's
    rows = data.read_text().splitlines()
    keys = ["trainer.max_steps=4", "trainer.save_steps=1"]
    run_dir = tmp_path / "run"
    preempt(run_dir, monkeypatch, 1, *small_data, *keys)
    assert resume_checkpoint(compose_cfg(*BASE, *small_data, *keys, "resume=auto"), run_dir).endswith("checkpoint-1")

    rows[0], rows[1] = rows[1], rows[0]  # same bytes, other order: the saved position means other rows
    data.write_text("\n".join(rows) + "\n")
    with pytest.raises(UserError, match=r"training data .*train\.jsonl changed since checkpoint-1.*allow_changes"):
        resume_checkpoint(compose_cfg(*BASE, *small_data, *keys, "resume=auto"), run_dir)
    accepted = compose_cfg(*BASE, *small_data, *keys, "resume=auto", "resume.allow_changes=true")
    assert resume_checkpoint(accepted, run_dir).endswith("checkpoint-1")


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(stopped_at_4, module_data, tmp_path, caplog):
    run_dir = copied(stopped_at_4, tmp_path)
    assert checkpoints(run_dir) == ["checkpoint-2", "checkpoint-4"]
    weights = run_dir / "checkpoints" / "checkpoint-4" / "adapter_model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-100:] = bytes(100)  # same size, other bytes: only the sha256 in the manifest tells
    weights.write_bytes(bytes(blob))
    assert "sha256" in checkpoint_problem(weights.parent, deep=True)

    with caplog.at_level(logging.WARNING, logger="qlora_recipes.run.resume"):
        m = train(compose_cfg(*BASE, *module_data, *STOPPED, "resume=auto"), run_dir)
    assert m["resumed_from"].endswith("checkpoint-2") and m["steps"] == 6
    # resume's own lines: other lines name the data, whose path (this test's tmp dir) says "corrupt" too
    lines = [
        r.getMessage() for r in caplog.records if r.name == "qlora_recipes.run.resume" and "corrupt" in r.getMessage()
    ]
    assert len(lines) == 1 and "checkpoint-4" in lines[0] and "falling back to checkpoint-2" in lines[0]
    assert checkpoint_problem(weights.parent, deep=True) is None  # step 4 was trained and saved again

    # Truncated: the cheap check (size) already skips it.
    (run_dir / "checkpoints" / "checkpoint-6" / "optimizer.pt").write_bytes(b"")
    assert find_checkpoint(run_dir / "checkpoints").endswith("checkpoint-4")


def test_checkpoint_files_are_fsynced_before_the_rename(finished):
    root, events = finished.run_dir / "checkpoints", finished.fs_events
    finals = [root / "checkpoint-2", root / "checkpoint-4"]
    renames = [next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(f)) for f in finals]
    for final, at, until in zip(finals, renames, [*renames[1:], len(events)], strict=True):
        staged = events[at][1]
        synced = {e[1] for e in events[:at] if e[0] == "fsync"}
        files = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
        assert RECORD in {str(f) for f in files}
        missing = [str(f) for f in files if os.path.join(staged, str(f)) not in synced]
        assert not missing, (final.name, missing)
        assert ("fsync", str(root)) in events[at:until], final.name  # the rename itself made durable


# ---------------------------------------------------------------- 6. run-dir lock
def test_a_busy_run_dir_is_refused_and_a_dead_owners_lock_taken_over(small_data, tmp_path, caplog):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from qlora_recipes.run.lock import RunDirLock\n"
            "RunDirLock(Path(sys.argv[1])).__enter__(); print('locked', flush=True); time.sleep(120)",
            str(run_dir),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = compose_cfg(*BASE, *small_data, "trainer.max_steps=1", "trainer.save_steps=0")
        with pytest.raises(UserError, match=rf"run dir .* is in use by process {holder.pid} on "):
            train(cfg, run_dir)
        assert sorted(p.name for p in run_dir.iterdir()) == ["run.lock"]  # the refused run wrote nothing
    finally:
        holder.kill()
        holder.wait()
    # Its owner died (SIGKILL: the lock file stays, naming a dead pid): the next run takes it over.
    assert str(holder.pid) in (run_dir / "run.lock").read_text()
    with caplog.at_level(logging.WARNING, logger="qlora_recipes.run.lock"):
        assert train(cfg, run_dir)["steps"] == 1
    assert any(f"left by process {holder.pid}, which is gone" in r.getMessage() for r in caplog.records)
    assert not (run_dir / "run.lock").exists()  # released at the end


def test_a_lock_file_naming_a_live_process_is_respected(small_data, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "run.lock").write_text(f"{sleeper.pid}\n")  # no flock held: the pid alone counts
        with pytest.raises(UserError, match=rf"in use by process {sleeper.pid}\b"):
            train(compose_cfg(*BASE, *small_data, "trainer.max_steps=1"), run_dir)
    finally:
        sleeper.kill()
        sleeper.wait()
    with RunDirLock(run_dir):  # now dead: taken over
        assert json.loads((run_dir / "run.lock").read_text())["pid"] == os.getpid()


# ---------------------------------------------------------------- 7. disk full during a save
def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(small_data, tmp_path, monkeypatch):
    real = Trainer._save_optimizer_and_scheduler

    def disk_full_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(output_dir, "optimizer.pt"))
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", disk_full_at_step_4)
    started = time.time()
    with pytest.raises(UserError, match=r"disk full while saving checkpoint-4 .*checkpoint-2\) is intact") as err:
        train(compose_cfg(*BASE, *small_data, "trainer.max_steps=6", "trainer.save_steps=2"), tmp_path)
    assert "\n" not in str(err.value)
    assert checkpoints(tmp_path) == ["checkpoint-2"]  # no checkpoint-4, no .partial
    assert checkpoint_problem(tmp_path / "checkpoints" / "checkpoint-2", deep=True) is None
    assert time.time() - started < 300
