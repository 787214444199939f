"""qlora_recipes.data: every format from every source, validation errors, eval splits, and the labels
TRL's SFTTrainer builds from what load_splits returns (on the tiny model, CPU)."""

import json
import re
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from qlora_recipes.config.schema import DataConfig
from qlora_recipes.data import ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT, format_kwargs, generation_pairs, load_splits
from qlora_recipes.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-llama"

ROWS = {
    "alpaca": [
        {"instruction": "Sort the letters.", "input": "cba", "output": "abc"},
        {"instruction": "Say hi.", "output": "hi"},
        {"instruction": "Copy.", "input": "", "output": "xy"},
    ],
    "messages": [
        {"messages": [{"role": "user", "content": "sort: cba"}, {"role": "assistant", "content": "abc"}]},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "max: abz"},
                {"role": "assistant", "content": "z"},
            ]
        },
        {"messages": [{"role": "user", "content": "first: qrs"}, {"role": "assistant", "content": "q"}]},
    ],
    "prompt_completion": [
        {"prompt": "order: cba\n", "completion": "abc"},
        {"prompt": "order: zyx\n", "completion": "xyz"},
        {"prompt": "order: qp\n", "completion": "pq"},
    ],
    "text": [{"text": "copy: abc\nabc"}, {"text": "sort: cba\nabc"}, {"text": "last: xyz\nz"}],
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


def cfg(path, **kw):
    kw.setdefault("eval_fraction", 0.0)
    return DataConfig(path=str(path), **kw)


def write(path: Path, rows, kind=None) -> Path:
    """Write rows as a .jsonl/.json/.csv/.parquet file (by suffix) or a save_to_disk dir ("disk")."""
    kind = kind or path.suffix
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == ".json":
        path.write_text(json.dumps(rows))
    elif kind == ".csv":
        import pandas as pd

        flat = [{k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows]
        pd.DataFrame(flat).to_csv(path, index=False)
    elif kind == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "disk":
        Dataset.from_list(rows).save_to_disk(str(path))
    else:
        raise AssertionError(kind)
    return path


def expected_columns(fmt, row):
    if fmt == "alpaca":
        prompt = ALPACA_PROMPT_INPUT.format(**row) if row.get("input") else ALPACA_PROMPT_NO_INPUT.format(**row)
        return {"prompt": prompt, "completion": row["output"]}
    return row


# The token columns load_splits adds for TRL (tokenized once: TRL trains on them without tokenizing again).
TOKEN_COLUMNS = ("input_ids", "completion_mask", "assistant_masks")


def rows_of(ds):
    """The dataset's rows without the token columns."""
    return ds.remove_columns([c for c in TOKEN_COLUMNS if c in ds.column_names]).to_list()


def user_error(match, fn, *args):
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value), "a UserError must be one line"
    return str(info.value)


# --------------------------------------------------------------------------------------------------
# Formats x sources
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [".jsonl", ".json", ".csv", ".parquet", "disk"])
@pytest.mark.parametrize("fmt", list(ROWS))
def test_each_format_loads_from_each_source(tmp_path, tok, fmt, kind):
    path = write(tmp_path / ("data" + (kind if kind != "disk" else "_dir")), ROWS[fmt], kind)
    for format_name in (fmt, "auto"):
        train, eval_ds, stats = load_splits(cfg(path, format=format_name), tok, 256, 0)
        assert eval_ds is None
        assert stats["format"] == fmt
        assert stats["rows"] == {"train": 3, "eval": 0}
        assert stats["over_seq_len"] == {"train": 0, "eval": 0}
        assert rows_of(train) == [expected_columns(fmt, r) for r in ROWS[fmt]]
        assert (
            set(train.column_names)
            == {
                "alpaca": {"prompt", "completion", "input_ids", "completion_mask"},
                "prompt_completion": {"prompt", "completion", "input_ids", "completion_mask"},
                "messages": {"messages", "input_ids", "assistant_masks"},
                "text": {"text", "input_ids"},
            }[fmt]
        )


def test_alpaca_uses_the_standard_template_with_and_without_input(tmp_path, tok):
    train, _, _ = load_splits(cfg(write(tmp_path / "a.jsonl", ROWS["alpaca"])), tok, 512, 0)
    assert train[0]["prompt"] == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nSort the letters.\n\n### Input:\ncba\n\n### Response:\n"
    )
    no_input = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{}\n\n### Response:\n"
    )
    assert train[1]["prompt"] == no_input.format("Say hi.")
    assert train[2]["prompt"] == no_input.format("Copy.")  # empty input: the no-input variant
    assert train[0]["completion"] == "abc"


