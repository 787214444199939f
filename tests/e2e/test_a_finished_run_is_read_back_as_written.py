"""What a finished run wrote is read back as written, or named in one line: merge and generate check the
run dir's files against the manifest the run recorded, a config.yaml cut short is never filled with
defaults, a merged dir's weights and report are checked, merges into one output take a lock, a full disk
during a merge is one line, and no load ever runs (or asks to run) a model dir's own code.

One fp4 run of the tiny model, trained on a copy of it that ships its own code (an auto_map to a module
that would leave a marker file when imported), and one merge of it, are shared by the whole module.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, train_smoke

from qlora_recipes.errors import UserError

PROMPTED = "Do you wish to run the custom code"


@pytest.fixture(scope="module")
def own_code_model(tmp_path_factory) -> tuple[Path, Path]:
    """(a copy of the tiny model whose config and tokenizer config name its own module, the marker
    file that module writes when anything imports it)."""
    root = tmp_path_factory.mktemp("own-code")
    model, marker = root / "tiny-own-code", root / "own-code-ran"
    shutil.copytree(REPO / "assets/tiny-llama", model)
    (model / "own_code.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class OwnConfig(LlamaConfig):\n    pass\n"
        "class OwnModel(LlamaForCausalLM):\n    config_class = OwnConfig\n"
        "class OwnTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    for name, auto_map in (
        ("config.json", {"AutoConfig": "own_code.OwnConfig", "AutoModelForCausalLM": "own_code.OwnModel"}),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "own_code.OwnTokenizer"]}),
    ):
        data = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**data, "auto_map": auto_map}))
    return model, marker


@pytest.fixture(scope="module")
def run(own_code_model, tmp_path_factory) -> Path:
    """Trained in this process, where pytest's stdin cannot be read: a prompt would fail the load."""
    model, marker = own_code_model
    run_dir = train_smoke(tmp_path_factory.mktemp("fp4") / "run", "quant=fp4", f"model.name_or_path={model}")[1]
    assert not marker.exists()
    return run_dir


@pytest.fixture(scope="module")
def merged(run, own_code_model) -> Path:
    """The run merged into OUT, where a `<OUT>.partial` left by a merge that died (it carries merge's
    mark) is cleared first."""
    from qlora_recipes.merge.export import PARTIAL_MARK
    from qlora_recipes.merge.pipeline import merge

    out = run.parent / "merged"
    stale = run.parent / "merged.partial"
    stale.mkdir()
    (stale / PARTIAL_MARK).write_text("")
    (stale / "shard-00001.tmp").write_bytes(b"half a shard")
    merge(run, out=out)
    assert not stale.exists() and not own_code_model[1].exists()
    return out


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to, ignore=shutil.ignore_patterns("merged", "checkpoints", "tb"))
    return to


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _generate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts/generate.py"), *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


# --------------------------------------------------------------------------------------------------
# a model dir's own code
# --------------------------------------------------------------------------------------------------


def test_train_merge_and_generate_never_run_or_offer_to_run_a_model_dirs_own_code(run, merged, own_code_model):
    _, marker = own_code_model
    assert json.loads((merged / "merge_report.json").read_text())["quant"] == "fp4"
    for target in (run, merged):
        done = _generate(str(target), "order: cba\\n", "--max-new-tokens", "2")
        assert done.returncode == 0, done.stderr[-2000:]
        assert PROMPTED not in done.stdout + done.stderr
    assert not marker.exists()


def test_a_merged_dir_that_needs_its_own_code_is_one_line_naming_the_option(merged, own_code_model, tmp_path):
    _, marker = own_code_model
    custom = shutil.copytree(merged, tmp_path / "custom")
    shutil.copy(own_code_model[0] / "own_code.py", custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="own_tiny", auto_map={"AutoModelForCausalLM": "own_code.OwnModel"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "manifest.json").unlink()  # config.json edited here
    done = _generate(str(custom), "order: cba\\n")
    assert done.returncode == 2 and PROMPTED not in done.stdout + done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trust-remote-code" in lines[0], done.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# a damaged run dir
# --------------------------------------------------------------------------------------------------


def test_a_finished_run_and_a_merge_record_their_files_in_a_manifest(run, merged):
    files = json.loads((run / "manifest.json").read_text())["files"]
    assert {"config.yaml", "metrics.json", "adapter/adapter_model.safetensors"} <= set(files)
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in files.values())
    files = json.loads((merged / "manifest.json").read_text())["files"]
    assert {"config.json", "merge_report.json", "model.safetensors"} <= set(files)
    assert "README.md" not in files  # the card: `qlora push` writes it again for the repo it names


