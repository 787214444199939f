"""Library parts instead of hand-written ones, each with what users saw before.

- checkpoint discovery: transformers' `get_last_checkpoint` / `sort_checkpoints` under our soundness check
- dequantization: bitsandbytes' `dequantize_4bit` and peft's `dequantize_bnb_weight` / `get_bnb_param_type`
- one size parser (`units.parse_size`), agreeing with accelerate's where both read a size
"""

import copy
import json
import os

import datasets.config
import pytest
import torch

from qlora_recipes.data import formats
from qlora_recipes.run.checkpoints import CHECKPOINT, RECORD, find_checkpoint
from qlora_recipes.units import parse_size


# ---------------------------------------------------------------- checkpoint discovery
def _checkpoint(root, step, sound=True):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "adapter.bin").write_bytes(b"x" * 10)
    size = 10 if sound else 99  # an unsound one: its file is not what its manifest says was written
    (path / RECORD).write_text(json.dumps({"files": {"adapter.bin": {"bytes": size, "sha256": ""}}}))
    return path


def test_newest_sound_checkpoint_is_transformers_last_checkpoint(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    for step in (2, 10, 9):  # numeric, not lexical, order: checkpoint-10 is the newest
        _checkpoint(tmp_path, step)
    (tmp_path / ".partial").mkdir()  # the staging dir never counts
    (tmp_path / "checkpoint-11.tmp").mkdir()  # nor a name that only starts like a checkpoint
    (tmp_path / "checkpoint-12").write_text("a file, not a dir")
    assert find_checkpoint(tmp_path) == get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


def test_an_unsound_newest_checkpoint_is_skipped_for_the_next_sound_one(tmp_path):
    from qlora_recipes.run.checkpoints import newest_sound

    for step in (1, 3):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 4, sound=False)
    (tmp_path / "checkpoint-5").mkdir()  # no trainer_state.json: never completed
    found, skipped = newest_sound(tmp_path, deep=False)
    assert found == str(tmp_path / "checkpoint-3")
    assert skipped == [
        "checkpoint-5 (trainer_state.json missing or unreadable)",
        "checkpoint-4 (adapter.bin has 10 bytes, 99 were written)",
    ]
    assert find_checkpoint(tmp_path / "absent") is None and find_checkpoint(tmp_path / ".partial") is None


def test_checkpoint_names_are_transformers_names():
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, _re_checkpoint

    for name in (
        "checkpoint-0",
        "checkpoint-12",
        "checkpoint-12.tmp",
        "checkpoint-",
        "ckpt-3",
        f"{PREFIX_CHECKPOINT_DIR}-7",
    ):
        assert bool(CHECKPOINT.match(name)) == bool(_re_checkpoint.search(name)), name


# ---------------------------------------------------------------- dequantization
def _dequantize_before(module):
    """The hand-written dequantizer this repository had (kept here as the reference)."""
    import bitsandbytes.functional as F

    weight = module.weight
    if type(weight).__name__ == "Params4bit":
        state = copy.copy(weight.quant_state)
        state.dtype = torch.float32
        return F.dequantize_4bit(weight.data, state)
    if type(weight).__name__ == "Int8Params":
        state = module.state
        cb = weight.data if weight.dtype == torch.int8 else state.CB
        scb = getattr(weight, "SCB", None)
        return F.int8_vectorwise_dequant(cb, (state.SCB if scb is None else scb).to(cb.device)).float()
    return weight.detach().float()