def test_shipped_sample_config_loads(tok):
    from omegaconf import OmegaConf

    from qlora_recipes.config.loader import register_schemas

    register_schemas()
    data_cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(REPO / "conf/data/order.yaml"))
    train, eval_ds, stats = load_splits(data_cfg, tok, 64, 0)
    assert stats["format"] == "prompt_completion"
    assert stats["rows"] == {"train": 2000, "eval": 64}
    assert stats["over_seq_len"] == {"train": 0, "eval": 0}
    assert train.column_names == ["prompt", "completion", "input_ids", "completion_mask"]
    pairs = generation_pairs(eval_ds, stats["format"], data_cfg.metric_examples)
    assert len(pairs) == 64 and pairs[0] == (eval_ds[0]["prompt"], eval_ds[0]["completion"])


def test_json_variants(tmp_path, tok):
    rows = ROWS["prompt_completion"]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": rows}))
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(r) for r in rows))
    for path in (wrapped, lines):
        train, _, _ = load_splits(cfg(path), tok, 64, 0)
        assert rows_of(train) == rows


def test_chat_prompt_completion(tmp_path, tok):
    rows = [
        {"prompt": [{"role": "user", "content": "sort: cba"}], "completion": [{"role": "assistant", "content": "abc"}]},
        {"prompt": [{"role": "user", "content": "max: ab"}], "completion": [{"role": "assistant", "content": "b"}]},
    ]
    train, _, stats = load_splits(cfg(write(tmp_path / "c.jsonl", rows)), tok, 64, 0)
    assert stats["format"] == "prompt_completion" and stats["conversational"]
    assert generation_pairs(train, "prompt_completion", 5) == [
        ([{"role": "user", "content": "sort: cba"}], "abc"),
        ([{"role": "user", "content": "max: ab"}], "b"),
    ]


def test_dir_of_files_picks_the_split(tmp_path, tok):
    d = tmp_path / "ds"
    write(d / "train.jsonl", ROWS["text"])
    write(d / "test.jsonl", ROWS["text"][:1])
    train, eval_ds, stats = load_splits(cfg(d, eval_path=str(d)), tok, 64, 0)
    assert len(train) == 3 and len(eval_ds) == 1
    assert stats["source"].endswith("train.jsonl") and stats["eval_source"].endswith("test.jsonl")


def test_saved_dataset_dict_dir(tmp_path, tok):
    d = tmp_path / "dd"
    rows = ROWS["prompt_completion"]
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(str(d))
    train, eval_ds, _ = load_splits(cfg(d, eval_path=str(d)), tok, 64, 0)
    assert len(train) == 3 and len(eval_ds) == 1
    user_error(
        r"has splits \['train', 'test'\], none named nope; set data\.split",
        load_splits,
        cfg(d, split="nope"),
        tok,
        64,
        0,
    )


# --------------------------------------------------------------------------------------------------
# Auto-detection and eval splits
# --------------------------------------------------------------------------------------------------


