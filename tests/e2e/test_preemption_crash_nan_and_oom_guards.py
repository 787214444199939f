"""Checkpoints, resume, preemption, NaN and OOM guards, memory timeline — through train()."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, SMOKE, compose_cfg
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Trainer

from qlora_recipes.errors import UserError
from qlora_recipes.run.checkpoints import RECORD, checkpoint_problem, find_checkpoint, newest_finite, nonfinite_values
from qlora_recipes.run.lifecycle import Preempted
from qlora_recipes.run.resume import resume_checkpoint
from qlora_recipes.run.training import train
from qlora_recipes.units import fmt_bytes

BASE = [
    *SMOKE,
    "trainer.max_steps=6",
    "trainer.save_steps=3",
    "trainer.logging_steps=1",
    "trainer.micro_batch_size=4",
    "trainer.grad_accum=1",
]


def step_losses(run_dir, step):
    state = json.loads((run_dir / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """BASE trained whole (checkpoints 3 and 6), its memory sampled every 2 steps (not part of the stack):
    the run a resumed one must match, the one whose memory timeline is read, and the finished run a
    resume checks its stack against. Tests only read it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(compose_cfg(*BASE, "trainer.memory_log_steps=2"), run_dir)
    return run_dir


def test_preempted_then_resumed_run_matches_an_uninterrupted_one(finished_run, tmp_path, monkeypatch):
    straight, interrupted = finished_run, tmp_path / "interrupted"
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "sigterm_at_step=4")  # SIGTERM lands during step 4
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*BASE), interrupted)
    assert stop.value.step == 4 and stop.value.checkpoint.endswith("checkpoint-4")
    assert json.loads((interrupted / "metrics.json").read_text())["status"] == "preempted"
    monkeypatch.delenv("QLORA_RECIPES_FAULTS")

    m = train(compose_cfg(*BASE, "resume=auto"), interrupted)
    assert m["resumed_from"].endswith("checkpoint-4") and m["steps"] == 6
    expected, got = step_losses(straight, 6), step_losses(interrupted, 6)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        assert abs(got[step] - expected[step]) <= 1e-5, (step, got[step], expected[step])


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    real = Trainer._save_optimizer_and_scheduler

    def crash_at_step_6(self, output_dir):
        if self.state.global_step == 6:
            raise RuntimeError("simulated crash mid-save")
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", crash_at_step_6)
    with pytest.raises(RuntimeError, match="mid-save"):
        train(compose_cfg(*BASE), tmp_path)
    assert find_checkpoint(tmp_path / "checkpoints").endswith("checkpoint-3")
    assert not (tmp_path / "checkpoints" / "checkpoint-6").exists()
    monkeypatch.undo()
    m = train(compose_cfg(*BASE, "resume=auto"), tmp_path)
    assert m["resumed_from"].endswith("checkpoint-3") and m["steps"] == 6


def test_a_full_disk_at_a_checkpoint_is_one_line_with_the_space_needed(tmp_path, monkeypatch):
    """torch.save on a full disk raises "[enforce fail at inline_container.cc] . unexpected pos" after
    "basic_ios::clear": that was a traceback. One line now names the dir and the space a checkpoint
    needs, and the previous checkpoint is intact."""
    real = Trainer._save_optimizer_and_scheduler

    def disk_full_at_step_6(self, output_dir):
        if self.state.global_step == 6:  # torch.save's errors on a full disk, as a user saw them
            try:
                raise RuntimeError("basic_ios::clear: iostream error")
            except RuntimeError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", disk_full_at_step_6)
    with pytest.raises(UserError) as stop:
        train(compose_cfg(*BASE), tmp_path)
    line, checkpoints = str(stop.value), tmp_path / "checkpoints"
    previous = checkpoints / "checkpoint-3"
    needed = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()) - (previous / RECORD).stat().st_size
    assert "\n" not in line and line.startswith(f"disk full while saving checkpoint-6 in {checkpoints} (")
    assert f"a checkpoint needs about {fmt_bytes(needed)}, " in line and f"checkpoint ({previous}) is intact" in line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-3"]
    assert checkpoint_problem(previous, deep=True) is None