@pytest.mark.parametrize("manifest", [True, False], ids=["recorded", "older-run-without-manifest"])
def test_a_config_cut_short_is_named_and_never_filled_with_defaults(run, tmp_path, manifest):
    from qlora_recipes.merge.pipeline import merge
    from qlora_recipes.outputs.generation import load_for_generation

    damaged = _copy(run, tmp_path / "run")
    text = (damaged / "config.yaml").read_text()
    (damaged / "config.yaml").write_text(text[: text.index("\nquant:") + 1])  # whole sections gone
    if not manifest:
        (damaged / "manifest.json").unlink()
    for read in (merge, load_for_generation):
        with pytest.raises(UserError, match=r"config\.yaml: damaged") as err:
            read(damaged)
        assert "\n" not in str(err.value)
        assert manifest or "quant" in str(err.value)
    assert not (damaged / "merged").exists()


def test_an_older_run_without_the_sections_added_since_still_reads(run, tmp_path):
    import yaml

    from qlora_recipes.outputs.rundir import load_run_config

    older = _copy(run, tmp_path / "run")
    (older / "manifest.json").unlink()
    config = yaml.safe_load((older / "config.yaml").read_text())
    for section in ("logger", "hub", "dist", "hardware"):
        config.pop(section)
    (older / "config.yaml").write_text(yaml.safe_dump(config))
    assert load_run_config(older).quant.method == "fp4"


@pytest.mark.parametrize("manifest", [True, False], ids=["recorded", "older-run-without-manifest"])
def test_a_truncated_metrics_json_is_named_in_one_line(run, tmp_path, manifest):
    from qlora_recipes.merge.pipeline import merge

    damaged = _copy(run, tmp_path / "run")
    _cut(damaged / "metrics.json")
    if not manifest:
        (damaged / "manifest.json").unlink()
    with pytest.raises(UserError, match=r"metrics\.json: damaged"):
        merge(damaged)


def test_an_edited_config_is_named_with_the_way_to_keep_the_edit(run, tmp_path):
    from qlora_recipes.outputs.rundir import load_run_config

    edited = _copy(run, tmp_path / "run")
    cfg = edited / "config.yaml"
    cfg.write_text(cfg.read_text().replace("\nseed: 0\n", "\nseed: 1\n"))  # same size, other sha256
    with pytest.raises(UserError, match=r"config\.yaml: damaged or changed.*delete .*manifest\.json"):
        load_run_config(edited)
    (edited / "manifest.json").unlink()
    assert load_run_config(edited).seed == 1


def _adapter_readers(tmp_path: Path):
    """What reads a run's adapter back: merge, generate, a stage's init_from, and push (its run config)."""
    from conftest import SMOKE, compose_cfg

    from qlora_recipes.merge.pipeline import merge
    from qlora_recipes.outputs.generation import load_for_generation
    from qlora_recipes.outputs.rundir import load_run_config
    from qlora_recipes.run.stages import check_init_from

    return {
        "merge": lambda d: merge(d, out=tmp_path / "out"),
        "generate": load_for_generation,
        "init_from": lambda d: check_init_from(compose_cfg(*SMOKE, "quant=fp4", f"init_from={d}")),
        "push": load_run_config,
    }


