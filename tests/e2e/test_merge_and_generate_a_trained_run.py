"""After training: merge an adapter into its base (scripts/merge.py) and generate (scripts/generate.py).

One NF4 smoke run and one DoRA smoke run are shared by the whole module. Figures measured on the tiny
model (CPU, 8 eval prompts, 113 tokens, logits compared in fp32; the reference is the 4-bit base +
adapter forward, so they measure the merge, not quantization):

    merged weights saved in bfloat16 (default)  max |dlogit| ~2.4e-2, mean ~1.5e-3 (logit absmax ~14)
    merged weights saved in float32              max |dlogit| ~1e-5,   mean ~6e-7   (LoRA, DoRA, rsLoRA, int8)
    the adapter's own effect on the logits       max ~2.8,    mean ~0.1
    --from-original vs the 4-bit stack           max ~2.7 (the nf4 quantization error of this tiny model)

bf16 storage rounds each weight to 8 significant bits (relative 2^-9), which moves the logits by ~0.2 %
of their scale; the bounds below leave ~5x headroom over that and stay far below the adapter's own effect,
so a merge that dropped or mis-scaled the update would fail them.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_cfg, train_smoke

from qlora_recipes.errors import UserError

ENV_EXTRA = {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def nf4_run(tmp_path_factory) -> Path:
    return train_smoke(tmp_path_factory.mktemp("nf4") / "run", "precision=bf16")[1]  # the figures above: a bf16 run


@pytest.fixture(scope="module")
def nf4_merged(nf4_run) -> dict:
    from qlora_recipes.merge.pipeline import merge

    return merge(nf4_run)  # the defaults: <run>/merged, the run's dtype (bf16), 2GB shards


@pytest.fixture(scope="module")
def generations(nf4_run, nf4_merged, tmp_path_factory):
    """generate.py on the run dir and on the merged dir, started as soon as both exist: the two
    interpreter start-ups (~10 s of imports each) then overlap the in-process tests that follow, and
    test_generate_prints_for_a_run_dir_and_a_merged_dir collects them."""
    folder = tmp_path_factory.mktemp("prompts")
    prompts = folder / "prompts.txt"
    prompts.write_text("order: dcba\\n\nsort: zyx\\n\n")  # one prompt a line, \n typed as an escape
    piped = folder / "stdin.txt"
    piped.write_text("fed\ncba\n")  # plain lines: wrapped as the run's prompts were (order: ...\n)
    procs = {
        "run": _popen("generate.py", str(nf4_run), "order: fed\\n", "--max-new-tokens", "4"),
        "merged": _popen("generate.py", str(nf4_run / "merged"), "--file", str(prompts), "--jsonl"),
        "stdin": _popen("generate.py", str(nf4_run), "--jsonl", "--max-new-tokens", "4", stdin=piped),
        "raw": _popen("generate.py", str(nf4_run), "--raw", "order: fed\\n", "--jsonl", "--max-new-tokens", "4"),
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def dora_run(tmp_path_factory) -> Path:
    # No eval set (so no evaluation pass): merge then compares on the run's training prompts.
    return train_smoke(
        tmp_path_factory.mktemp("dora") / "run", "peft=dora", "data.eval_path=null", "data.eval_fraction=0"
    )[1]


def _popen(script: str, *args: str, cwd: Path = REPO, stdin: Path | None = None) -> subprocess.Popen:
    import os

    return subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / script), *args],
        cwd=cwd,
        env={**os.environ, **ENV_EXTRA},
        stdin=stdin.open() if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(procs: dict) -> dict:
    """Wait for processes started together (the interpreter start-up dominates; run them side by side)."""
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[key] = (proc.returncode, stdout, stderr)
    return out


def _shards(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


# --------------------------------------------------------------------------------------------------
# merge
# --------------------------------------------------------------------------------------------------


def test_merged_nf4_model_is_standalone_and_matches_base_plus_adapter(nf4_run, nf4_merged, generations):
    # (`generations` only starts the generate.py processes early; they are checked further down.)
    from transformers import AutoModelForCausalLM

    out = nf4_run / "merged"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    assert (out / "tokenizer.json").is_file() and not (out / "adapter_config.json").exists()
    assert not (out.parent / "merged.partial").exists()

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # plain transformers
    linears = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)  # no bitsandbytes / peft layers

    report = json.loads((out / "merge_report.json").read_text())
    assert report == json.loads(json.dumps(nf4_merged))
    c = report["compare"]
    main = c["vs_base_plus_adapter"]
    print("nf4 -> bf16 merge:", main, "adapter effect:", c["adapter_effect"])
    assert c["dtype"] == "float32" and c["prompts"] == 8 and "eval" in c["prompts_source"]
    assert main["includes_quantization_error"] is False
    assert main["max_abs_diff"] < 1e-2 * main["ref_logit_absmax"]  # measured ~2.4e-2 of ~14
    assert main["mean_abs_diff"] < 1e-2  # measured ~1.5e-3
    assert main["argmax_agreement"] >= 0.95
    assert c["adapter_effect"]["max_abs_diff"] > 20 * main["max_abs_diff"]  # the test can see a missing update


def test_from_original_merge_shards_with_an_index_and_matches_peft(nf4_run, tmp_path):
    """--from-original in fp32 with tiny shards: several files and an index; the merge alone is exact
    to float rounding (vs the 16-bit original + adapter, unmerged, and vs peft's own merge_and_unload of
    it), while the figure against the 4-bit stack carries the quantization error and says so."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qlora_recipes.merge.pipeline import merge
    from qlora_recipes.merge.quality import quality_line

    out = tmp_path / "orig"
    report = merge(nf4_run, out=out, from_original=True, shard_size="200KB", dtype="float32")
    c = report["compare"]
    print(quality_line(report))
    assert report["merged_into"] == "original 16-bit weights"
    assert c["vs_original_plus_adapter"]["max_abs_diff"] < 1e-4  # the merge alone: measured ~1e-5
    assert c["vs_original_plus_adapter"]["argmax_agreement"] == 1.0
    assert c["vs_base_plus_adapter"]["includes_quantization_error"] is True
    assert c["vs_base_plus_adapter"]["max_abs_diff"] > 10 * c["vs_original_plus_adapter"]["max_abs_diff"]
    assert "quantization error" in quality_line(report)

    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 3 and files == report["files"]
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = _shards(out)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.float32 for t in tensors.values())
    for f in files:  # a shard passes the limit only when one tensor alone does (the 100x128 fp32 embedding: 51 KB)
        assert (out / f).stat().st_size < 200_000 + 70_000

    # An independent merge of the same weights: peft's merge_and_unload on the fp32 original.
    base = AutoModelForCausalLM.from_pretrained(report["base"], dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, str(nf4_run / "adapter")).merge_and_unload().state_dict()
    assert set(ref) == set(tensors)
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_qlora_merge_reports_layers_and_shards_on_stderr(nf4_run, tmp_path):
    """A merge piped into a log (stderr not a terminal) shows its progress as plain lines: the decoder
    layers merged out of all of them and the shards written, first and last; no carriage returns."""
    import os

    out = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, "-m", "qlora_recipes", "merge", str(nf4_run), "--out", str(out), "--shard-size", "200KB"],
        cwd=REPO,
        env={**os.environ, **ENV_EXTRA},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = len(json.loads((out / "merge_report.json").read_text())["files"])
    assert shards >= 2  # 200KB shards of the tiny model's ~0.6 MB in bf16
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("merging:")]
    assert progress[0].startswith("merging: 0/2 layers"), proc.stderr[-3000:]  # the tiny model's 2 decoder layers
    assert progress[-1].startswith("merging: 2/2 layers") and progress[-1].endswith(f", {shards} shards written")
    assert "\r" not in proc.stderr
    assert f"({shards} shard(s)," in proc.stdout


