"""Training data: load, validate and shape it into datasets TRL's `SFTTrainer` takes as they are.

Sources (`data.path`, `data.eval_path`): a local `.jsonl` / `.json` / `.csv` / `.parquet` file, a
local dir (written by `datasets.save_to_disk`, or holding data files), or a hub dataset name.

Formats (`data.format`; `auto` reads the first row's keys):

- `alpaca`: `instruction`, optional `input`, `output` -> `prompt`/`completion` with the Alpaca template
- `messages`: `messages`, a list of `{role, content}` -> rendered by the tokenizer's chat template
- `prompt_completion`: `prompt`, `completion` (strings, or lists of messages for chat prompts)
- `text`: `text`, plain language modelling

Every row is checked before training starts. A bad row stops the run with one line naming the file,
the row (1-based line number for `.jsonl`, 0-based row index otherwise) and the field. Nothing is
dropped here; TRL truncates to `trainer.seq_len` (`max_length`) itself, and `load_splits` counts how
many examples that touches (and how many TRL then drops for having no trained token left) so the
log says so.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from datasets import Dataset

from .errors import UserError

log = logging.getLogger(__name__)

FORMATS = ("alpaca", "messages", "prompt_completion", "text")
FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")
ROLES = ("system", "user", "assistant", "tool")
EVAL_SPLIT_NAMES = ("validation", "valid", "val", "eval", "test", "dev")

FORMAT_FIELDS = {
    "alpaca": "instruction, [input], output",
    "messages": "messages",
    "prompt_completion": "prompt, completion",
    "text": "text",
}

# The standard Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py).
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def alpaca_prompt(instruction: str, input: str | None = None) -> str:
    """The Alpaca prompt for one row (the variant with an `### Input:` block when `input` is set)."""
    if input:
        return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


# --------------------------------------------------------------------------------------------------
# Reading sources into rows
# --------------------------------------------------------------------------------------------------


class _Rows:
    """Raw rows from one source, and how to name a row in an error message."""

    def __init__(self, label: str, rows: list[Any], line_numbers: list[int] | None = None):
        self.label = label  # the file (or dataset) as the user should see it
        self.rows = rows
        self.line_numbers = line_numbers  # .jsonl: the 1-based line of each row
        self.text_cells = False  # CSV: every cell is a string, lists come as JSON text

    def where(self, i: int) -> str:
        if self.line_numbers is not None:
            return f"{self.label} line {self.line_numbers[i]}"
        return f"{self.label} row index {i}"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_jsonl_text(label: str, text: str) -> _Rows:
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{label} line {number}: not valid JSON ({err.msg}: column {err.colno}); "
                "fix or remove that line (each line must be one JSON object)"
            ) from None
        rows.append(row)
        lines.append(number)
    return _Rows(label, rows, lines)


def _read_text(path: Path, label: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise UserError(f"{label}: cannot be read ({err.strerror or err}); check the file's permissions") from None


def _read_json(path: Path, label: str) -> _Rows:
    text = _read_text(path, label)
    if not text.strip():
        return _Rows(label, [])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        # JSON lines saved as .json: read it as such, naming lines.
        first = text.lstrip().splitlines()[0]
        try:
            is_lines = isinstance(json.loads(first), dict) and len(text.strip().splitlines()) > 1
        except json.JSONDecodeError:
            is_lines = False
        if is_lines:
            return _read_jsonl_text(label, text)
        raise UserError(
            f"{label}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
            "the file must hold a list of objects, or one JSON object per line"
        ) from None
    if isinstance(data, dict):
        lists = [key for key, value in data.items() if isinstance(value, list)]
        if len(lists) == 1:  # {"data": [...]}
            data = data[lists[0]]
        else:
            raise UserError(
                f"{label}: the top level is an object with keys {sorted(data)}; "
                "it must be a list of row objects (or an object holding exactly one such list)"
            )
    if not isinstance(data, list):
        raise UserError(f"{label}: the top level is a {type(data).__name__}; it must be a list of row objects")
    return _Rows(label, data)


def _read_csv(path: Path, label: str) -> _Rows:
    import pandas as pd

    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        return _Rows(label, [])
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    except (pd.errors.ParserError, ValueError) as err:
        raise UserError(f"{label}: not a readable CSV file ({_one_line(err)}); check quoting and delimiters") from None
    if len(frame) == 0:
        raise UserError(
            f"{label}: the CSV file has a header ({', '.join(map(str, frame.columns))}) but no rows; "
            "add examples below the header"
        )
    rows = _Rows(label, frame.to_dict(orient="records"))
    rows.text_cells = True
    return rows


def _read_parquet(path: Path, label: str) -> _Rows:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
        raise UserError(f"{label}: not a readable Parquet file ({_one_line(err)})") from None
    return _Rows(label, table.to_pylist())


def _read_file(path: Path) -> _Rows:
    label = str(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl_text(label, _read_text(path, label))
    if suffix == ".json":
        return _read_json(path, label)
    if suffix == ".csv":
        return _read_csv(path, label)
    if suffix == ".parquet":
        return _read_parquet(path, label)
    raise UserError(
        f"{label}: unsupported file type '{path.suffix}'; use one of {', '.join(FILE_TYPES)}, "
        "a dataset dir, or a hub dataset name"
    )


KNOWN_FIELDS = ("messages", "prompt", "completion", "instruction", "input", "output", "text")


def _rows_from_dataset(label: str, ds: Any) -> _Rows:
    """Rows of a loaded `datasets.Dataset`, reading only the columns some format uses (hub datasets often
    carry others, e.g. images); with none of them, the first row whole, for the detection error."""
    columns = [c for c in ds.column_names if c in KNOWN_FIELDS]
    if not columns:
        return _Rows(label, ds.select(range(min(1, len(ds)))).to_list())
    return _Rows(label, ds.select_columns(columns).to_list())


def _pick_split(label: str, available: list[str], wanted: tuple[str, ...], field: str) -> str | None:
    for name in wanted:
        if name in available:
            return name
    if field == "data.eval_path":
        if len(available) == 1:
            return available[0]
        hint = "name the eval split 'validation' or 'test', or pass an eval file"
    else:
        hint = "set data.split to one of them"
    raise UserError(f"{label}: has splits {available}, none named {'/'.join(wanted)}; {hint}")


def _split_files(files: list[Path], root: Path, wanted: tuple[str, ...]) -> list[Path]:
    """Of a dir's data files, those named after the wanted split (`train.jsonl`, `train-0001.parquet`,
    `train/…`); all of them when none is."""
    for name in wanted:
        picked = []
        for f in files:
            stem = f.name.lower().split(".")[0]
            parts = [p.lower() for p in f.relative_to(root).parts[:-1]]
            if stem == name or stem.startswith((name + "-", name + "_")) or name in parts:
                picked.append(f)
        if picked:
            return picked
    return files


def _read_dir(path: Path, wanted: tuple[str, ...], field: str) -> tuple[_Rows, str]:
    label = str(path)
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        from datasets import DatasetDict, load_from_disk

        try:
            loaded = load_from_disk(str(path))
        except Exception as err:
            raise UserError(f"{label}: a saved dataset dir that cannot be loaded ({_one_line(err)})") from None
        if isinstance(loaded, DatasetDict):
            split = _pick_split(label, list(loaded.keys()), wanted, field)
            return _rows_from_dataset(f"{label} (split {split})", loaded[split]), f"{label} (split {split})"
        return _rows_from_dataset(label, loaded), label
    files = sorted(
        f
        for f in path.rglob("*")
        if f.is_file()
        and f.suffix.lower() in FILE_TYPES
        and not any(part.startswith(".") for part in f.relative_to(path).parts)
    )
    if not files:
        raise UserError(
            f"{field}: the dir {label} holds no {'/'.join(FILE_TYPES)} files and is not a dataset saved with "
            "save_to_disk; point it at a data file or a dataset dir"
        )
    files = _split_files(files, path, wanted)
    parts = [_read_file(f) for f in files]
    if len(parts) == 1:
        return parts[0], str(files[0])
    return _Concat(parts), f"{label} ({len(files)} files)"


class _Concat(_Rows):
    """Rows of several files, each still named by its own file and line."""

    def __init__(self, parts: list[_Rows]):
        super().__init__(", ".join(p.label for p in parts), [r for p in parts for r in p.rows])
        self._parts = parts
        self.text_cells = any(p.text_cells for p in parts)

    def where(self, i: int) -> str:
        for part in self._parts:
            if i < len(part.rows):
                return part.where(i)
            i -= len(part.rows)
        raise IndexError(i)


def _hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    if value in ("1", "ON", "YES", "TRUE"):
        return True
    try:
        import datasets.config

        return bool(datasets.config.HF_HUB_OFFLINE)
    except Exception:
        return False


def _looks_local(spec: str) -> bool:
    """A path the user meant as a local file or dir (rather than a hub `org/name`)."""
    return (
        spec.startswith(("/", ".", "~", "\\"))
        or Path(spec).suffix.lower() in FILE_TYPES + (".gz", ".txt", ".tsv", ".arrow", ".zst")
        or spec.count("/") > 1
        or (len(spec) > 1 and spec[1] == ":")
    )


def _read_hub(name: str, split: str | None, field: str) -> tuple[_Rows, str]:
    unreachable = f"{field}: '{name}' is not a local file or dir, and the hub dataset of that name could not be reached"
    fix = "pass a local .jsonl/.json/.csv/.parquet file or dataset dir instead (or check the path)"
    if _hub_offline():
        raise UserError(f"{unreachable} (HF_HUB_OFFLINE=1 is set); {fix}")
    import datasets

    try:
        loaded = datasets.load_dataset(name, split=split)
    except ConnectionError as err:  # also what datasets raises for OfflineModeIsEnabled / no network
        raise UserError(f"{unreachable} ({_one_line(err)}); {fix}") from None
    except Exception as err:
        raise UserError(f"{field}: the hub dataset '{name}' could not be loaded ({_one_line(err)}); {fix}") from None
    if isinstance(loaded, datasets.DatasetDict):
        picked = _pick_split(f"hub dataset '{name}'", list(loaded.keys()), EVAL_SPLIT_NAMES, field)
        loaded, split = loaded[picked], picked
    label = f"hub dataset '{name}' split '{split}'"
    return _rows_from_dataset(label, loaded), f"hub:{name} (split {split})"


def _read_source(spec: Any, split: str, field: str) -> tuple[_Rows, str]:
    """Rows and a description of the source for `data.path` (split `split`) or `data.eval_path`."""
    if spec is None or not str(spec).strip():
        raise UserError(f"{field} is empty; set it to a data file, a dataset dir or a hub dataset name")
    spec = str(spec).strip()
    path = Path(os.path.expanduser(spec))
    wanted = (split,) if field == "data.path" else EVAL_SPLIT_NAMES
    if path.is_dir():
        rows, source = _read_dir(path, wanted, field)
    elif path.is_file():
        rows, source = _read_file(path), str(path)
    elif path.exists():
        raise UserError(f"{field}: {spec} is not a regular file or dir; point it at a data file or a dataset dir")
    elif _looks_local(spec):
        raise UserError(
            f"{field}: {spec} does not exist (relative paths resolve from {Path.cwd()}); "
            "check the path or pass a hub dataset name"
        )
    else:
        rows, source = _read_hub(spec, split if field == "data.path" else None, field)
    if not rows.rows:
        raise UserError(f"{rows.label}: empty, no rows; point {field} at a file with examples")
    return rows, source


# --------------------------------------------------------------------------------------------------
# Format detection and row validation
# --------------------------------------------------------------------------------------------------


def _check_format_name(fmt: Any, allow_auto: bool = True) -> str:
    names = (("auto",) if allow_auto else ()) + FORMATS
    if not isinstance(fmt, str) or fmt not in names:
        raise UserError(f"data.format: unknown format {fmt!r}; use one of {', '.join(names)}")
    return fmt


def _detect(rows: _Rows) -> str:
    first = rows.rows[0]
    if not isinstance(first, dict):
        raise UserError(f"{rows.where(0)}: expected an object with named fields, got {type(first).__name__}")
    keys = set(first)
    if "messages" in keys:
        return "messages"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if "text" in keys:
        return "text"
    known = "; ".join(f"{name} ({fields})" for name, fields in FORMAT_FIELDS.items())
    raise UserError(
        f"{rows.where(0)}: cannot detect the data format from the first row's keys {sorted(keys)}; "
        f"known formats: {known}; rename the fields or set data.format"
    )


def _string(rows: _Rows, i: int, row: dict, field: str, required: bool = True) -> str:
    if field not in row or row[field] is None:
        if not required:
            return ""
        raise UserError(f"{rows.where(i)}: missing field '{field}'; every row needs it (or set data.format)")
    value = row[field]
    if not isinstance(value, str):
        raise UserError(
            f"{rows.where(i)}: field '{field}' must be a string, got {type(value).__name__} {_short(value)}; "
            "write it as text (in quotes)"
        )
    if required and not value.strip():
        raise UserError(f"{rows.where(i)}: field '{field}' is an empty string; give it text or remove the row")
    return value


def _messages(rows: _Rows, i: int, row: dict, field: str, need_assistant: bool) -> list[dict]:
    if field not in row or row[field] is None:
        raise UserError(f"{rows.where(i)}: missing field '{field}'; every row needs it (or set data.format)")
    value = row[field]
    if isinstance(value, str) and rows.text_cells:  # CSV cells hold JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise UserError(
                f"{rows.where(i)}: field '{field}' is a string that is not valid JSON ({err.msg}); "
                "it must be a list of {role, content} objects"
            ) from None
    if not isinstance(value, list):
        raise UserError(
            f"{rows.where(i)}: field '{field}' must be a list of {{role, content}} objects, got "
            f"{type(value).__name__} {_short(value)}"
        )
    if not value:
        raise UserError(f"{rows.where(i)}: field '{field}' is an empty list; give it at least one turn")
    out = []
    for j, message in enumerate(value):
        where = f"{rows.where(i)}: field '{field}[{j}]"
        if not isinstance(message, dict):
            raise UserError(f"{where}' must be a {{role, content}} object, got {type(message).__name__}")
        role = message.get("role")
        if role is None:
            raise UserError(f"{where}.role' is missing; give each message a role ({', '.join(ROLES)})")
        if role not in ROLES:
            raise UserError(f"{where}.role' is an unknown role {_short(role)}; use one of {', '.join(ROLES)}")
        content = message.get("content")
        if content is None:
            raise UserError(f"{where}.content' is missing; give each message its text in 'content'")
        if not isinstance(content, str):
            raise UserError(
                f"{where}.content' must be a string, got {type(content).__name__} {_short(content)}; "
                "write the message text as one string"
            )
        if role == "assistant" and not content.strip():
            raise UserError(f"{where}.content' is an empty assistant turn; give it the reply text or remove it")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise UserError(
            f"{rows.where(i)}: field '{field}' has no assistant turn, so there is nothing to train on; "
            "add the assistant's reply"
        )
    return out


def _convert(rows: _Rows, fmt: str) -> tuple[dict[str, list], bool]:
    """Validate every row for `fmt` and build the columns TRL expects. Returns (columns, conversational)."""
    conversational = False
    if fmt == "prompt_completion":
        first = rows.rows[0]
        conversational = isinstance(first, dict) and isinstance(first.get("prompt"), list)
    columns: dict[str, list] = {}
    for i, row in enumerate(rows.rows):
        if not isinstance(row, dict):
            raise UserError(
                f"{rows.where(i)}: expected an object with fields ({FORMAT_FIELDS[fmt]}), got "
                f"{type(row).__name__} {_short(row)}"
            )
        if fmt == "text":
            record = {"text": _string(rows, i, row, "text")}
        elif fmt == "alpaca":
            instruction = _string(rows, i, row, "instruction")
            extra = _string(rows, i, row, "input", required=False)
            output = _string(rows, i, row, "output")
            record = {"prompt": alpaca_prompt(instruction, extra), "completion": output}
        elif fmt == "messages":
            record = {"messages": _messages(rows, i, row, "messages", need_assistant=True)}
        elif conversational:
            if not isinstance(row.get("prompt"), list) and row.get("prompt") is not None:
                raise UserError(
                    f"{rows.where(i)}: field 'prompt' must be a list of {{role, content}} objects like the first "
                    f"row's, got {type(row['prompt']).__name__} {_short(row['prompt'])}"
                )
            prompt = _messages(rows, i, row, "prompt", need_assistant=False)
            completion = _messages(rows, i, row, "completion", need_assistant=True)
            record = {"prompt": prompt, "completion": completion}
        else:
            record = {"prompt": _string(rows, i, row, "prompt"), "completion": _string(rows, i, row, "completion")}
        for key, value in record.items():
            columns.setdefault(key, []).append(value)
    return columns, conversational


# --------------------------------------------------------------------------------------------------
# Token counts (the same tokenization TRL 1.16's SFTTrainer._prepare_dataset does)
# --------------------------------------------------------------------------------------------------


def _training_chat_template(tokenizer: Any, where: str) -> str | None:
    """The chat template TRL trains messages with under assistant_only_loss (None: the tokenizer's own),
    or a UserError when the tokenizer cannot mask assistant turns."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError(
            f"{where}: the messages format needs a tokenizer with a chat template, and this one has none; "
            "use a chat/instruct tokenizer or convert the data to prompt/completion"
        )
    if has_generation_markers(template):
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError:
        raise UserError(
            f"{where}: the tokenizer's chat template has no {{% generation %}} markers and TRL has no patched "
            "version of it, so assistant-only loss cannot mask the other turns; set "
            "data.completion_only_loss=false (loss on every token) or use a template with generation markers"
        ) from None


