"""Reading a data source into raw rows: a local `.jsonl` / `.json` / `.csv` / `.parquet` file, a local dir
(written by `datasets.save_to_disk`, or holding data files), or a hub dataset name.

Nothing is validated against a format here; `Rows` keeps how to name each row (1-based line number for
`.jsonl`, 0-based row index otherwise) so the format checks can point at the exact place. A source that
cannot be read stops the run with one line naming the file and what to do about it.

`.jsonl`, `.parquet`, saved and hub datasets are streamed: `formats.convert` reads them batch by batch
into datasets' memory-mapped Arrow, so a corpus never sits in memory as Python objects. JSON lines are
parsed by Python's `json`, not by `load_dataset("json")`: datasets 5.2 casts a later chunk's values to
the first chunk's types (an int `completion` becomes "7") and JSON-encodes fields of mixed types, where
the row checks must see each value as written.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    from ..config.schema import DataConfig

FILE_TYPES = (".jsonl", ".json", ".csv", ".parquet")
EVAL_SPLIT_NAMES = ("validation", "valid", "val", "eval", "test", "dev")
BATCH_ROWS = 1000  # rows read (and converted) at a time from a streamed source
# Every field some format reads (formats.FORMAT_FIELDS): what a hub or saved dataset is read for, with its
# text and number columns (a grpo reward's reference answer); images and nested records stay unread,
# unless a caller keeps them (image rows keep `images`, undecoded: read_source's `keep`).
KNOWN_FIELDS = (
    *("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "text"),
    *("chosen", "rejected", "label"),
)


class Rows:
    """Raw rows from one source, and how to name a row in an error message.

    A row is reached by a key: its 0-based index, or for `.jsonl` its 1-based line number. In-memory
    sources (`.json`, `.csv`) hold a list; the others (`.jsonl`, `.parquet`, saved and hub datasets) are
    read batch by batch when converted, so a large corpus never sits in memory as Python objects.
    """

    in_memory = True
    nbytes = 0  # a streamed source: its size on disk (formats.convert keeps small ones in memory)

    def __init__(self, label: str, rows: list[Any], line_numbers: list[int] | None = None):
        self.label = label  # the file (or dataset) as the user should see it
        self.rows = rows
        self.line_numbers = line_numbers  # .jsonl read whole: the 1-based line of each row
        self.text_cells = False  # CSV: every cell is a string, lists come as JSON text

    def where(self, i: int) -> str:
        if self.line_numbers is not None:
            return f"{self.label} line {self.line_numbers[i]}"
        return f"{self.label} row index {i}"

    def items(self) -> Iterator[tuple[int, Any]]:
        """(key, row) in order; `where(key)` names the row."""
        return enumerate(self.rows)

    def first(self) -> tuple[int, Any] | None:
        """The first (key, row), None for a source without rows (format detection reads it)."""
        return next(iter(self.items()), None)


class _JsonlRows(Rows):
    """A `.jsonl` file read line by line (blank lines skipped); a row's key is its line number."""

    in_memory = False

    def __init__(self, path: Path, label: str):
        super().__init__(label, [])
        self.path = path
        stat = path.stat()
        self.version = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)  # the cache of its conversion
        self.nbytes = stat.st_size

    def where(self, i: int) -> str:
        return f"{self.label} line {i}"

    def items(self) -> Iterator[tuple[int, Any]]:
        try:
            with open(self.path, encoding="utf-8-sig", newline=None) as f:
                for number, line in enumerate(f, start=1):
                    if line.strip():  # universal newlines: every line ends in "\n" alone (but the last)
                        yield number, _json_line(self.label, number, line.removesuffix("\n"))
        except UnicodeDecodeError:
            raise UserError(
                f"{self.label}: not UTF-8 text (byte {_bad_utf8_byte(self.path)}); save the file as UTF-8"
            ) from None
        except OSError as err:
            raise UserError(
                f"{self.label}: cannot be read ({err.strerror or err}); check the file's permissions"
            ) from None


class _ArrowRows(Rows):
    """Rows of a Parquet file or a loaded `datasets.Dataset`, read in record batches; key: the row index."""

    in_memory = False

    def __init__(self, label: str, batches: Callable[[], Iterator[list[dict]]], version: tuple, nbytes: int):
        super().__init__(label, [])
        self._batches = batches
        self.version = version
        self.nbytes = nbytes

    def items(self) -> Iterator[tuple[int, Any]]:
        i = 0
        for batch in self._batches():
            for row in batch:
                yield i, row
                i += 1

    def __getstate__(self) -> dict:  # what the conversion cache is keyed on: the source, not its reader
        return {"label": self.label, "version": self.version}


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_line(label: str, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{label} line {number}: not valid JSON ({err.msg}: column {err.colno}); "
            "fix or remove that line (each line must be one JSON object)"
        ) from None


