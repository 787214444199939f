"""Tokenize once: load_splits hands TRL's SFTTrainer already-tokenized rows (`input_ids` plus
TRL's `completion_mask` / `assistant_masks`), and TRL does not tokenize them again. For every format the
ids and the loss mask TRL trains on are exactly those TRL's own tokenization of the same rows gives, the
truncation counts of the run summary are those the count-then-retokenize pipeline printed, and a large
split shows one progress bar while it is tokenized (a small one stays quiet)."""

import json
import re
from pathlib import Path

import pytest

from qlora_recipes.config.schema import DataConfig
from qlora_recipes.data import format_kwargs, load_splits
from qlora_recipes.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-llama"

# Rows of every format, some fitting, some truncated, some left with no trained token within SEQ_LEN.
CASES = {
    "prompt_completion": [
        {"prompt": "order: ab\n", "completion": "ab"},
        {"prompt": "order: cb\n", "completion": "x" * 30},
        {"prompt": "y" * 40, "completion": "z"},
        {"prompt": "sum: 2+2=", "completion": " 4"},
    ],
    "alpaca": [
        {"instruction": "Sort.", "input": "cba", "output": "abc"},
        {"instruction": "Say hi.", "output": "hi " * 30},
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
                {"role": "assistant", "content": "z" * 30},
            ]
        },
        {"messages": [{"role": "user", "content": "q" * 40}, {"role": "assistant", "content": "q"}]},
    ],
    "sharegpt": [
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "sort: cba"},
                {"from": "gpt", "value": "abc"},
            ]
        },
        {"conversations": [{"from": "human", "value": "w" * 40}, {"from": "gpt", "value": "w"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo " * 20}]},
    ],
    "chat_prompt_completion": [
        {"prompt": [{"role": "user", "content": "sort: cba"}], "completion": [{"role": "assistant", "content": "abc"}]},
        {"prompt": [{"role": "user", "content": "v" * 40}], "completion": [{"role": "assistant", "content": "v"}]},
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "max: ab"}],
            "completion": [{"role": "assistant", "content": "b " * 20}],
        },
    ],
    "text": [{"text": "copy: abc\nabc"}, {"text": "sort: " + "t" * 40}, {"text": "last: xyz\nz"}],
}
SEQ_LEN = {"prompt_completion": 24, "alpaca": 180, "messages": 40, "sharegpt": 40, "chat_prompt_completion": 40}
SEQ_LEN["text"] = 24

# What the pipeline before tokenize-once (count here, TRL tokenizes again) reported for CASES, train and eval
# alike (the eval file is the rows reversed): over_seq_len, truncated, dropped_by_truncation,
# dropped_too_long, max_tokens, rows; keyed by case, completion_only_loss, data.too_long.
BEFORE = {
    ("prompt_completion", True, "truncate"): (2, 1, 1, 0, 43, 4),
    ("prompt_completion", True, "drop"): (2, 0, 0, 2, 43, 2),
    ("prompt_completion", False, "truncate"): (2, 2, 0, 0, 43, 4),
    ("prompt_completion", False, "drop"): (2, 0, 0, 2, 43, 2),
    ("alpaca", True, "truncate"): (2, 1, 1, 0, 237, 3),
    ("alpaca", True, "drop"): (2, 0, 0, 2, 237, 1),
    ("alpaca", False, "truncate"): (2, 2, 0, 0, 237, 3),
    ("alpaca", False, "drop"): (2, 0, 0, 2, 237, 1),
    ("messages", True, "truncate"): (2, 1, 1, 0, 100, 3),
    ("messages", True, "drop"): (2, 0, 0, 2, 100, 1),
    ("messages", False, "truncate"): (2, 2, 0, 0, 100, 3),
    ("messages", False, "drop"): (2, 0, 0, 2, 100, 1),
    ("sharegpt", True, "truncate"): (3, 1, 2, 0, 83, 3),
    ("sharegpt", True, "drop"): "all 3 train examples of {path} are longer than 40 tokens (shortest 50)",
    ("sharegpt", False, "truncate"): (3, 3, 0, 0, 83, 3),
    ("sharegpt", False, "drop"): "all 3 train examples of {path} are longer than 40 tokens (shortest 50)",
    ("chat_prompt_completion", True, "truncate"): (2, 1, 1, 0, 78, 3),
    ("chat_prompt_completion", True, "drop"): (2, 0, 0, 2, 78, 1),
    ("chat_prompt_completion", False, "truncate"): (2, 2, 0, 0, 78, 3),
    ("chat_prompt_completion", False, "drop"): (2, 0, 0, 2, 78, 1),
    ("text", True, "truncate"): (1, 1, 0, 0, 48, 3),
    ("text", True, "drop"): (1, 0, 0, 1, 48, 2),
    ("text", False, "truncate"): (1, 1, 0, 0, 48, 3),
    ("text", False, "drop"): (1, 0, 0, 1, 48, 2),
}
FIGURES = ("over_seq_len", "truncated", "dropped_by_truncation", "dropped_too_long", "max_tokens", "rows")


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY)