def _bnb_layers():
    import bitsandbytes as bnb

    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32, bias=False)
    layers = {}
    for quant_type, double in (("nf4", True), ("fp4", False)):
        q = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.bfloat16, quant_type=quant_type)
        q.weight = bnb.nn.Params4bit(
            dense.weight.data.clone(),
            requires_grad=False,
            quant_type=quant_type,
            compress_statistics=double,
            quant_storage=torch.uint8,
        )
        layers[f"{quant_type}{'-double' if double else ''}"] = q.to("cpu")
    int8 = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False)
    int8.weight = bnb.nn.Int8Params(dense.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    layers["int8"] = int8.to("cpu")
    layers["dense"] = dense
    return dense.weight.detach(), layers


def test_dequantized_weights_are_bit_identical_to_the_hand_written_ones():
    from peft.utils.integrations import dequantize_module_weight

    from qlora_recipes.merge.dequantize import bnb_kind, dequantize

    original, layers = _bnb_layers()
    kinds = {name: bnb_kind(layer) for name, layer in layers.items()}
    assert kinds == {"nf4-double": "4bit", "fp4": "4bit", "int8": "8bit", "dense": None}
    for name, layer in layers.items():
        ours = dequantize(layer)
        assert ours.dtype == torch.float32 and ours.shape == original.shape, name
        assert torch.equal(ours, _dequantize_before(layer)), name
        # peft's own dequantizer agrees, in its output dtype (for 4 bit the dtype the layer was quantized from)
        theirs = dequantize_module_weight(copy.deepcopy(layer))
        assert torch.equal(ours.to(theirs.dtype), theirs), name
        assert (ours - original).abs().max() < 0.25 * original.abs().max(), name  # it is the weight


# ---------------------------------------------------------------- one size parser
def test_one_size_parser_agrees_with_accelerate():
    from accelerate.utils import convert_file_size_to_int

    for text in ("80GB", "75GiB", "512MiB", "1.5GB", "100KB", "64KiB", "0.5GiB"):
        assert parse_size(text, "x") == convert_file_size_to_int(text), text
    assert parse_size(12345, "x") == convert_file_size_to_int(12345)
    # what ours reads beyond accelerate's: bare numbers as text, TB, spaces, lower case
    assert parse_size("1000", "x") == 1000 and parse_size("2TB", "x") == 2 * 10**12
    assert parse_size(" 3 gib ", "x") == 3 * 2**30


def test_every_size_in_the_package_goes_through_units_parse_size():
    """No second parser: no other module of the package holds a size-unit table."""
    import pathlib

    import qlora_recipes

    root = pathlib.Path(qlora_recipes.__file__).parent
    holders = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if '"GIB"' in p.read_text() or "convert_file_size_to_int" in p.read_text()
    ]
    assert holders == ["units.py"]


# ---------------------------------------------------------------- data read into Arrow, not Python lists
_MEASURE = r"""
import json, os, sys, threading, time

def anon():  # anonymous memory (Python objects, Arrow buffers); mapped Arrow pages are page cache
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

from qlora_recipes.config.schema import DataConfig
from qlora_recipes.data import load_splits
from qlora_recipes.run.memory import reset_rss_high_water_mark, rss_bytes, rss_high_water_mark

peak, done = [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)

base, base_anon = rss_bytes(), anon()
reset_rss_high_water_mark()
sampler = threading.Thread(target=sample)
sampler.start()
train, eval_ds, stats = load_splits(DataConfig(path=sys.argv[1], eval_fraction=0.01), None, 64, 0)
done.set()
sampler.join()
print(json.dumps({"anon": peak[0] - base_anon, "rss": rss_high_water_mark() - base, "train": len(train),
                  "eval": len(eval_ds), "last": train[-1], "prompt_format": stats["prompt_format"]}))
"""