def test_auto_detect_fails_clearly(tmp_path, tok):
    path = write(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    msg = user_error(r"odd\.jsonl line 1: cannot detect the data format", load_splits, cfg(path), tok, 64, 0)
    assert "['answer', 'question']" in msg
    for name in ("alpaca", "messages", "prompt_completion", "text"):
        assert name in msg


def test_eval_split_by_fraction_is_seeded_and_disjoint(tmp_path, tok):
    rows = [{"prompt": f"order: {i}\n", "completion": str(i)} for i in range(40)]
    path = write(tmp_path / "p.jsonl", rows)
    train, eval_ds, stats = load_splits(cfg(path, eval_fraction=0.25), tok, 64, 7)
    assert (len(train), len(eval_ds)) == (30, 10) and stats["rows"] == {"train": 30, "eval": 10}
    got = sorted(list(train["completion"]) + list(eval_ds["completion"]), key=int)
    assert got == [str(i) for i in range(40)]
    again_train, again_eval, _ = load_splits(cfg(path, eval_fraction=0.25), tok, 64, 7)
    assert list(again_eval["completion"]) == list(eval_ds["completion"])
    assert list(again_train["completion"]) == list(train["completion"])
    _, other_eval, _ = load_splits(cfg(path, eval_fraction=0.25), tok, 64, 8)
    assert list(other_eval["completion"]) != list(eval_ds["completion"])
    user_error(
        r"data\.eval_fraction: 0\.99 of 40 rows .* leaves no rows to train on",
        load_splits,
        cfg(path, eval_fraction=0.99),
        tok,
        64,
        0,
    )
    user_error(r"data\.eval_fraction: 1\.5 is not a fraction", load_splits, cfg(path, eval_fraction=1.5), tok, 64, 0)


def test_eval_split_by_file(tmp_path, tok):
    train_path = write(tmp_path / "t.jsonl", ROWS["messages"])
    eval_path = write(tmp_path / "e.csv", ROWS["messages"][:2])
    train, eval_ds, stats = load_splits(cfg(train_path, eval_path=str(eval_path), eval_fraction=0.5), tok, 64, 0)
    assert len(train) == 3 and len(eval_ds) == 2  # eval_path wins over eval_fraction
    assert stats["eval_source"] == str(eval_path)
    other = write(tmp_path / "e2.jsonl", ROWS["text"])
    user_error(
        r"data\.eval_path: .*e2\.jsonl is in format text but data\.path is messages",
        load_splits,
        cfg(train_path, eval_path=str(other)),
        tok,
        64,
        0,
    )


# --------------------------------------------------------------------------------------------------
# Bad input: one line naming file, row and field
# --------------------------------------------------------------------------------------------------


def test_bad_json_line(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "no closing quote}\n')
    user_error(r"bad\.jsonl line 2: not valid JSON \(Unterminated string", load_splits, cfg(path), tok, 64, 0)


def test_missing_field(tmp_path, tok):
    rows = ROWS["prompt_completion"][:2] + [{"prompt": "order: ab\n"}]
    path = write(tmp_path / "p.jsonl", rows)
    user_error(r"p\.jsonl line 3: missing field 'completion'", load_splits, cfg(path), tok, 64, 0)
    # an explicit format names the field it needs
    user_error(r"p\.jsonl line 1: missing field 'text'", load_splits, cfg(path, format="text"), tok, 64, 0)
    # parquet nulls (a key absent from some rows) name the row index
    pq_path = write(tmp_path / "p.parquet", rows)
    user_error(r"p\.parquet row index 2: missing field 'completion'", load_splits, cfg(pq_path), tok, 64, 0)


def test_empty_file(tmp_path, tok):
    for name, content in (("e.jsonl", ""), ("blank.jsonl", "\n\n"), ("e.json", "[]"), ("e.csv", "")):
        path = tmp_path / name
        path.write_text(content)
        user_error(re.escape(str(path)) + r": empty, no rows", load_splits, cfg(path), tok, 64, 0)


def test_csv_with_header_but_no_rows(tmp_path, tok):
    path = tmp_path / "h.csv"
    path.write_text("prompt,completion\n")
    user_error(
        r"h\.csv: the CSV file has a header \(prompt, completion\) but no rows", load_splits, cfg(path), tok, 64, 0
    )


def test_csv_empty_cell(tmp_path, tok):
    path = tmp_path / "c.csv"
    path.write_text('prompt,completion\n"order: ba\n",ab\n"order: dc\n",\n')
    user_error(r"c\.csv row index 1: field 'completion' is an empty string", load_splits, cfg(path), tok, 64, 0)


def test_missing_path(tmp_path, tok):
    missing = tmp_path / "nope" / "train.jsonl"
    user_error(r"data\.path: .*nope/train\.jsonl does not exist", load_splits, cfg(missing), tok, 64, 0)
    ok = write(tmp_path / "ok.jsonl", ROWS["text"])
    user_error(
        r"data\.eval_path: .*missing\.jsonl does not exist",
        load_splits,
        cfg(ok, eval_path=str(tmp_path / "missing.jsonl")),
        tok,
        64,
        0,
    )


def test_wrong_type(tmp_path, tok):
    path = write(tmp_path / "w.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": 5, "completion": "b"}])
    user_error(r"w\.jsonl line 2: field 'prompt' must be a string, got int 5", load_splits, cfg(path), tok, 64, 0)
    path = write(tmp_path / "m.jsonl", [{"messages": "hello"}])
    user_error(r"m\.jsonl line 1: field 'messages' must be a list", load_splits, cfg(path), tok, 64, 0)
    path = write(tmp_path / "row.jsonl", [{"text": "a"}, ["b"]])
    user_error(r"row\.jsonl line 2: expected an object", load_splits, cfg(path), tok, 64, 0)


def test_empty_string(tmp_path, tok):
    path = write(tmp_path / "t.jsonl", [{"text": "a"}, {"text": "  "}])
    user_error(r"t\.jsonl line 2: field 'text' is an empty string", load_splits, cfg(path), tok, 64, 0)


def test_messages_problems(tmp_path, tok):
    def rows_with(bad):
        return [ROWS["messages"][0], {"messages": bad}]

    cases = [
        (
            [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}],
            r"line 2: field 'messages\[1\]\.role' is an unknown role 'bot'; use one of system, user, assistant",
        ),
        (
            [{"role": "user"}, {"role": "assistant", "content": "y"}],
            r"line 2: field 'messages\[0\]\.content' is missing",
        ),
        ([{"content": "x"}, {"role": "assistant", "content": "y"}], r"line 2: field 'messages\[0\]\.role' is missing"),
        (
            [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}],
            r"line 2: field 'messages\[0\]\.content' must be a string, got list",
        ),
        ([{"role": "user", "content": "x"}], r"line 2: field 'messages' has no assistant turn"),
        ([], r"line 2: field 'messages' is an empty list"),
    ]
    for bad, match in cases:
        path = write(tmp_path / "m.jsonl", rows_with(bad))
        user_error(r"m\.jsonl " + match, load_splits, cfg(path), tok, 64, 0)
    # CSV cells hold the list as JSON text
    path = tmp_path / "m.csv"
    path.write_text('messages\n"[{""role"": ""user"", ""content"": ""x""}, {""role"": ""assistant""}"\n')
    user_error(
        r"m\.csv row index 0: field 'messages' is a string that is not valid JSON", load_splits, cfg(path), tok, 64, 0
    )