def test_resume_refuses_a_different_stack(finished_run):
    more = [*BASE, "resume=auto", "trainer.max_steps=12"]  # more steps than the finished run's 6
    with pytest.raises(UserError, match=r"differs .* in peft\.r, quant\.method.*allow_changes"):
        resume_checkpoint(compose_cfg(*more, "peft.r=8", "quant=fp4"), finished_run)
    # The effective batch kept (4 x 1 == 2 x 2) and more steps: the same stack.
    same = compose_cfg(*more, "trainer.micro_batch_size=2", "trainer.grad_accum=2")
    assert resume_checkpoint(same, finished_run).endswith("checkpoint-6")
    allowed = compose_cfg(*more, "peft.r=8", "resume.allow_changes=true")
    assert resume_checkpoint(allowed, finished_run).endswith("checkpoint-6")


def test_resume_rejects_an_incomplete_checkpoint(tmp_path):
    partial = tmp_path / "checkpoint-7"
    partial.mkdir()
    with pytest.raises(UserError, match="not a complete checkpoint"):
        resume_checkpoint(compose_cfg(*BASE, f"resume.checkpoint={partial}"), tmp_path)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "nan_at_step=5")
    with pytest.raises(UserError, match=r"became nan at step 5.*checkpoint-3"):
        train(compose_cfg(*BASE), tmp_path)
    assert find_checkpoint(tmp_path / "checkpoints").endswith("checkpoint-3")
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize(("nan_at", "steps"), [(2, "2-3"), (6, "5-6")])
def test_a_nan_loss_between_logged_steps_stops_the_run_where_it_is_logged(tmp_path, monkeypatch, nan_at, steps):
    """The loss is checked where the trainer fetches it for its log, with no device sync of its own each
    micro-batch: a NaN at step 2 with a loss logged at steps 1, 3 and 6 stops the run at step 3; one at
    step 6 with a loss logged at steps 1 and 4 stops it at the end. Each names the steps it came in."""
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", f"nan_at_step={nan_at}")
    logging = 3 if nan_at == 2 else 4
    cfg = compose_cfg(*BASE, f"trainer.logging_steps={logging}", "trainer.save_steps=0")
    with pytest.raises(UserError, match=rf"training loss became nan in steps {steps} \(.*trainer\.logging_steps\)"):
        train(cfg, tmp_path)
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "adapter").exists()


def test_a_nan_update_is_never_kept_as_a_checkpoint(tmp_path, monkeypatch):
    """A NaN gradient at step 4 (the loss still finite) made NaN weights, saved as checkpoint-4 and
    then kept as "the last good checkpoint" when the loss showed NaN at step 5. The weights are
    checked before each save: the run stops at step 4 keeping checkpoint-3, with advice that fits."""
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "nan_grads_at_step=4")
    cfg = compose_cfg(*BASE, "trainer.save_steps=1")
    with pytest.raises(UserError) as stop:
        train(cfg, tmp_path)
    line = str(stop.value)
    assert re.search(r"NaN/Inf at step 4, so checkpoint-4 was not saved; .*checkpoint-3; its values are finite", line)
    assert f"lower optim.lr (now {cfg.optim.lr:g})" in line and f"precision={cfg.precision.name}" not in line, line
    kept = tmp_path / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert nonfinite_values(kept / "checkpoint-3") is None

    # A poisoned checkpoint on disk (saved before the weights were checked) is passed over and removed.
    adapter = kept / "checkpoint-3" / "adapter_model.safetensors"
    with safe_open(adapter, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(adapter)
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, adapter, metadata=metadata)
    found, removed = newest_finite(kept)
    assert found.endswith("checkpoint-2") and removed == [
        f"checkpoint-3 (adapter_model.safetensors: {name} holds NaN/Inf)"
    ]
    assert not (kept / "checkpoint-3").exists()