def _files(tmp_path: Path, case: str) -> tuple[Path, Path]:
    rows = CASES[case]
    path, eval_path = tmp_path / f"{case}.jsonl", tmp_path / f"{case}_eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_path.write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))
    return path, eval_path


def _prepared(tmp_path, model, tok, dataset, data_cfg, fmt, max_length):
    """The train dataset as TRL's own SFTTrainer prepares it, under the SFTConfig training gives this data."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_length=max_length,
        report_to=[],
        bf16=False,
        disable_tqdm=True,
        per_device_train_batch_size=2,
        **format_kwargs(data_cfg, fmt),
    )
    return SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok).train_dataset


def _raw(ds):
    """The rows as they were before tokenizing: what TRL would have tokenized itself."""
    return ds.select_columns(
        [c for c in ds.column_names if c not in ("input_ids", "completion_mask", "assistant_masks")]
    )


@pytest.mark.parametrize("completion_only", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_pretokenized_rows_train_as_trls_own_tokenization(tmp_path, model, case, completion_only):
    """The ids and labels (the loss mask) TRL trains on from our rows equal those of TRL tokenizing the same
    untokenized rows itself: whole (max_length=None), and truncated to seq_len with its drops."""
    tok = _tokenizer()
    path, _ = _files(tmp_path, case)
    data_cfg = DataConfig(path=str(path), eval_fraction=0.0, completion_only_loss=completion_only)
    seq_len = SEQ_LEN[case]
    train, _, stats = load_splits(data_cfg, tok, seq_len, 0)
    mask = {"messages": "assistant_masks", "text": None}.get(stats["format"], "completion_mask")
    if stats["format"] == "messages" and not completion_only:
        mask = None  # no assistant-only loss: every token trains, as TRL's own tokenization gives
    assert {"input_ids", mask} - {None} <= set(train.column_names)
    for max_length in (None, seq_len):
        ours = _prepared(tmp_path, model, tok, train, data_cfg, stats["format"], max_length)
        trls = _prepared(tmp_path, model, tok, _raw(train), data_cfg, stats["format"], max_length)
        assert ours["input_ids"] == trls["input_ids"], (case, max_length)
        assert ours["labels"] == trls["labels"], (case, max_length)
        if max_length is None:
            whole = trls
    # the counts agree with what TRL does: rows longer than seq_len, and the ones its truncation drops
    assert stats["over_seq_len"]["train"] == sum(len(ids) > seq_len for ids in whole["input_ids"])
    assert stats["dropped_by_truncation"]["train"] == len(whole) - len(trls)
    assert stats["max_tokens"]["train"] == max(len(ids) for ids in whole["input_ids"])


def test_packed_rows_match_too(tmp_path, model):
    tok = _tokenizer()
    path, _ = _files(tmp_path, "prompt_completion")
    data_cfg = DataConfig(path=str(path), eval_fraction=0.0, packing=True)
    train, _, stats = load_splits(data_cfg, tok, 24, 0)
    ours = _prepared(tmp_path, model, tok, train, data_cfg, stats["format"], 24)
    trls = _prepared(tmp_path, model, tok, _raw(train), data_cfg, stats["format"], 24)
    assert ours.to_list() == trls.to_list()


def test_trl_trains_on_our_ids_and_does_not_tokenize_again(tmp_path, model):
    """Rewrite the text of our tokenized rows: TRL still trains on the ids load_splits made."""
    tok = _tokenizer()
    path, _ = _files(tmp_path, "text")
    data_cfg = DataConfig(path=str(path), eval_fraction=0.0)
    train, _, stats = load_splits(data_cfg, tok, 64, 0)
    changed = train.map(lambda row: {"text": "something else entirely"})
    prepared = _prepared(tmp_path, model, tok, changed, data_cfg, stats["format"], 64)
    assert prepared["input_ids"] == train["input_ids"]
    assert prepared["input_ids"][0] == tok(CASES["text"][0]["text"] + tok.eos_token)["input_ids"]


def test_a_prompt_rendered_apart_from_its_completion_is_warned_once_and_split_as_trl_does(tmp_path, model, caplog):
    """A chat template whose generation prompt differs from the rendered reply's header: TRL starts the
    completion where the two diverge (and warned); so do we, with one line per split."""
    tok = _tokenizer()
    template = tok.chat_template.replace("assistant: {% endif %}", "Assistant: {% endif %}")
    assert template != tok.chat_template
    path, _ = _files(tmp_path, "chat_prompt_completion")
    data_cfg = DataConfig(path=str(path), eval_fraction=0.0, chat_template=template)
    with caplog.at_level("WARNING", logger="qlora_recipes.data"):
        train, _, stats = load_splits(data_cfg, tok, 200, 0)
    assert caplog.text.count("the tokenized prompt is not the start of the tokenized prompt+completion") == 1
    assert "3 of 3 train examples" in caplog.text
    ours = _prepared(tmp_path, model, tok, train, data_cfg, stats["format"], 200)
    trls = _prepared(tmp_path, model, tok, _raw(train), data_cfg, stats["format"], 200)
    assert ours["input_ids"] == trls["input_ids"] and ours["labels"] == trls["labels"]


def test_assistant_turns_outside_the_generation_markers_are_one_line(tmp_path):
    """TRL raised a RuntimeError (a traceback) for a conversation with no assistant token in its mask."""
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{% endgeneration %}{% endif %}\n{% endfor %}"
    )
    path, _ = _files(tmp_path, "messages")
    with pytest.raises(UserError, match=r"messages\.jsonl: train example 0: no token of its assistant turns") as err:
        load_splits(DataConfig(path=str(path), eval_fraction=0.0, chat_template=template), _tokenizer(), 64, 0)
    assert "\n" not in str(err.value) and "data.completion_only_loss=false" in str(err.value)


@pytest.mark.parametrize("too_long", ["truncate", "drop"])
@pytest.mark.parametrize("completion_only", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_truncation_counts_in_the_run_summary_are_unchanged(tmp_path, caplog, case, completion_only, too_long):
    path, eval_path = _files(tmp_path, case)
    data_cfg = DataConfig(
        path=str(path),
        eval_path=str(eval_path),
        eval_fraction=0.0,
        completion_only_loss=completion_only,
        too_long=too_long,
    )
    expected = BEFORE[(case, completion_only, too_long)]
    if isinstance(expected, str):
        with pytest.raises(UserError, match=re.escape("trainer.seq_len: " + expected.format(path=path))):
            load_splits(data_cfg, _tokenizer(), SEQ_LEN[case], 0)
        return
    with caplog.at_level("INFO", logger="qlora_recipes.data"):
        train, eval_ds, stats = load_splits(data_cfg, _tokenizer(), SEQ_LEN[case], 0)
    assert tuple(stats[k]["train"] for k in FIGURES) == expected
    assert tuple(stats[k]["eval"] for k in FIGURES) == expected
    assert (len(train), len(eval_ds)) == (expected[-1], expected[-1])
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    done = "dropped" if too_long == "drop" else "truncated"
    assert summary[0].endswith(
        f"over trainer.seq_len={SEQ_LEN[case]}: {expected[0]} train / {expected[0]} eval rows {done}"
    )
    if (case, completion_only, too_long) == ("prompt_completion", True, "truncate"):
        assert (
            "2 of 4 train examples are longer than trainer.seq_len=24 tokens (longest 43); TRL keeps their first "
            "24 tokens (truncated to max_length); 1 of them have no completion token left within 24 tokens and TRL "
            "drops them; raise trainer.seq_len to keep them whole, or data.too_long=drop to leave them out"
        ) in caplog.text


def test_a_streamed_file_is_tokenized_into_datasets_cache_as_in_memory(tmp_path, monkeypatch):
    """A large source becomes a memory-mapped Arrow file (formats.IN_MEMORY_BYTES); its tokens go to
    datasets' cache beside it, the same rows and counts as in memory, again on a second load."""
    import datasets.config

    from qlora_recipes.data import formats

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path, eval_path = _files(tmp_path, "messages")
    data_cfg = DataConfig(path=str(path), eval_path=str(eval_path), eval_fraction=0.0)
    in_memory = load_splits(data_cfg, _tokenizer(), 40, 0)
    assert not in_memory[0].cache_files
    monkeypatch.setattr(formats, "IN_MEMORY_BYTES", 0)  # stream this small file as a large one is
    for _ in range(2):
        train, eval_ds, stats = load_splits(data_cfg, _tokenizer(), 40, 0)
        assert train.cache_files and eval_ds.cache_files  # on disk, memory-mapped
        assert train.to_list() == in_memory[0].to_list() and eval_ds.to_list() == in_memory[1].to_list()
        assert stats == in_memory[2]