def test_unknown_format_name(tmp_path, tok):
    path = write(tmp_path / "t.jsonl", ROWS["text"])
    user_error(
        r"data\.format: unknown format 'chatml'; use one of auto, alpaca, messages, sharegpt, prompt_completion, "
        r"text, preference, unpaired, prompt \(a chat template\? set data\.chat_template=chatml\)",
        load_splits,
        cfg(path, format="chatml"),
        tok,
        64,
        0,
    )
    user_error(r"data\.format: unknown format 'chatml'", format_kwargs, cfg(path), "chatml")


def test_hub_name_offline(monkeypatch, tok):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = user_error(
        r"data\.path: 'someorg/some-dataset' is not a local file or dir, and the hub dataset of that "
        r"name could not be reached",
        load_splits,
        cfg("someorg/some-dataset"),
        tok,
        64,
        0,
    )
    assert "pass a local .jsonl/.json/.csv/.parquet file" in msg


def test_hub_connection_error(monkeypatch, tok):
    import datasets

    from qlora_recipes.data import readers

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someorg/some-dataset' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(readers, "_hub_offline", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    user_error(
        r"could not be reached \(Couldn't reach .*\); pass a local",
        load_splits,
        cfg("someorg/some-dataset"),
        tok,
        64,
        0,
    )


def test_hub_dataset_goes_through_load_dataset(monkeypatch, tok):
    import datasets

    from qlora_recipes.data import readers

    calls = []

    def fake_load_dataset(name, split=None):
        calls.append((name, split))
        rows = [dict(r, image_id=i) for i, r in enumerate(ROWS["alpaca"])]
        full = DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])})
        return full if split is None else full[split]

    monkeypatch.setattr(readers, "_hub_offline", lambda: False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    train, eval_ds, stats = load_splits(cfg("someorg/alpaca-like", eval_path="someorg/alpaca-like"), tok, 512, 0)
    assert calls == [("someorg/alpaca-like", "train"), ("someorg/alpaca-like", None)]
    assert stats["format"] == "alpaca" and stats["source"] == "hub:someorg/alpaca-like (split train)"
    assert stats["eval_source"] == "hub:someorg/alpaca-like (split test)"
    assert (len(train), len(eval_ds)) == (3, 1) and rows_of(train)[0].keys() == {"prompt", "completion"}


# --------------------------------------------------------------------------------------------------
# format_kwargs / generation_pairs
# --------------------------------------------------------------------------------------------------


def test_sft_kwargs():
    on = DataConfig(path="x", packing=True)
    off = DataConfig(path="x", completion_only_loss=False)
    assert format_kwargs(on, "prompt_completion") == {
        "packing": True,
        "packing_strategy": "bfd",
        "padding_free": False,
        "dataset_text_field": "text",
        "completion_only_loss": True,
        "assistant_only_loss": False,
    }
    assert format_kwargs(on, "alpaca")["completion_only_loss"] is True
    assert format_kwargs(off, "alpaca")["completion_only_loss"] is False
    assert format_kwargs(on, "messages")["assistant_only_loss"] is True
    assert format_kwargs(off, "messages")["assistant_only_loss"] is False
    assert format_kwargs(on, "text")["completion_only_loss"] is False
    assert format_kwargs(off, "text")["packing"] is False

    from trl import SFTConfig

    fields = set(SFTConfig.__dataclass_fields__)
    for fmt in ("alpaca", "messages", "prompt_completion", "text"):
        assert set(format_kwargs(on, fmt)) <= fields


def test_generation_pairs(tmp_path, tok):
    _, ev, _ = load_splits(cfg(write(tmp_path / "m.jsonl", ROWS["messages"]), eval_fraction=0.5), tok, 64, 0)
    pairs = generation_pairs(Dataset.from_list(ROWS["messages"]), "messages", 2)
    assert pairs == [
        ([{"role": "user", "content": "sort: cba"}], "abc"),
        (ROWS["messages"][1]["messages"][:4], "z"),
    ]
    assert len(generation_pairs(ev, "messages", 64)) == len(ev)
    pc = Dataset.from_list(ROWS["prompt_completion"])
    assert generation_pairs(pc, "prompt_completion", 1) == [("order: cba\n", "abc")]
    assert generation_pairs(pc, "alpaca", 0) == []
    assert generation_pairs(Dataset.from_list(ROWS["text"]), "text", 10) == []
    assert generation_pairs(None, "prompt_completion", 10) == []


# --------------------------------------------------------------------------------------------------
# The labels TRL builds from these datasets
# --------------------------------------------------------------------------------------------------


def sft_trainer(tmp_path, tok, train, data_cfg, fmt, max_length=64):
    """TRL's own SFTTrainer on the tiny model over `train`, with the SFTConfig fields format_kwargs gives."""
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_length=max_length,
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=16,
        disable_tqdm=True,
        **format_kwargs(data_cfg, fmt),
    )
    model = AutoModelForCausalLM.from_pretrained(TINY)
    return SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok)


