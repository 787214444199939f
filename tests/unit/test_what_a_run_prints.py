"""What a run prints: the run dir first, a short summary table and the next
commands at the end, a launcher that cannot start as one line, and no warnings our calls cause."""

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from conftest import REPO, compose_cfg
from rich.console import Console

from qlora_recipes import console
from qlora_recipes.model import loading
from qlora_recipes.run import trainer_args

METRICS = {  # the shape of a metrics.json, figures at full precision
    "status": "ok",
    "train_loss_first": 2.5231690406799316,
    "train_loss_last": 1.5259147882461548,
    "steps": 3,
    "tokens_per_s": 3.1866861511901634,
    "train_s": 34.518617391586304,
    "eval_loss": 2.748622179031372,
    "eval_perplexity": 15.621093979069535,
    "eval_exact_match_before": 0.09375,
    "eval_exact_match": 0.953125,
    "wall_s": 114.32183122634888,
    "peak_quantity": "process RSS",
    "peak_mem_gib": 0.6716232299804688,
    "planned_peak_gib": 0.629,
    "plan_ratio": 1.0677634816859598,
}


def test_the_summary_is_a_short_table_not_a_dict_of_full_precision_floats(capsys, tmp_path):
    console.print_summary(METRICS, tmp_path / "run", [("merge", "python scripts/merge.py RUN")])
    text = capsys.readouterr().out
    assert "2.523 -> 1.526  (3 steps)" in text
    assert "eval loss    2.749  (perplexity 15.62)" in text
    assert "exact match  0.0938 -> 0.953" in text
    assert "0.629 GiB planned, 0.672 GiB measured  (process RSS, measured/planned 1.07)" in text
    assert "1m54s  (training 35s)" in text
    assert "{" not in text and not re.search(r"\d\.\d{6,}", text)  # no raw dict, no 16-digit floats


def test_the_next_commands_name_the_real_run_dir_shell_quoted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "my run"
    overrides = ["data.path=my data.jsonl", "trainer=smoke", "trainer.max_steps=3"]
    commands = dict(console.next_commands("python train.py", run_dir, overrides, steps=3))
    assert commands["merge"] == "python scripts/merge.py 'runs/my run'"
    assert commands["generate"] == "python scripts/generate.py 'runs/my run' 'YOUR PROMPT'"
    resume = shlex.split(commands["resume"])  # what the shell will hand to train.py
    assert resume == [
        "python",
        "train.py",
        "data.path=my data.jsonl",
        "trainer=smoke",
        "resume=auto",
        "hydra.run.dir=runs/my run",
        "trainer.max_steps=6",  # the run is finished: resuming it means a larger total
    ]
    qlora = dict(console.next_commands("qlora train", run_dir, [], steps=3))
    assert qlora["merge"] == "qlora merge 'runs/my run'"


def test_a_run_that_kept_no_checkpoint_prints_no_resume_line_but_a_new_run_from_its_adapter(tmp_path, monkeypatch):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "rün; (1),a=b"
    overrides = ["trainer=smoke", "overwrite=true", f"hydra.run.dir={run_dir}"]
    commands = dict(console.next_commands("python train.py", run_dir, overrides, steps=3, checkpoint=False))
    assert "resume" not in commands
    words = shlex.split(commands["train on"])
    assert words[:3] == ["python", "train.py", "trainer=smoke"]  # no overwrite, no run dir: a new run
    override = OverridesParser.create().parse_override(words[3])
    assert (override.key_or_group, override.value()) == ("init_from", "runs/rün; (1),a=b")


ODD_DIRS = ["rün;(1),a=b", "it's here", "back\\slash'", "null", "-dash"]


@pytest.mark.parametrize("name", ODD_DIRS)
def test_the_resume_line_reads_back_as_the_same_run_dir_through_the_shell_and_hydra(name, tmp_path, monkeypatch):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    monkeypatch.chdir(tmp_path)
    commands = dict(console.next_commands("qlora train", tmp_path / name, ["overwrite=true", "peft.r=4"], steps=1))
    words = shlex.split(commands["resume"])
    assert words[2:4] == ["peft.r=4", "resume=auto"]  # overwrite=true is not carried into a resume
    override = OverridesParser.create().parse_override(words[4])
    assert (override.key_or_group, override.value()) == ("hydra.run.dir", name)
    for kind in ("merge", "generate"):
        assert Path(shlex.split(commands[kind])[2]).resolve() == (tmp_path / name).resolve()


def _tree_text(cfg, choices) -> str:
    out = Console(width=200, record=True, file=open(os.devnull, "w"))
    out.print(console.stack_tree(cfg, choices))
    return out.export_text()


def test_the_stack_tree_names_the_users_data_file_not_the_sample_option(tmp_path):
    own = tmp_path / "my.jsonl"
    text = _tree_text(compose_cfg(f"data.path={own}"), {"data": "order", "model": "tiny"})
    assert f"data = {own}" in text and "data = order" not in text
    assert "data = order" in _tree_text(compose_cfg(), {"data": "order"})  # the sample keeps its name


@pytest.mark.skipif(shutil.which("srun") is not None, reason="a SLURM cluster is here: the launcher starts")
def test_a_slurm_launcher_without_slurm_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=slurm", "trainer=smoke"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: hydra/launcher=slurm submits jobs to a SLURM cluster")
    assert "hydra/launcher=local" in proc.stderr  # what to do instead


# ---------------------------------------------------------------------- no warnings we can avoid
def test_sft_config_uses_the_transformers_5_checkpointing_names(tmp_path):
    cfg = compose_cfg("trainer=smoke")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # `gradient_checkpointing` is deprecated ...
        args = trainer_args.sft_config(cfg, tmp_path, "prompt_completion", on_gpu=False, has_eval=True)
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_making_the_model_trainable_warns_nothing_and_still_checkpoints(tmp_path):
    cfg = compose_cfg("trainer=smoke")
    model = loading.load_model(cfg, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = loading.make_trainable(cfg, model)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert model.base_model.model.is_activation_checkpointing  # what the deprecated calls did, done


def test_a_paged_optimizer_on_cpu_is_one_line_of_ours_and_no_library_warning(caplog):
    cfg = compose_cfg("optim=paged8bit")
    param = torch.nn.Parameter(torch.randn(4096))  # large enough for bitsandbytes' 8-bit state
    param.grad = torch.randn(4096)
    with warnings.catch_warnings(record=True) as caught:  # restores the filters afterwards
        warnings.simplefilter("always")
        with caplog.at_level(logging.INFO, logger="train"):
            trainer_args.note_optimizer_fallback(cfg.optim, on_gpu=False)
        bnb.optim.PagedAdamW8bit([param], lr=1e-3).step()
        other = [str(w.message) for w in caught]
    assert not any("Paged optimizers" in m for m in other)
    notes = [r.getMessage() for r in caplog.records if "unpaged" in r.getMessage()]
    assert notes == ["optim: paged_adamw_8bit runs unpaged on this CPU (paging needs CUDA; the updates are the same)"]