@pytest.mark.slow
def test_a_large_jsonl_is_read_without_holding_it_as_python_objects(tmp_path):
    """~88 MB of JSON lines: the rows go through our validation into datasets' memory-mapped Arrow, so
    the process's anonymous memory grows by a fraction of the file (the old whole-file reader held the
    text and every row as Python objects: several times the file's size)."""
    import subprocess
    import sys

    from conftest import REPO

    path, n = tmp_path / "big.jsonl", 200_000
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"order: {i:07d}{'x' * 190}\n", "completion": "y" * 200}) + "\n")
    env = dict(os.environ, HF_DATASETS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    size = path.stat().st_size
    assert got["train"] + got["eval"] == n  # nothing dropped
    assert got["last"]["completion"] == "y" * 200 and got["last"]["prompt"].startswith("order: ")
    assert got["prompt_format"] == {"style": "plain", "prefix": "order: ", "suffix": "\n"}
    # measured here: ~34 MB for 88 MB (~15 MB of it fixed: writer buffers, the split's index mapping);
    # the whole-file reader grew by ~700 MB on a 105 MB file of these rows
    assert got["anon"] < 0.5 * size, (got, size)
    assert got["rss"] < 1.25 * size, (got, size)  # with the Arrow file's mapped (reclaimable) pages


_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
_ROWS = {
    "alpaca": [{"instruction": f"i{k}", "input": "" if k % 2 else "x", "output": f"o{k}"} for k in range(5)],
    "messages": [{"messages": _CHAT} for _ in range(5)],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": f"q{k}"}, {"from": "gpt", "value": "a"}]} for k in range(5)
    ],
    "prompt_completion": [{"prompt": f"order: {k}\n", "completion": f"{k}"} for k in range(5)],
    "chat prompt_completion": [{"prompt": _CHAT[:2], "completion": _CHAT[2:]} for _ in range(5)],
    "text": [{"text": f"t{k}"} for k in range(5)],
}


@pytest.mark.parametrize("fmt", sorted(_ROWS))
def test_streamed_files_convert_to_what_the_in_memory_reader_gave(fmt, tmp_path, monkeypatch):
    """.jsonl and .parquet (now streamed into Arrow) give the rows, columns and features the whole-file
    reader gave (the .json list path still reads whole, as before)."""
    from datasets import Dataset

    from qlora_recipes.data.formats import convert, detect
    from qlora_recipes.data.readers import read_source

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(formats, "IN_MEMORY_BYTES", 0)  # stream these small files as a large one is
    rows = _ROWS[fmt]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    converted = {}
    for name in ("d.json", "d.jsonl", "d.parquet"):
        source, _ = read_source(str(tmp_path / name), "train", "data.path")
        converted[name] = convert(source, detect(source))
    before, conversational = converted["d.json"]
    assert conversational == (fmt == "chat prompt_completion")
    for name in ("d.jsonl", "d.parquet"):
        ds, conv = converted[name]
        assert conv == conversational and ds.features == before.features, name
        assert ds.to_list() == before.to_list(), name


def test_a_bad_row_deep_in_a_streamed_file_is_named_by_its_line(tmp_path, monkeypatch):
    from qlora_recipes.data.formats import convert, detect
    from qlora_recipes.data.readers import read_source
    from qlora_recipes.errors import UserError

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(formats, "IN_MEMORY_BYTES", 0)  # stream these small files as a large one is
    good = json.dumps({"prompt": "p", "completion": "c"})
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([good] * 2500 + ["", "  ", json.dumps({"prompt": "p", "completion": 7})]) + "\n")
    source, _ = read_source(str(path), "train", "data.path")
    with pytest.raises(UserError, match=r"t\.jsonl line 2503: field 'completion' must be a string, got int 7"):
        convert(source, detect(source))


def test_a_rewritten_file_is_read_again_not_taken_from_the_cache(tmp_path, monkeypatch):
    from qlora_recipes.data.formats import convert, detect
    from qlora_recipes.data.readers import read_source

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(formats, "IN_MEMORY_BYTES", 0)  # stream these small files as a large one is
    path = tmp_path / "t.jsonl"
    seen = []
    for text in ("first", "second, longer"):
        path.write_text(json.dumps({"text": text}) + "\n")
        source, _ = read_source(str(path), "train", "data.path")
        seen.append(convert(source, detect(source))[0]["text"])
    assert seen == [["first"], ["second, longer"]]