def trl_batch(tmp_path, tok, train, data_cfg, fmt, max_length=64):
    """One batch of everything in `train` through TRL's own SFTTrainer data pipeline, as
    {input_ids: labels} without padding."""
    trainer = sft_trainer(tmp_path, tok, train, data_cfg, fmt, max_length)
    batch = next(iter(trainer.get_train_dataloader()))
    out = {}
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        n = int(mask.sum())
        assert labels[n:].eq(-100).all()
        out[tuple(ids[:n].tolist())] = labels[:n].tolist()
    return trainer, out


def check_runs(tok, ids, labels, expected_runs):
    """Labels keep the token id wherever they are not -100, and the unmasked runs decode to expected_runs."""
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == -100:
            if current:
                runs.append(current)
                current = []
        else:
            assert label == token
            current.append(label)
    if current:
        runs.append(current)
    assert [tok.decode(r) for r in runs] == expected_runs


@pytest.mark.parametrize("fmt", ["prompt_completion", "alpaca"])
def test_prompt_completion_labels_mask_the_prompt(tmp_path, tok, fmt):
    path = write(tmp_path / "d.jsonl", ROWS[fmt])
    data_cfg = cfg(path)
    train, _, stats = load_splits(data_cfg, tok, 512, 0)
    _, batch = trl_batch(tmp_path, tok, train, data_cfg, stats["format"], max_length=512)
    assert len(batch) == 3
    for row in train:
        # TRL: BOS (the tokenizer's) + prompt + completion + EOS; the prompt's tokens are masked
        ids = tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]
        n_prompt = len(tok(row["prompt"])["input_ids"])
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert batch[tuple(ids)] == [-100] * n_prompt + ids[n_prompt:]
        check_runs(tok, ids, batch[tuple(ids)], [row["completion"] + tok.eos_token])