def _count(
    ds: Dataset,
    fmt: str,
    conversational: bool,
    tokenizer: Any,
    chat_template: str | None,
    completion_only: bool,
    seq_len: int,
) -> dict[str, int]:
    """Per-split token statistics: how many examples TRL truncates to `seq_len`, how many of those it then
    drops (every trained token beyond `seq_len`), and the longest example."""
    lengths: list[int] = []
    first_trained: list[int] = []  # index of the first token with a label (TRL drops rows where it's >= seq_len)
    eos = tokenizer.eos_token or ""

    def with_eos(text: str) -> str:
        return text if not eos or text.endswith(eos) else text + eos

    step = 512
    for start in range(0, len(ds), step):
        batch = ds[start : start + step]
        if fmt == "text":
            ids = tokenizer([with_eos(t) for t in batch["text"]])["input_ids"]
            lengths += [len(x) for x in ids]
            first_trained += [0] * len(ids)
        elif fmt == "messages":
            out = tokenizer.apply_chat_template(
                batch["messages"],
                tokenize=True,
                return_dict=True,
                chat_template=chat_template,
                return_assistant_tokens_mask=completion_only,
            )
            lengths += [len(x) for x in out["input_ids"]]
            if completion_only:
                first_trained += [m.index(1) if 1 in m else len(m) for m in out["assistant_masks"]]
            else:
                first_trained += [0] * len(out["input_ids"])
        else:
            if conversational:
                prompt_ids = tokenizer.apply_chat_template(
                    batch["prompt"], tokenize=True, return_dict=True, add_generation_prompt=True
                )["input_ids"]
                full_ids = tokenizer.apply_chat_template(
                    [p + c for p, c in zip(batch["prompt"], batch["completion"], strict=True)],
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            else:
                prompt_ids = tokenizer(batch["prompt"])["input_ids"]
                full_ids = tokenizer(
                    [p + with_eos(c) for p, c in zip(batch["prompt"], batch["completion"], strict=True)]
                )["input_ids"]
            for p, f in zip(prompt_ids, full_ids, strict=True):
                common = 0
                for a, b in zip(p, f, strict=False):
                    if a != b:
                        break
                    common += 1
                lengths.append(len(f))
                first_trained.append(common if completion_only else 0)
    over = sum(1 for n in lengths if n > seq_len)
    dropped = sum(1 for n, k in zip(lengths, first_trained, strict=True) if k >= min(n, seq_len))
    return {"over": over, "dropped": dropped, "max_tokens": max(lengths, default=0)}


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _cfg(data_cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(data_cfg, dict):
        return data_cfg.get(key, default)
    return getattr(data_cfg, key, default)


def _load(spec: Any, split: str, field: str, fmt: str) -> tuple[str, dict[str, list], bool, str]:
    rows, source = _read_source(spec, split, field)
    detected = _detect(rows) if fmt == "auto" else fmt
    columns, conversational = _convert(rows, detected)
    return detected, columns, conversational, source


def load_splits(data_cfg: Any, tokenizer: Any, seq_len: int, seed: int) -> tuple[Dataset, Dataset | None, dict]:
    """Load `data_cfg.path` (and `data_cfg.eval_path`), validate every row and return
    `(train, eval_or_None, stats)`.

    The datasets have the columns TRL's SFTTrainer reads: `prompt`+`completion` (alpaca and
    prompt_completion; strings, or message lists for a conversational prompt_completion), `messages`,
    or `text`. Without `eval_path`, a seeded `eval_fraction` of the rows is held out (None when 0).

    stats: `format`, `conversational`, `source`, `eval_source`, `rows` ({train, eval}), `seq_len`,
    `over_seq_len` ({train, eval}: examples longer than seq_len tokens, which TRL truncates),
    `dropped_by_truncation` ({train, eval}: of those, examples with no trained token in the first
    seq_len, which TRL 1.16 removes; 0 under packing) and `max_tokens` ({train, eval}). The token
    figures are None when `tokenizer` is None.
    """
    fmt = configured = _check_format_name(_cfg(data_cfg, "format", "auto"))
    split = _cfg(data_cfg, "split", "train") or "train"
    eval_path = _cfg(data_cfg, "eval_path")
    eval_fraction = _cfg(data_cfg, "eval_fraction", 0.0)
    if eval_fraction is None:
        eval_fraction = 0.0
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 <= eval_fraction < 1:
        raise UserError(
            f"data.eval_fraction: {eval_fraction!r} is not a fraction in [0, 1); "
            "use e.g. 0.1, or 0 with data.eval_path for a separate eval file"
        )
    if not isinstance(seq_len, int) or seq_len < 1:
        raise UserError(f"trainer.seq_len: {seq_len!r} must be a positive number of tokens")

    fmt, columns, conversational, source = _load(_cfg(data_cfg, "path"), split, "data.path", fmt)
    train = Dataset.from_dict(columns)
    eval_ds = None
    eval_source = None
    if eval_path not in (None, ""):
        eval_fmt, eval_columns, eval_conv, eval_source = _load(eval_path, split, "data.eval_path", configured)
        if eval_fmt != fmt or eval_conv != conversational:
            kind = lambda f, c: f + (" (chat messages)" if c else "")  # noqa: E731
            raise UserError(
                f"data.eval_path: {eval_source} is in format {kind(eval_fmt, eval_conv)} but data.path is "
                f"{kind(fmt, conversational)}; give both files the same fields"
            )
        eval_ds = Dataset.from_dict(eval_columns)
        if eval_fraction:
            log.info("data.eval_path is set, so data.eval_fraction=%s is not used", eval_fraction)
    elif eval_fraction > 0:
        import numpy as np

        n = len(train)
        n_eval = max(1, int(round(n * eval_fraction)))
        if n_eval >= n:
            raise UserError(
                f"data.eval_fraction: {eval_fraction} of {n} rows in {source} leaves no rows to train on; "
                "add rows, lower data.eval_fraction, or pass data.eval_path"
            )
        order = np.random.default_rng(seed).permutation(n)
        eval_idx, train_idx = sorted(order[:n_eval].tolist()), sorted(order[n_eval:].tolist())
        train, eval_ds = train.select(train_idx), train.select(eval_idx)
        eval_source = f"{eval_fraction:g} of {source} (seed {seed})"

    completion_only = bool(_cfg(data_cfg, "completion_only_loss", True))
    packing = bool(_cfg(data_cfg, "packing", False))
    stats: dict[str, Any] = {
        "format": fmt,
        "conversational": fmt == "messages" or conversational,
        "source": source,
        "eval_source": eval_source,
        "rows": {"train": len(train), "eval": len(eval_ds) if eval_ds is not None else 0},
        "seq_len": seq_len,
        "over_seq_len": None,
        "dropped_by_truncation": None,
        "max_tokens": None,
    }
    if tokenizer is not None:
        chat_template = None
        if fmt == "messages" and completion_only:
            chat_template = _training_chat_template(tokenizer, source)
        elif fmt == "messages" or conversational:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError(
                    f"{source}: chat-format data needs a tokenizer with a chat template, and this one has none; "
                    "use a chat/instruct tokenizer or plain-text prompt/completion data"
                )
        trained_only = completion_only and fmt != "text"
        counts = {"train": _count(train, fmt, conversational, tokenizer, chat_template, trained_only, seq_len)}
        if eval_ds is not None:
            counts["eval"] = _count(eval_ds, fmt, conversational, tokenizer, chat_template, trained_only, seq_len)
        stats["over_seq_len"] = {k: counts[k]["over"] if k in counts else 0 for k in ("train", "eval")}
        stats["dropped_by_truncation"] = {
            k: (0 if packing or k not in counts else counts[k]["dropped"]) for k in ("train", "eval")
        }
        stats["max_tokens"] = {k: counts[k]["max_tokens"] if k in counts else 0 for k in ("train", "eval")}
        for k, c in counts.items():
            n = stats["rows"][k]
            if stats["dropped_by_truncation"][k] == n:
                raise UserError(
                    f"trainer.seq_len: at {seq_len} tokens no {k} example keeps a "
                    f"{'assistant' if fmt == 'messages' else 'completion'} token after truncation "
                    f"({source if k == 'train' else eval_source}, longest {c['max_tokens']} tokens), so there is "
                    f"nothing to train on; raise trainer.seq_len"
                )
            if c["over"]:
                what = "packed into" if packing else "truncated to"
                msg = (
                    f"{c['over']} of {n} {k} examples are longer than trainer.seq_len={seq_len} tokens "
                    f"(longest {c['max_tokens']}); TRL keeps their first {seq_len} tokens ({what} max_length)"
                )
                if stats["dropped_by_truncation"][k]:
                    msg += (
                        f"; {stats['dropped_by_truncation'][k]} of them have no "
                        f"{'assistant' if fmt == 'messages' else 'completion'} token left within {seq_len} "
                        "tokens and TRL drops them"
                    )
                log.warning(msg + "; raise trainer.seq_len to keep them whole")
            else:
                log.info(
                    "all %d %s examples fit trainer.seq_len=%d tokens (longest %d)", n, k, seq_len, c["max_tokens"]
                )
    log.info(
        "data: %s format, %d train rows from %s; eval: %s",
        fmt,
        stats["rows"]["train"],
        source,
        f"{stats['rows']['eval']} rows from {eval_source}" if eval_ds is not None else "none",
    )
    return train, eval_ds, stats


def sft_kwargs(data_cfg: Any, fmt: str) -> dict:
    """The SFTConfig fields (TRL 1.16 names) this data needs. The caller sets max_length=trainer.seq_len.

    prompt/completion and alpaca: `completion_only_loss` (loss on the completion only, the prompt's
    labels -100). messages: `assistant_only_loss` (loss on the `{% generation %}` spans of the chat
    template, i.e. assistant turns). text: loss on every token. `packing` as configured.
    """
    fmt = _check_format_name(fmt, allow_auto=False)
    only = bool(_cfg(data_cfg, "completion_only_loss", True))
    kwargs: dict[str, Any] = {
        "packing": bool(_cfg(data_cfg, "packing", False)),
        "dataset_text_field": "text",
        "completion_only_loss": None,
        "assistant_only_loss": False,
    }
    if fmt in ("prompt_completion", "alpaca"):
        kwargs["completion_only_loss"] = only
    elif fmt == "messages":
        kwargs["assistant_only_loss"] = only
    else:  # text: there is no prompt to mask
        kwargs["completion_only_loss"] = False
    return kwargs


def generation_pairs(eval_ds: Dataset | None, fmt: str, limit: int | None) -> list[tuple[Any, str]]:
    """(prompt, reference) pairs for the exact-match metric, from the first `limit` eval rows.

    prompt_completion / alpaca: the prompt string (or, for chat prompt/completion, the prompt's
    message list) and the completion text. messages: the turns before the last assistant turn
    (a message list; render with `add_generation_prompt=True`) and that turn's content. text: [].
    """
    fmt = _check_format_name(fmt, allow_auto=False)
    if eval_ds is None or fmt == "text" or (limit is not None and limit <= 0):
        return []
    n = len(eval_ds) if limit is None else min(int(limit), len(eval_ds))
    rows = eval_ds.select(range(n))
    pairs: list[tuple[Any, str]] = []
    if fmt == "messages":
        for messages in rows["messages"]:
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                continue
            prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:last]]
            pairs.append((prompt, messages[last]["content"]))
        return pairs
    for prompt, completion in zip(rows["prompt"], rows["completion"], strict=True):
        if isinstance(completion, list):  # chat prompt/completion
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
            completion = "".join(m["content"] for m in completion if m["role"] == "assistant")
        pairs.append((prompt, completion))
    return pairs