def test_oom_halves_the_micro_batch_and_keeps_the_effective_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "oom_above_micro_batch=1")  # only micro-batch 1 "fits"
    m = train(compose_cfg(*BASE, "trainer.max_steps=2"), tmp_path)  # 2 steps of 4 micro-batches show the fit
    assert (m["micro_batch_size"], m["grad_accum"], m["steps"]) == (1, 4, 2)
    record = json.loads((tmp_path / "oom.json").read_text())
    assert [a["next"] for a in record["attempts"]] == [
        "trainer.micro_batch_size=2 trainer.grad_accum=2",
        "trainer.micro_batch_size=1 trainer.grad_accum=4",
    ]
    assert record["fit"]["trainer.micro_batch_size"] == 1


def test_oom_turns_on_checkpointing_then_stops_with_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("QLORA_RECIPES_FAULTS", "oom_above_micro_batch=0")  # nothing fits
    with pytest.raises(UserError, match="out of memory at step 0 even with micro-batch 1 and gradient checkpointing"):
        train(compose_cfg(*BASE, "trainer.micro_batch_size=2", "trainer.gradient_checkpointing=false"), tmp_path)
    record = json.loads((tmp_path / "oom.json").read_text())
    assert [a["next"] for a in record["attempts"]] == [
        "trainer.micro_batch_size=1 trainer.grad_accum=2",
        "trainer.gradient_checkpointing=true",
        None,
    ]


def test_memory_timeline_is_written(finished_run):
    rows = [json.loads(line) for line in (finished_run / "memory.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 6] and all(r["peak_gib"] > 0 for r in rows)
    assert (finished_run / "memory.png").stat().st_size > 1000


def test_sigterm_from_outside_prints_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QLORA_RECIPES_FAULTS": "sigterm_at_step=2"}
    proc = subprocess.run(
        [sys.executable, "train.py", *BASE, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 143, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("stopped by SIGTERM at step 2")]
    assert line and f"resume=auto hydra.run.dir={run_dir}" in line[0]
    assert find_checkpoint(run_dir / "checkpoints").endswith("checkpoint-2")


def test_sigterm_in_the_final_evaluation_keeps_the_adapter_and_says_how_to_finish(tmp_path):
    """A SIGTERM while the final evaluation ran used to end the process at once: no line, no adapter,
    run.lock left. The adapter is saved before the evaluation; the signal is one line, exit 143."""
    run_dir = tmp_path / "run"
    overrides = [*SMOKE, "trainer.save_steps=3"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "QLORA_RECIPES_FAULTS": "eval_wait_s=300"}  # the eval lasts
    child = subprocess.Popen(
        [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in child.stdout:  # the marker: the final evaluation has started
        seen.append(line)
        if line.startswith("final evaluation: 64 eval rows in 4 batches of 16"):
            child.send_signal(signal.SIGTERM)
            break
    rest, _ = child.communicate(timeout=120)
    lines = (("".join(seen) + rest).strip()).splitlines()
    assert child.returncode == 143, lines[-20:]
    assert lines[-1] == (
        f"stopped by SIGTERM during the final evaluation, after step 3; kept the adapter ({run_dir / 'adapter'}) "
        f"and checkpoint {run_dir / 'checkpoints' / 'checkpoint-3'}; to evaluate and finish: python train.py "
        f"{' '.join(overrides)} resume=auto hydra.run.dir={run_dir}"
    ), lines[-5:]
    assert "Traceback" not in "".join(lines)
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() and not (run_dir / "run.lock").exists()
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "preempted"

    finished = train(compose_cfg(*overrides, "resume=auto"), run_dir)  # the command the line gives
    assert finished["status"] == "ok" and finished["steps"] == 3 and finished["eval_loss"] > 0