def test_packing_keeps_the_completion_labels(tmp_path, tok):
    data_cfg = cfg(write(tmp_path / "d.jsonl", ROWS["prompt_completion"]), packing=True)
    train, _, stats = load_splits(data_cfg, tok, 64, 0)
    trainer = sft_trainer(tmp_path, tok, train, data_cfg, stats["format"])
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert len(ids) == sum(len(tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"]) for r in train)
    runs = sorted(tok.decode([t for t in labels[s:e] if t != -100]) for s, e in _spans(batch["position_ids"][0]))
    assert runs == sorted(r["completion"] + tok.eos_token for r in train)


def _spans(position_ids):
    starts = [i for i, p in enumerate(position_ids.tolist()) if p == 0] + [len(position_ids)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def test_prompt_completion_full_loss_when_disabled(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", ROWS["prompt_completion"])
    data_cfg = cfg(path, completion_only_loss=False)
    train, _, stats = load_splits(data_cfg, tok, 64, 0)
    _, batch = trl_batch(tmp_path, tok, train, data_cfg, stats["format"])
    for ids, labels in batch.items():
        assert list(ids) == labels


def test_messages_labels_cover_assistant_turns_only(tmp_path, tok):
    path = write(tmp_path / "m.jsonl", ROWS["messages"])
    data_cfg = cfg(path)
    train, _, stats = load_splits(data_cfg, tok, 128, 0)
    _, batch = trl_batch(tmp_path, tok, train, data_cfg, stats["format"], max_length=128)
    assert len(batch) == 3
    for row in ROWS["messages"]:
        ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        labels = batch[tuple(ids)]
        # exactly the assistant contents (and their end-of-turn token) are trained; everything else is -100
        turns = [m["content"] + tok.eos_token for m in row["messages"] if m["role"] == "assistant"]
        check_runs(tok, ids, labels, turns)
        assert sum(label != -100 for label in labels) == sum(
            len(tok(t, add_special_tokens=False)["input_ids"]) for t in turns
        )


def test_chat_prompt_completion_labels(tmp_path, tok):
    rows = [
        {"prompt": [{"role": "user", "content": "sort: cba"}], "completion": [{"role": "assistant", "content": "abc"}]},
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "max: ab"}],
            "completion": [{"role": "assistant", "content": "b"}],
        },
    ]
    data_cfg = cfg(write(tmp_path / "c.jsonl", rows))
    train, _, stats = load_splits(data_cfg, tok, 64, 0)
    _, batch = trl_batch(tmp_path, tok, train, data_cfg, stats["format"])
    for row in rows:
        ids = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
        # TRL trains on everything after the prompt: the reply, EOS and the template's newline.
        check_runs(tok, ids, batch[tuple(ids)], [row["completion"][0]["content"] + tok.eos_token + "\n"])


def test_text_labels_are_the_whole_sequence(tmp_path, tok):
    path = write(tmp_path / "t.jsonl", ROWS["text"])
    data_cfg = cfg(path)
    train, _, stats = load_splits(data_cfg, tok, 64, 0)
    _, batch = trl_batch(tmp_path, tok, train, data_cfg, stats["format"])
    for row in ROWS["text"]:
        ids = tok(row["text"] + tok.eos_token)["input_ids"]
        assert batch[tuple(ids)] == ids


def test_truncation_is_counted_like_trl_does_it(tmp_path, tok, caplog):
    rows = [
        {"prompt": "order: ab\n", "completion": "ab"},  # 1 + 10 + 2 + 1 = 14 tokens: fits
        {"prompt": "order: cb\n", "completion": "x" * 30},  # 41 tokens: truncated, completion partly kept
        {"prompt": "y" * 40, "completion": "z"},  # prompt alone is over: no completion token left
    ]
    data_cfg = cfg(write(tmp_path / "long.jsonl", rows))
    with caplog.at_level("WARNING", logger="qlora_recipes.data"):
        train, _, stats = load_splits(data_cfg, tok, 24, 0)
    assert stats["over_seq_len"] == {"train": 2, "eval": 0}
    assert stats["dropped_by_truncation"] == {"train": 1, "eval": 0}
    assert stats["max_tokens"]["train"] == 43
    assert "2 of 3 train examples are longer than trainer.seq_len=24" in caplog.text
    assert "1 of them have no completion token left" in caplog.text
    trainer, batch = trl_batch(tmp_path, tok, train, data_cfg, stats["format"], max_length=24)
    assert len(trainer.train_dataset) == 2  # TRL dropped exactly the one we counted
    assert sorted(len(ids) for ids in batch) == [14, 24]

    only_long = cfg(write(tmp_path / "all_long.jsonl", rows[2:]))
    user_error(
        r"trainer\.seq_len: at 24 tokens no train example keeps a completion token", load_splits, only_long, tok, 24, 0
    )


# --------------------------------------------------------------------------------------------------
# ShareGPT, chat templates (data.chat_template) and their label masks
# --------------------------------------------------------------------------------------------------

SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "sort: cba"},
            {"from": "gpt", "value": "abc"},
        ]
    },
    {
        "conversations": [
            {"from": "User", "value": "hi"},
            {"from": "ChatGPT", "value": "yo"},
            {"from": "user", "value": "max: abz"},
            {"from": "assistant", "value": "z"},
        ]
    },
    {"conversations": [{"from": "human", "value": "first: qrs"}, {"from": "bot", "value": "q"}]},
    {"conversations": [{"from": "human", "value": "last: qrs"}, {"from": "model", "value": "s"}]},
]


def test_sharegpt_rows_become_messages_from_every_source(tmp_path, tok):
    expected = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "sort: cba"},
            {"role": "assistant", "content": "abc"},
        ],
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "max: abz"},
            {"role": "assistant", "content": "z"},
        ],
        [{"role": "user", "content": "first: qrs"}, {"role": "assistant", "content": "q"}],
        [{"role": "user", "content": "last: qrs"}, {"role": "assistant", "content": "s"}],
    ]
    for kind in (".jsonl", ".json", ".csv", ".parquet"):
        path = write(tmp_path / f"sg{kind}", SHAREGPT, kind)
        for fmt in ("auto", "sharegpt"):
            train, _, stats = load_splits(cfg(path, format=fmt), tok, 256, 0)
            assert stats["format"] == "messages" and stats["detected"] == "sharegpt" and stats["conversational"]
            assert train["messages"] == expected, kind
    # ShareGPT turns under a `messages` key are read as ShareGPT too
    under_messages = [{"messages": r["conversations"]} for r in SHAREGPT]
    train, _, stats = load_splits(cfg(write(tmp_path / "m.jsonl", under_messages)), tok, 256, 0)
    assert stats["detected"] == "sharegpt" and train["messages"] == expected
    # and what TRL is told: assistant-only loss, like messages
    assert format_kwargs(cfg("x"), "sharegpt") == format_kwargs(cfg("x"), "messages")
    assert generation_pairs(train, "sharegpt", 1) == [(expected[0][:2], "abc")]


