"""`qlora eval` and `qlora export` answer bad input with one `error:` line and exit 2, before any
model loads and with nothing written; `qlora plan` notes what vLLM will not serve."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from qlora_recipes.cli import main as qlora


def _one_line(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        qlora(list(argv))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def fake_run(folder: Path, **adapter) -> Path:
    """A run dir as resolve_dir sees one (config.yaml, adapter config and weights present)."""
    (folder / "adapter").mkdir(parents=True)
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, **adapter}))
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_eval_of_a_dir_that_does_not_exist_names_it(tmp_path, capsys):
    line = _one_line(capsys, "eval", str(tmp_path / "nope"), "--tasks", "order_choice")
    assert "nope: no such directory" in line


def test_eval_without_lm_eval_installed_says_what_to_install(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    line = _one_line(capsys, "eval", str(fake_run(tmp_path / "run")), "--tasks", "order_choice")
    assert "lm-evaluation-harness, which is not installed: pip install lm-eval==0.4.13" in line


def test_eval_of_an_unknown_task_names_it_and_the_include_path(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run")
    line = _one_line(capsys, "eval", str(run_dir), "--tasks", "no_such_task_here")
    assert "--tasks: no_such_task_here: no such lm-eval task" in line and "--include-path" in line
    assert not (run_dir / "eval.json").exists()


def test_eval_with_a_missing_include_path_or_bad_limit_is_one_line(tmp_path, capsys):
    run_dir = str(fake_run(tmp_path / "run"))
    assert "no such directory" in _one_line(capsys, "eval", run_dir, "--tasks", "x", "--include-path", "/nope")
    assert "--limit 0" in _one_line(capsys, "eval", run_dir, "--tasks", "x", "--limit", "0")


def test_export_needs_a_target_and_a_known_quant(tmp_path, capsys, monkeypatch):
    run_dir = str(fake_run(tmp_path / "run"))
    assert "--to gguf or --to vllm" in _one_line(capsys, "export", run_dir)
    assert "invalid choice" in _one_line(capsys, "export", run_dir, "--to", "onnx")
    monkeypatch.setenv("QLORA_CONVERTER_DIR", str(tmp_path / "converter"))
    assert "--quant q4: use one of f16, bf16, q8_0" in _one_line(
        capsys, "export", run_dir, "--to", "gguf", "--quant", "q4"
    )


def test_export_to_gguf_without_the_converter_says_how_to_fetch_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QLORA_CONVERTER_DIR", str(tmp_path / "converter"))
    run_dir = fake_run(tmp_path / "run")
    line = _one_line(capsys, "export", str(run_dir), "--to", "gguf")
    assert "converter is not fetched yet" in line and "qlora export --fetch-converter" in line
    assert sorted(p.name for p in run_dir.iterdir()) == ["adapter", "config.yaml"]  # nothing written


def test_a_converter_archive_with_another_sha256_is_refused_and_nothing_kept(tmp_path, monkeypatch):
    from qlora_recipes.errors import UserError
    from qlora_recipes.export.converter import fetch_converter

    monkeypatch.setenv("QLORA_CONVERTER_DIR", str(tmp_path / "converter"))
    fake = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    fake.write_bytes(b"not the release")
    with pytest.raises(UserError, match="is not the pinned 832db069"):
        fetch_converter(progress=lambda _: None, sdist=fake)
    assert not (tmp_path / "converter").exists()


def test_export_to_vllm_refuses_an_adapter_with_modules_to_save_in_one_line(tmp_path, capsys):
    run_dir = fake_run(tmp_path / "run", modules_to_save=["lm_head"])
    line = _one_line(capsys, "export", str(run_dir), "--to", "vllm")
    assert "peft.modules_to_save=['lm_head']" in line and "leave peft.modules_to_save unset" in line


def test_plan_notes_that_vllm_cannot_load_modules_to_save(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "plan", "peft.modules_to_save=[lm_head]", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    notes = [ln for ln in proc.stdout.splitlines() if ln.startswith("note: ") and "vLLM" in ln]
    assert len(notes) == 1 and "modules_to_save=['lm_head']" in notes[0], proc.stdout
    assert notes[0][len("note: ") :] in json.loads((tmp_path / "plan.json").read_text())["notes"]