def _bad_utf8_byte(path: Path) -> int:
    """The offset of the first byte of `path` that is not UTF-8 (read in chunks, not whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                return offset + err.start
            offset += len(chunk)
    return offset


def _read_jsonl_text(label: str, text: str) -> Rows:
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            rows.append(_json_line(label, number, line))
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
        pq.read_metadata(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses for unreadable files
        raise UserError(f"{label}: not a readable Parquet file ({_one_line(err)})") from None

    def batches() -> Iterator[list[dict]]:
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
                yield batch.to_pylist()
        except Exception as err:  # a corrupt row group surfaces only when it is read
            raise UserError(f"{label}: not a readable Parquet file ({_one_line(err)})") from None

    stat = path.stat()
    return _ArrowRows(label, batches, (str(path.resolve()), stat.st_size, stat.st_mtime_ns), stat.st_size)


def _read_file(path: Path) -> Rows:
    label = str(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _JsonlRows(path, label)
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


def _rows_from_dataset(label: str, ds: Any, keep: tuple[str, ...] = ()) -> Rows:
    """Rows of a loaded `datasets.Dataset`, reading only the columns some format uses and its text and
    number columns (hub datasets often carry others, e.g. images), and the `keep` columns with their
    images undecoded (`{"bytes", "path"}`); with no field of a format, the first row whole, for the
    detection error. Read batch by batch from its memory-mapped Arrow table."""
    if any(c in KNOWN_FIELDS for c in ds.column_names):
        wanted = set(KNOWN_FIELDS) | set(keep)
        ds = _undecoded(ds.select_columns([c for c, f in ds.features.items() if c in wanted or _scalar(f)]), keep)
    else:
        ds = ds.select(range(min(1, len(ds))))

    def batches() -> Iterator[list[dict]]:
        for batch in ds.iter(batch_size=BATCH_ROWS):
            yield [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]

    return _ArrowRows(label, batches, (label, ds._fingerprint), ds.data.nbytes)


def _undecoded(ds: Any, keep: tuple[str, ...]) -> Any:
    """The kept image columns (an Image, or a list of them) as their stored bytes and paths: the rows are
    checked from the bytes, and nothing is decoded before training needs it."""
    from datasets import Image, List

    for name in keep:
        feature = ds.features.get(name)
        if isinstance(feature, Image):
            ds = ds.cast_column(name, Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), Image):
            ds = ds.cast_column(name, List(Image(decode=False)))
    return ds


def _scalar(feature: Any) -> bool:
    """A column of texts or numbers (not booleans: a `label` is read as a field of its own)."""
    dtype = getattr(feature, "dtype", None)
    return type(feature).__name__ == "Value" and (
        dtype in ("string", "large_string") or str(dtype).startswith(("int", "float"))
    )


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


def _read_dir(path: Path, wanted: tuple[str, ...], field: str, keep: tuple[str, ...] = ()) -> tuple[Rows, str]:
    label = str(path)
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        from datasets import DatasetDict, load_from_disk

        try:
            loaded = load_from_disk(str(path))
        except Exception as err:
            raise UserError(f"{label}: a saved dataset dir that cannot be loaded ({_one_line(err)})") from None
        if isinstance(loaded, DatasetDict):
            split = _pick_split(label, list(loaded.keys()), wanted, field)
            return _rows_from_dataset(f"{label} (split {split})", loaded[split], keep), f"{label} (split {split})"
        return _rows_from_dataset(label, loaded, keep), label
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
    """Rows of several files, each still named by its own file and line (and converted on its own)."""

    def __init__(self, parts: list[Rows]):
        super().__init__(", ".join(p.label for p in parts), [])
        self.parts = parts
        self.in_memory = all(p.in_memory for p in parts)
        self.nbytes = sum(p.nbytes for p in parts)
        self.text_cells = any(p.text_cells for p in parts)

    def where(self, key: tuple[int, Any]) -> str:
        return self.parts[key[0]].where(key[1])

    def items(self) -> Iterator[tuple[tuple[int, Any], Any]]:
        for n, part in enumerate(self.parts):
            for key, row in part.items():
                yield (n, key), row


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


def _read_hub(name: str, split: str | None, field: str, keep: tuple[str, ...] = ()) -> tuple[Rows, str]:
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
    return _rows_from_dataset(label, loaded, keep), f"hub:{name} (split {split})"


def check_local_source(spec: Any, field: str) -> None:
    """What `read_source` refuses without reading: an empty value, a local path that is missing or
    not a file/dir. Cheap, so a run checks it before it looks up the model."""
    if spec is None or not str(spec).strip():
        raise UserError(f"{field} is empty; set it to a data file, a dataset dir or a hub dataset name")
    spec = str(spec).strip()
    path = Path(os.path.expanduser(spec))
    if path.exists() and not (path.is_dir() or path.is_file()):
        raise UserError(f"{field}: {spec} is not a regular file or dir; point it at a data file or a dataset dir")
    if not path.exists() and _looks_local(spec):
        raise UserError(
            f"{field}: {spec} does not exist (relative paths resolve from {Path.cwd()}); "
            "check the path or pass a hub dataset name"
        )


def check_data_sources(data: DataConfig) -> None:
    """check_local_source for data.path and, where set, data.eval_path."""
    check_local_source(data.path, "data.path")
    if data.eval_path is not None:
        check_local_source(data.eval_path, "data.eval_path")


def read_source(spec: Any, split: str, field: str, keep: tuple[str, ...] = ()) -> tuple[Rows, str]:
    """Rows and a description of the source for `data.path` (split `split`) or `data.eval_path`; a saved
    or hub dataset's `keep` columns are read too, their images undecoded."""
    check_local_source(spec, field)
    spec = str(spec).strip()
    path = Path(os.path.expanduser(spec))
    wanted = (split,) if field == "data.path" else EVAL_SPLIT_NAMES
    if path.is_dir():
        rows, source = _read_dir(path, wanted, field, keep)
    elif path.is_file():
        rows, source = _read_file(path), str(path)
    else:
        rows, source = _read_hub(spec, split if field == "data.path" else None, field, keep)
    if rows.first() is None:
        raise UserError(f"{rows.label}: empty, no rows; point {field} at a file with examples")
    return rows, source