def test_sharegpt_problems_name_the_turn(tmp_path, tok):
    cases = [
        (
            [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}],
            r"'conversations\[1\]\.from' is an unknown",
        ),
        ([{"from": "human", "value": "x"}, {"value": "y"}], r"'conversations\[1\]\.from' is missing"),
        ([{"from": "human", "value": "x"}, {"from": "gpt"}], r"'conversations\[1\]\.value' is missing"),
        (
            [{"from": "human", "value": "x"}, {"from": "gpt", "value": 3}],
            r"'conversations\[1\]\.value' must be a string",
        ),
        ([{"from": "human", "value": "x"}], r"field 'conversations' has no gpt/assistant turn"),
        ("hello", r"field 'conversations' must be a list of \{from, value\}"),
    ]
    for bad, match in cases:
        path = write(tmp_path / "s.jsonl", [SHAREGPT[0], {"conversations": bad}])
        user_error(r"s\.jsonl line 2: field " + match.removeprefix("field "), load_splits, cfg(path), tok, 256, 0)


def _labelled_runs(tok, ids, labels):
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label == -100:
            if current:
                runs.append(current)
                current = []
        else:
            assert label == token
            current.append(label)
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


@pytest.mark.parametrize(
    "template, end",
    [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("gemma", "<end_of_turn>"), ("mistral", "</s>")],
)
def test_builtin_templates_train_on_assistant_turns_only(tmp_path, tok, template, end):
    """ShareGPT data through data.chat_template=<built-in> and TRL's own SFTTrainer pipeline: the labels keep
    exactly each assistant reply and its end-of-turn marker (so the model learns to stop); system, user
    turns and role headers are -100."""
    from transformers import AutoTokenizer

    from qlora_recipes.data.chat import BUILTIN_TEMPLATES, end_of_turn

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data_cfg = cfg(write(tmp_path / "sg.jsonl", SHAREGPT), chat_template=template)
    train, _, stats = load_splits(data_cfg, tokenizer, 256, 0)
    assert stats["chat_template"] == f"built-in {template}"
    assert tokenizer.chat_template == BUILTIN_TEMPLATES[template]  # what TRL and the saved tokenizer use
    assert end_of_turn(tokenizer) == end
    _, batch = trl_batch(tmp_path, tokenizer, train, data_cfg, stats["format"], max_length=256)
    assert len(batch) == len(SHAREGPT)
    for messages in train["messages"]:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        lead = " " if template == "mistral" else ""
        replies = [lead + m["content"] + end for m in messages if m["role"] == "assistant"]
        assert _labelled_runs(tokenizer, ids, batch[tuple(ids)]) == replies
        for m in messages:  # no user or system text is trained
            if m["role"] != "assistant":
                assert all(m["content"] not in run for run in replies)