def test_untokenized_without_a_tokenizer(tmp_path):
    """Callers that only want the rows (the prompt format, merge's quality check) get them as they were."""
    path, _ = _files(tmp_path, "prompt_completion")
    train, _, stats = load_splits(DataConfig(path=str(path), eval_fraction=0.0), None, 24, 0)
    assert train.column_names == ["prompt", "completion"] and stats["over_seq_len"] is None


# --------------------------------------------------------------------------------------------------
# Progress while tokenizing
# --------------------------------------------------------------------------------------------------


def _bars_left_to_us():
    import datasets.config

    if datasets.config.HF_DATASETS_DISABLE_PROGRESS_BARS is not None:
        pytest.skip("HF_DATASETS_DISABLE_PROGRESS_BARS is set in this environment: it decides, not us")


def test_a_large_split_shows_one_tokenizing_bar(tmp_path, capfd):
    from datasets.utils import are_progress_bars_disabled

    from qlora_recipes.data.tokens import PROGRESS_ROWS

    _bars_left_to_us()
    n = PROGRESS_ROWS + 1
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(n)))
    train, _, _ = load_splits(DataConfig(path=str(path), eval_fraction=0.0), _tokenizer(), 16, 0)
    err = capfd.readouterr().err
    assert f"tokenizing train ({n} rows)" in err
    assert "Generating" not in err and "Map" not in err  # the one bar: reading and converting stay quiet
    assert are_progress_bars_disabled()  # TRL's passes over it, after, stay quiet
    assert len(train) == n


def test_a_small_split_and_trls_passes_stay_quiet(tmp_path, model, capfd):
    from datasets.utils import are_progress_bars_disabled

    _bars_left_to_us()
    path, _ = _files(tmp_path, "prompt_completion")
    data_cfg = DataConfig(path=str(path), eval_fraction=0.0)
    train, _, stats = load_splits(data_cfg, _tokenizer(), 24, 0)
    _prepared(tmp_path, model, _tokenizer(), train, data_cfg, stats["format"], 24)
    err = capfd.readouterr().err
    assert "tokenizing" not in err and "examples/s" not in err and "Truncating" not in err
    assert are_progress_bars_disabled()