def test_dora_adapter_merges_correctly(dora_run, tmp_path):
    """DoRA rescales each output row by magnitude / ||W + dW||. A smoke run barely moves the magnitudes,
    so spread them by +-30 % first: a merge that ignored them would be off by far more than the bound."""
    from safetensors.torch import load_file, save_file

    from qlora_recipes.merge.pipeline import merge

    weights = dora_run / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    magnitudes = [k for k in tensors if "lora_magnitude_vector" in k]
    assert magnitudes
    gen = torch.Generator().manual_seed(0)
    for k in magnitudes:
        tensors[k] = tensors[k] * (1 + 0.6 * (torch.rand(tensors[k].shape, generator=gen) - 0.5))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (dora_run / "manifest.json").unlink()  # the adapter edited on purpose: its recorded sha256 goes

    report = merge(dora_run, out=tmp_path / "dora", dtype="float32")
    main = report["compare"]["vs_base_plus_adapter"]
    print("dora -> fp32 merge:", main, "adapter effect:", report["compare"]["adapter_effect"])
    assert report["peft"] == "dora" and report["compare"]["prompts_source"].startswith("train data")
    assert main["max_abs_diff"] < 1e-4 and main["argmax_agreement"] == 1.0  # measured ~2e-5
    assert report["compare"]["adapter_effect"]["max_abs_diff"] > 0.5