def test_chat_template_from_a_file_and_bad_options(tmp_path, tok):
    from transformers import AutoTokenizer

    from qlora_recipes.data.chat import CHATML

    path = tmp_path / "mine.jinja"
    path.write_text(CHATML.replace("<|im_start|>", "<<").replace("<|im_end|>", ">>"))
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    train, _, stats = load_splits(
        cfg(write(tmp_path / "sg.jsonl", SHAREGPT), chat_template=str(path)), tokenizer, 256, 0
    )
    assert stats["chat_template"] == str(path) and tokenizer.chat_template.startswith("{%- for message")
    text = tokenizer.apply_chat_template(train["messages"][2], tokenize=False)
    assert text == "<<user\nfirst: qrs>>\n<<assistant\nq>>\n"
    user_error(
        r"data\.chat_template=nope: not a built-in template \(chatml, llama3, gemma, mistral, or tokenizer",
        load_splits,
        cfg(write(tmp_path / "sg.jsonl", SHAREGPT), chat_template="nope"),
        tokenizer,
        256,
        0,
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    user_error(
        r"data\.chat_template \(.*broken\.jinja\): the template does not render",
        load_splits,
        cfg(write(tmp_path / "sg.jsonl", SHAREGPT), chat_template=str(broken)),
        AutoTokenizer.from_pretrained(TINY),
        256,
        0,
    )


@pytest.mark.parametrize("rows", ["sharegpt", "messages", "chat_prompt_completion"])
def test_chat_data_without_a_template_names_the_option(tmp_path, rows):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.chat_template = None  # a base model's tokenizer
    data = {
        "sharegpt": SHAREGPT,
        "messages": ROWS["messages"],
        "chat_prompt_completion": [
            {"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}]}
        ]
        * 2,
    }[rows]
    path = write(tmp_path / "c.jsonl", data)
    msg = user_error(
        r"chat data needs a chat template and this tokenizer has none; set data\.chat_template",
        load_splits,
        cfg(path),
        tokenizer,
        256,
        0,
    )
    assert "chatml" in msg and "llama3" in msg
    # the option fixes it
    _, _, stats = load_splits(cfg(path, chat_template="llama3"), tokenizer, 256, 0)
    assert stats["chat_template"] == "built-in llama3"


def test_tokenizer_template_without_generation_markers_points_at_the_builtins(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    user_error(
        r"no \{% generation %\} markers .* set data\.chat_template to a built-in \(chatml, llama3",
        load_splits,
        cfg(write(tmp_path / "m.jsonl", ROWS["messages"])),
        tokenizer,
        256,
        0,
    )


# --------------------------------------------------------------------------------------------------
# Rows over trainer.seq_len: truncated (counted) or dropped (data.too_long=drop), train and eval alike
# --------------------------------------------------------------------------------------------------

LONG_ROWS = [
    {"prompt": "order: ab\n", "completion": "ab"},  # 14 tokens
    {"prompt": "order: cb\n", "completion": "x" * 30},  # 41 tokens: over 24
    {"prompt": "order: dc\n", "completion": "cd"},
    {"prompt": "y" * 40, "completion": "z"},  # 43 tokens: over, nothing trained is left within 24
]


def test_too_long_rows_are_truncated_and_counted_in_train_and_eval(tmp_path, tok, caplog):
    path = write(tmp_path / "t.jsonl", LONG_ROWS)
    eval_path = write(tmp_path / "e.jsonl", LONG_ROWS[1:3])
    with caplog.at_level("INFO", logger="qlora_recipes.data"):
        train, eval_ds, stats = load_splits(cfg(path, eval_path=str(eval_path)), tok, 24, 0)
    assert stats["too_long"] == "truncate"
    assert stats["over_seq_len"] == {"train": 2, "eval": 1}
    assert stats["truncated"] == {"train": 1, "eval": 1}  # kept, cut to 24 tokens by TRL
    assert stats["dropped_by_truncation"] == {"train": 1, "eval": 0}  # TRL drops the one with no completion left
    assert stats["dropped_too_long"] == {"train": 0, "eval": 0}
    assert (len(train), len(eval_ds)) == (4, 2)
    assert "1 of 2 eval examples are longer than trainer.seq_len=24" in caplog.text
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(summary) == 1
    assert "over trainer.seq_len=24: 2 train / 1 eval rows truncated" in summary[0]


def test_too_long_drop_removes_them_from_train_and_eval(tmp_path, tok, caplog):
    path = write(tmp_path / "t.jsonl", LONG_ROWS)
    eval_path = write(tmp_path / "e.jsonl", LONG_ROWS[1:3])
    with caplog.at_level("INFO", logger="qlora_recipes.data"):
        train, eval_ds, stats = load_splits(cfg(path, eval_path=str(eval_path), too_long="drop"), tok, 24, 0)
    assert stats["dropped_too_long"] == {"train": 2, "eval": 1}
    assert stats["truncated"] == {"train": 0, "eval": 0} and stats["rows"] == {"train": 2, "eval": 1}
    assert list(train["completion"]) == ["ab", "cd"] and list(eval_ds["completion"]) == ["cd"]
    assert "2 of 4 train examples are longer than trainer.seq_len=24 tokens (longest 43) and are dropped" in caplog.text
    assert "2 train / 1 eval rows dropped" in caplog.text
    # nothing TRL would have to truncate is left
    trainer, batch = trl_batch(tmp_path, tok, train, cfg(path), stats["format"], max_length=24)
    assert len(trainer.train_dataset) == 2 and all(len(ids) <= 24 for ids in batch)
    user_error(
        r"trainer\.seq_len: all 2 train examples .* are longer than 24 tokens .* data\.too_long=drop drops them all",
        load_splits,
        cfg(write(tmp_path / "long.jsonl", LONG_ROWS[1::2]), too_long="drop"),
        tok,
        24,
        0,
    )
    user_error(r"data\.too_long='cut' is not an option", load_splits, cfg(path, too_long="cut"), tok, 24, 0)


# --------------------------------------------------------------------------------------------------
# The prompt format generation reuses
# --------------------------------------------------------------------------------------------------


def test_prompt_format_is_recorded_per_format(tmp_path, tok):
    from qlora_recipes.data.splits import common_affixes

    pc = [{"prompt": f"Q: {w}?\nA:", "completion": w} for w in ("sky", "sea", "sun")]
    _, _, stats = load_splits(cfg(write(tmp_path / "p.jsonl", pc)), tok, 64, 0)
    assert stats["prompt_format"] == {"style": "plain", "prefix": "Q: ", "suffix": "?\nA:"}
    _, _, stats = load_splits(cfg(write(tmp_path / "a.jsonl", ROWS["alpaca"])), tok, 512, 0)
    assert stats["prompt_format"] == {"style": "alpaca"}
    _, _, stats = load_splits(cfg(write(tmp_path / "s.jsonl", [SHAREGPT[0]] * 3)), tok, 256, 0)
    assert stats["prompt_format"] == {"style": "chat", "system": "be brief"}
    _, _, stats = load_splits(cfg(write(tmp_path / "s2.jsonl", SHAREGPT)), tok, 256, 0)
    assert stats["prompt_format"] == {"style": "chat", "system": None}  # not every conversation has it
    # a shared first letter of the content is not template
    assert common_affixes(["order: ab\n", "order: ac\n"]) == ("order: ", "\n")
    assert common_affixes(["sort", "sorted"]) == ("", "")
    assert common_affixes(["only one"]) == ("", "")