def test_a_byte_flipped_in_an_adapter_file_of_any_size_is_caught_by_every_reader(run, tmp_path):
    from qlora_recipes.outputs.runfiles import DEEP_LIMIT, run_file_names, write_manifest

    damaged = _copy(run, tmp_path / "run")
    big = damaged / "adapter" / "extra_weights.bin"  # an adapter file past the size merged shards are hashed to
    big.write_bytes(bytes(DEEP_LIMIT + 2**20))
    write_manifest(damaged, run_file_names(damaged), complete=("adapter",))
    with open(big, "r+b") as f:
        f.seek(DEEP_LIMIT // 2)
        f.write(b"\x01")
    for reader, read in _adapter_readers(tmp_path).items():
        with pytest.raises(UserError, match=r"extra_weights\.bin: damaged or changed") as err:
            read(damaged)
        assert "\n" not in str(err.value), reader


def test_a_file_added_to_a_finished_runs_adapter_is_named_by_every_reader(run, tmp_path):
    damaged = _copy(run, tmp_path / "run")
    (damaged / "adapter" / "adapter_model.bin").write_bytes(b"not what the run wrote")
    for reader, read in _adapter_readers(tmp_path).items():
        with pytest.raises(UserError, match=r"adapter_model\.bin: added after the run wrote it") as err:
            read(damaged)
        assert "\n" not in str(err.value), reader
    (damaged / "adapter" / "adapter_model.bin").unlink()
    (damaged / "adapter" / "README.md").write_text("a model card, written after the manifest")
    assert _adapter_readers(tmp_path)["push"](damaged).quant.method == "fp4"


def test_a_merged_dir_with_truncated_weights_or_a_garbled_report_is_named(merged, tmp_path):
    from qlora_recipes.outputs.generation import load_for_generation

    for name, damage in (("model.safetensors", _cut), ("merge_report.json", lambda p: p.write_text("{garbled"))):
        for manifest in (True, False):
            damaged = shutil.copytree(merged, tmp_path / f"{name}-{manifest}")
            damage(damaged / name)
            if not manifest:
                (damaged / "manifest.json").unlink()
            with pytest.raises(UserError, match=rf"{name.replace('.', '[.]')}: (damaged|corrupt or truncated)"):
                load_for_generation(damaged)


def test_a_runs_and_a_merges_files_all_get_the_umasks_mode(run, merged):
    from qlora_recipes.outputs.runfiles import umask_mode

    files = [p for p in (*(run / "adapter").iterdir(), *merged.iterdir()) if p.is_file()]
    assert {"adapter_model.safetensors", "model.safetensors", "config.json"} <= {p.name for p in files}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(umask_mode()) for p in files}


# --------------------------------------------------------------------------------------------------
# merges into one output
# --------------------------------------------------------------------------------------------------


def test_a_users_own_partial_dir_is_left_alone(run, tmp_path):
    from qlora_recipes.merge.pipeline import merge

    theirs = tmp_path / "out.partial"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"out\.partial: exists and was not made by merge"):
        merge(run, out=tmp_path / "out")
    assert (theirs / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_a_second_merge_into_the_same_output_is_refused_while_the_first_runs(run, merged):
    from qlora_recipes.merge.export import out_lock
    from qlora_recipes.merge.pipeline import merge

    before = (merged / "manifest.json").read_text()
    with out_lock(merged), pytest.raises(UserError, match=r"merge output .*merged is in use by process"):
        merge(run, out=merged)  # the lock a first merge holds
    assert (merged / "manifest.json").read_text() == before
    assert not merged.with_name("merged.partial").exists() and not merged.with_name("merged.lock").exists()


def test_a_full_disk_during_a_merge_is_one_line_and_the_earlier_merge_stays(run, merged, monkeypatch):
    from safetensors import SafetensorError

    from qlora_recipes.merge import export
    from qlora_recipes.merge.pipeline import merge
    from qlora_recipes.outputs.generation import check_merged

    def full_disk(self):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(export.ShardWriter, "flush", full_disk)
    with pytest.raises(UserError, match=r"no space left on the device of .* it needs about [\d.]+ GiB") as err:
        merge(run, out=merged)
    assert str(merged.parent) in str(err.value) and "earlier merge" in str(err.value)
    assert "\n" not in str(err.value)
    assert not merged.with_name("merged.partial").exists()
    check_merged(merged)  # every file as that merge wrote it