def test_adapter_on_a_base_of_other_shapes_is_refused(nf4_run, tmp_path):
    """A run dir whose config now loads a different base (same dir name, other shapes): named, not a traceback."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qlora_recipes.merge.pipeline import merge

    tiny = Path(compose_cfg().model.name_or_path)
    other = tmp_path / "elsewhere" / tiny.name
    config = LlamaConfig.from_pretrained(str(tiny))
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
    LlamaForCausalLM(config).save_pretrained(str(other))
    for f in tiny.glob("tokenizer*"):
        shutil.copy(f, other)
    run = tmp_path / "run"
    shutil.copytree(nf4_run / "adapter", run / "adapter")
    (run / "config.yaml").write_text((nf4_run / "config.yaml").read_text().replace(str(tiny), str(other)))
    with pytest.raises(
        UserError, match=r"does not fit the loaded base .* has in_features=\d+ in the base but the adapter"
    ):
        merge(run)
    assert not (run / "merged").exists() and not (run / "merged.partial").exists()


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------


def test_generate_prints_for_a_run_dir_and_a_merged_dir(generations):
    results = _finish(generations)
    rc, stdout, stderr = results["run"]
    assert rc == 0, stderr[-3000:]
    assert stdout.startswith("### order: fed\\n\n") and len(stdout.splitlines()[1].strip()) > 0, stdout
    rc, stdout, stderr = results["merged"]
    assert rc == 0, stderr[-3000:]
    rows = [json.loads(line) for line in stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["order: dcba\n", "sort: zyx\n"]
    assert all(r["generation"].strip() for r in rows), rows
    # plain prompts piped in; --raw: the text exactly as given, which here is already the run's format
    rc, stdout, stderr = results["stdin"]
    assert rc == 0, stderr[-3000:]
    piped = [json.loads(line) for line in stdout.splitlines()]
    assert [r["prompt"] for r in piped] == ["fed", "cba"]
    rc, stdout, stderr = results["raw"]
    assert rc == 0, stderr[-3000:]
    raw = [json.loads(line) for line in stdout.splitlines()]
    assert raw[0]["generation"] == piped[0]["generation"]  # "fed" was wrapped into "order: fed\n"


# --------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, no traceback
# --------------------------------------------------------------------------------------------------


def test_bad_inputs_get_one_line_errors(nf4_run, nf4_merged, tmp_path):
    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("hello")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    other_base = tmp_path / "other-base-run"  # the adapter claims another base than config.yaml loads
    shutil.copytree(nf4_run / "adapter", other_base / "adapter")
    shutil.copy(nf4_run / "config.yaml", other_base / "config.yaml")
    adapter_cfg = json.loads((other_base / "adapter" / "adapter_config.json").read_text())
    adapter_cfg["base_model_name_or_path"] = "meta-llama/Llama-2-7b-hf"
    (other_base / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_cfg))

    cases = {
        "missing": (("merge.py", str(tmp_path / "nope")), ["nope: no such directory", "run dir"]),
        "not a run (merge)": (("merge.py", str(not_a_run)), ["not a run dir", "config.yaml"]),
        "not a run (generate)": (("generate.py", str(not_a_run), "hi"), ["not a run dir", "merged model"]),
        "other base (merge)": (("merge.py", str(other_base)), ["Llama-2-7b-hf", "model.name_or_path"]),
        "other base (generate)": (("generate.py", str(other_base), "hi"), ["trained on base", "Llama-2-7b-hf"]),
        "empty prompts (merge)": (("merge.py", str(nf4_run), "--prompts", str(empty)), ["empty.txt", "no prompts"]),
        "empty prompts (generate)": (("generate.py", str(nf4_run), "--file", str(empty)), ["empty.txt", "no prompts"]),
        "merged dir to merge": (("merge.py", str(nf4_run / "merged")), ["already a merged model"]),
        "bad shard size": (("merge.py", str(nf4_run), "--shard-size", "lots"), ["--shard-size lots"]),
    }
    results = _finish({name: _popen(*args) for name, (args, _) in cases.items()})
    for name, (rc, _, stderr) in results.items():
        assert rc == 2, (name, stderr[-2000:])
        assert "Traceback" not in stderr, (name, stderr[-2000:])
        errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, (name, stderr[-2000:])
        for needle in cases[name][1]:
            assert needle in errors[0], (name, errors[0])
    assert not (other_base / "merged").exists()


# --------------------------------------------------------------------------------------------------
# plain prompts in the run's format; stop tokens
# --------------------------------------------------------------------------------------------------


def test_plain_prompts_are_wrapped_in_the_format_the_run_trained_on(nf4_run):
    """The sample's prompts all read `order: <letters>\\n`: a bare `fed` is sent as `order: fed\\n` (the run
    recorded that prefix/suffix in metrics.json), and generates exactly what the full prompt does."""
    from qlora_recipes.outputs.generation import generate, load_for_generation
    from qlora_recipes.outputs.prompts import Prompt, PromptFormat, render

    model, tokenizer, info = load_for_generation(nf4_run)
    assert info["format"] == PromptFormat(style="plain", prefix="order: ", suffix="\n")
    assert info["max_prompt_tokens"] == 64  # the run's trainer.seq_len
    assert render(tokenizer, Prompt("text", "fed"), info["format"]) == ("order: fed\n", True)
    assert render(tokenizer, Prompt("text", "order: fed\n"), info["format"]) == ("order: fed\n", True)  # once
    assert render(tokenizer, Prompt("formatted", "fed"), info["format"]) == ("fed", True)  # --raw
    plain, full = generate(
        model, tokenizer, [Prompt("text", "fed"), Prompt("formatted", "order: fed\n")], info["format"], 6
    )
    assert plain == full


SAMPLE_FORMAT = {"style": "plain", "prefix": "order: ", "suffix": "\n", "system": None}


def _copy_run(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("merged", "checkpoints", "tb"))
    return to


def test_a_run_dir_from_before_the_prompt_format_record_is_wrapped_as_its_data_was(nf4_run, tmp_path, caplog):
    """An older run's metrics.json has no data.prompt_format: plain prompts used to go in bare (`qcab`
    instead of `order: qcab\n`, the garbage once seen); the format now comes from its config.yaml's data."""
    import logging

    from qlora_recipes.outputs.generation import load_for_generation
    from qlora_recipes.outputs.prompts import Prompt, PromptFormat, render

    old = _copy_run(nf4_run, tmp_path / "old-run")
    (old / "manifest.json").unlink()  # a run from before that record wrote no manifest either
    metrics = json.loads((old / "metrics.json").read_text())
    del metrics["data"]["prompt_format"]
    (old / "metrics.json").write_text(json.dumps(metrics))
    with caplog.at_level(logging.INFO, logger="qlora_recipes.outputs.rundir"):
        _, tokenizer, info = load_for_generation(old)
    assert info["format"] == PromptFormat(style="plain", prefix="order: ", suffix="\n")
    assert render(tokenizer, Prompt("text", "qcab"), info["format"]) == ("order: qcab\n", True)
    assert render(tokenizer, Prompt("text", "order: qcab"), info["format"]) == ("order: qcab\n", True)
    assert any("records no prompt format" in r.getMessage() for r in caplog.records)


