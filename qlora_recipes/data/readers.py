"""Reading a data source into raw rows: a local `.jsonl` / `.json` / `.csv` / `.parquet` file, a local dir
(written by `datasets.save_to_disk`, or holding data files), or a hub dataset name.

Nothing is validated against a format here; `Rows` keeps how to name each row (1-based line number for
`.jsonl`, 0-based row index otherwise) so the format checks can point at the exact place. A source that
cannot be read stops the run with one line naming the file and what to do about it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import UserError

FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")
EVAL_SPLIT_NAMES = ("validation", "valid", "val", "eval", "test", "dev")
# Every field some format reads (formats.FORMAT_FIELDS); kept here so hub datasets load only these columns.
KNOWN_FIELDS = ("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "text")


class Rows:
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


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_jsonl_text(label: str, text: str) -> Rows:
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
    return Rows(label, rows, lines)


def _read_text(path: Path, label: str) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    except OSError as err:
        raise UserError(f"{label}: cannot be read ({err.strerror or err}); check the file's permissions") from None


def _read_json(path: Path, label: str) -> Rows:
    text = _read_text(path, label)
    if not text.strip():
        return Rows(label, [])
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
    return Rows(label, data)


def _read_csv(path: Path, label: str) -> Rows:
    import pandas as pd

    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        return Rows(label, [])
    except UnicodeDecodeError as err:
        raise UserError(f"{label}: not UTF-8 text (byte {err.start}); save the file as UTF-8") from None
    except (pd.errors.ParserError, ValueError) as err:
        raise UserError(f"{label}: not a readable CSV file ({_one_line(err)}); check quoting and delimiters") from None
    if len(frame) == 0:
        raise UserError(
            f"{label}: the CSV file has a header ({', '.join(map(str, frame.columns))}) but no rows; "
            "add examples below the header"
        )
    rows = Rows(label, frame.to_dict(orient="records"))
    rows.text_cells = True
    return rows


def _read_parquet(path: Path, label: str) -> Rows:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
        raise UserError(f"{label}: not a readable Parquet file ({_one_line(err)})") from None
    return Rows(label, table.to_pylist())


def _read_file(path: Path) -> Rows:
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


def _rows_from_dataset(label: str, ds: Any) -> Rows:
    """Rows of a loaded `datasets.Dataset`, reading only the columns some format uses (hub datasets often
    carry others, e.g. images); with none of them, the first row whole, for the detection error."""
    columns = [c for c in ds.column_names if c in KNOWN_FIELDS]
    if not columns:
        return Rows(label, ds.select(range(min(1, len(ds)))).to_list())
    return Rows(label, ds.select_columns(columns).to_list())


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


def _read_dir(path: Path, wanted: tuple[str, ...], field: str) -> tuple[Rows, str]:
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


class _Concat(Rows):
    """Rows of several files, each still named by its own file and line."""

    def __init__(self, parts: list[Rows]):
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


def _read_hub(name: str, split: str | None, field: str) -> tuple[Rows, str]:
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


def read_source(spec: Any, split: str, field: str) -> tuple[Rows, str]:
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