def test_merge_records_the_prompt_format_and_a_moved_merged_dir_keeps_it(nf4_run, nf4_merged, tmp_path):
    """merge_report.json carries the run's whole prompt format (not only its style), so a merged dir
    copied away from its run dir still wraps `qcab` as `order: qcab\n`; merge's --prompts lines are
    wrapped the same way."""
    from transformers import AutoTokenizer

    from qlora_recipes.merge.quality import compare_prompts
    from qlora_recipes.outputs.generation import load_for_generation
    from qlora_recipes.outputs.prompts import PromptFormat
    from qlora_recipes.outputs.rundir import load_run_config, run_prompt_format

    assert nf4_merged["prompt_format"] == SAMPLE_FORMAT
    moved = tmp_path / "moved"
    shutil.copytree(nf4_run / "merged", moved)
    report = json.loads((moved / "merge_report.json").read_text())
    report["run_dir"] = str(tmp_path / "gone")  # the run dir deleted after merging
    (moved / "merge_report.json").write_text(json.dumps(report))
    (moved / "manifest.json").unlink()  # the report edited here: its recorded sha256 no longer holds
    _, _, info = load_for_generation(moved)
    assert info["format"] == PromptFormat(style="plain", prefix="order: ", suffix="\n")

    cfg = load_run_config(nf4_run)
    tokenizer = AutoTokenizer.from_pretrained(str(nf4_run / "adapter"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("qcab\norder: fed\\n\n")
    batches, _ = compare_prompts(cfg, tokenizer, str(prompts), run_prompt_format(nf4_run, cfg, "plain"))
    expected = [tokenizer(t, return_tensors="pt")["input_ids"] for t in ("order: qcab\n", "order: fed\n")]
    assert [b["input_ids"].tolist() for b in batches] == [e.tolist() for e in expected]
