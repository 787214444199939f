"""Image rows for a vision-language model: `messages` whose content holds image parts, and an `images`
column of local files.

A row: `{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "..."}]},
{"role": "assistant", "content": "..."}], "images": ["images/a.png"]}`. Image paths are read relative to
the data file's folder (or a dataset dir), or absolute. Every row is checked before anything is written:
each file exists and is an image, the row has as many image parts as images, a turn's text is text. A
bad row stops the run with one line naming the file, the row and what to do.

With data.metric=exact_match, the held-out rows are answered with their images (outputs.images) and
scored as text rows are. TRL's SFTTrainer, given the processor, renders and tokenizes these rows per
batch (the processor turns each image into pixels and its image tokens) with the loss on the assistant
turns. Here each row is
rendered once to count its tokens, image tokens included: trainer.seq_len=auto reads them, and a row
longer than seq_len is never truncated (a cut would split an image's tokens from its pixels). The most
images a row holds is counted as the rows are checked: data.images_per_row=auto plans for it, and a row
holding more than a number set there is refused (the plan would count too few).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..config.schema import DataConfig
from ..errors import UserError
from .formats import ROLES, _short
from .readers import Rows, read_source

log = logging.getLogger(__name__)

MAX_FILE_PIXELS = 89_478_485  # data.image_file_max_pixels's default: PIL's own decompression-bomb warning bound


def load_image_splits(data: DataConfig, processor: Any, seq_len: Any, seed: int) -> tuple[Any, Any, dict]:
    """(train, eval or None, stats) of image rows, as data.load_splits returns text rows: `messages` with
    content part lists and `images` decoded on access (datasets' Image feature)."""
    from .image_bounds import bound_processor
    from .splits import _eval_fraction, _hold_out, _metric_name, _too_long

    _check_options(data)
    bound_processor(processor, data)  # before the rows are counted: seq_len=auto counts bounded images
    limit = data.image_file_max_pixels
    train, source, most = _load_counted(data.path, data.split or "train", "data.path", limit)
    eval_ds, eval_source = None, None
    if data.eval_path not in (None, ""):
        eval_ds, eval_source, eval_most = _load_counted(data.eval_path, data.split or "train", "data.eval_path", limit)
        most = max(most, eval_most, key=lambda m: m[0])
    elif _eval_fraction(data.eval_fraction) > 0:
        train, eval_ds, eval_source = _hold_out(train, data.eval_fraction, source, seed, data.eval_max_rows)
    _within_images_per_row(data.images_per_row, most)
    stats: dict[str, Any] = {
        "format": "messages",
        "detected": "messages",
        "format_from": "detected",
        "conversational": True,
        "images": True,
        "source": source,
        "eval_source": eval_source,
        "seq_len": seq_len,
        "too_long": _too_long(data.too_long),
        "chat_template": "the processor's",
        "metric": _metric_name(data.metric, eval_ds is not None),
        "prompt_format": {"style": "chat", "system": None},
        "identical_pairs": None,
        "truncated": {"train": 0, "eval": 0},
        "dropped_by_truncation": {"train": 0, "eval": 0},
        "images_per_row": {"images": most[0], "where": most[1]},  # data.images_per_row=auto reads it
    }
    splits = {"train": train} if eval_ds is None else {"train": train, "eval": eval_ds}
    kept = _fit_seq_len(stats, splits, processor)
    train, eval_ds = kept["train"], kept.get("eval")
    stats["rows"] = {"train": len(train), "eval": len(eval_ds) if eval_ds is not None else 0}
    log.info(
        "data: %s: image rows (messages + images), chat with the processor's template; %d train rows, %s",
        source,
        stats["rows"]["train"],
        f"{stats['rows']['eval']} eval from {eval_source}" if eval_ds is not None else "no eval split",
    )
    return train, eval_ds, stats


def held_out_rows(data: DataConfig, seed: int) -> tuple[Any, str]:
    """The eval split of image rows as training held it out (its train split without one), checked but
    not rendered, and where it came from: the prompts the merge's quality check asks with."""
    from .splits import _eval_fraction, _hold_out

    limit = data.image_file_max_pixels
    train, source = _load(data.path, data.split or "train", "data.path", limit)
    if data.eval_path not in (None, ""):
        eval_ds, eval_source = _load(data.eval_path, data.split or "train", "data.eval_path", limit)
        return eval_ds, f"eval data of the run ({eval_source})"
    if _eval_fraction(data.eval_fraction) > 0:
        _, eval_ds, eval_source = _hold_out(train, data.eval_fraction, source, seed, data.eval_max_rows)
        return eval_ds, f"eval data of the run ({eval_source})"
    return train, f"train data of the run ({source})"


def _check_options(data: DataConfig) -> None:
    if str(data.format) not in ("auto", "messages"):
        raise UserError(
            f"data.format={data.format}: a vision-language model trains on messages rows with images; "
            "use data.format=auto or messages"
        )
    for key in ("packing", "padding_free"):
        if getattr(data, key):
            raise UserError(f"data.{key}=true: image rows train unpacked (TRL 1.16 cannot pack them); drop data.{key}")


def _load(spec: Any, split: str, field: str, max_pixels: int = MAX_FILE_PIXELS) -> tuple[Any, str]:
    """The checked rows of one source as a dataset, and the source's name; an image over max_pixels
    (width x height) is refused."""
    ds, source, _ = _load_counted(spec, split, field, max_pixels)
    return ds, source


def _load_counted(spec: Any, split: str, field: str, max_pixels: int) -> tuple[Any, str, tuple[int, str]]:
    """_load's dataset and source, and the most images a row holds with the first row holding them."""
    from datasets import Dataset, Image, List

    rows, source = read_source(spec, split, field, keep=("images",))
    base = _image_root(spec)
    columns: dict[str, list] = {"messages": [], "images": []}
    most = (0, source)
    for key, row in rows.items():
        messages, images = convert_image_row(rows, key, row, base, max_pixels)
        columns["messages"].append(messages)
        columns["images"].append(images)
        if len(images) > most[0]:
            most = (len(images), rows.where(key))
    return Dataset.from_dict(columns).cast_column("images", List(Image())), source, most


def _within_images_per_row(wanted: Any, most: tuple[int, str]) -> None:
    """A row holding more images than data.images_per_row says: the plan would count too few."""
    if wanted != "auto" and most[0] > int(wanted):
        raise UserError(
            f"{most[1]}: {most[0]} images in one row, more than data.images_per_row={wanted} (the memory plan "
            f"counts that many a row); set data.images_per_row={most[0]}, or auto to read it from the data"
        )


def _image_root(spec: Any) -> Path | None:
    """The folder relative image paths are read from: the data file's own, or a dataset dir."""
    path = Path(str(spec)).expanduser()
    if path.is_file():
        return path.resolve().parent
    return path.resolve() if path.is_dir() else None


def convert_image_row(
    rows: Rows, key: Any, row: Any, base: Path | None, max_pixels: int = MAX_FILE_PIXELS
) -> tuple[list[dict], list[dict]]:
    """One row's messages (every content a list of parts) and its images, checked, as the Image feature
    stores them: `{"bytes": None, "path": absolute path}` for a file, `{"bytes": ..., "path": ...}` for an
    image a saved dataset or parquet holds."""
    at = rows.where(key)
    if not isinstance(row, dict):
        raise UserError(f"{at}: expected an object with 'messages' and 'images', got {type(row).__name__}")
    messages = _messages(at, row.get("messages"))
    wanted = sum(1 for m in messages for p in m["content"] if p["type"] == "image")
    images = row.get("images")
    images = [] if images is None else images
    if not isinstance(images, list):
        raise UserError(f"{at}: field 'images' must be a list of image file paths or image bytes, got {_short(images)}")
    if len(images) != wanted:
        raise UserError(
            f"{at}: {wanted} image part(s) in 'messages' but {len(images)} file(s) in 'images'; give each "
            '{"type": "image"} part one file, in order'
        )
    return messages, [_checked_entry(at, j, entry, base, max_pixels) for j, entry in enumerate(images)]


def _messages(at: str, value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{at}: field 'messages' must be a non-empty list of {{role, content}} objects")
    out = []
    for j, message in enumerate(value):
        where = f"{at}: field 'messages[{j}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise UserError(f"{where}' needs a role ({', '.join(ROLES)}) and a content; got {_short(message)}")
        out.append({"role": message["role"], "content": _parts(where, message.get("content"))})
    if not any(m["role"] == "assistant" for m in out):
        raise UserError(f"{at}: field 'messages' has no assistant turn, so there is nothing to train on; add one")
    return out


def _parts(where: str, content: Any) -> list[dict]:
    """A turn's content as parts: a string is one text part; a list holds text and image parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise UserError(f"{where}.content' must be a string or a list of parts, got {_short(content)}")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            parts.append({"type": "image", "text": None})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise UserError(
                f'{where}.content[{k}]\' must be {{"type": "image"}} or {{"type": "text", "text": "..."}}, '
                f"got {_short(part)}"
            )
    return parts


def _checked_image(at: str, j: int, name: str, base: Path | None, max_pixels: int = MAX_FILE_PIXELS) -> str:
    """The image's absolute path, once it is known to open as an image of at most max_pixels."""
    path = Path(name).expanduser()
    if not path.is_absolute():
        if base is None:
            raise UserError(f"{at}: images[{j}] {name!r} is relative and the data has no folder; give an absolute path")
        path = base / path
    if not path.is_file():
        where = "; relative paths are read from the data file's folder" if not Path(name).is_absolute() else ""
        raise UserError(f"{at}: images[{j}] {str(path)!r} does not exist{where}")
    _verified(at, j, path, repr(str(path)), max_pixels)
    return str(path)


def _checked_entry(at: str, j: int, entry: Any, base: Path | None, max_pixels: int) -> dict:
    """One `images` entry as datasets' Image feature stores it, `{"bytes", "path"}`, checked: a file path,
    or the bytes of an image (a saved dataset's or a parquet's Image column, undecoded)."""
    import io

    if isinstance(entry, dict) and entry.get("bytes") is None and isinstance(entry.get("path"), str):
        entry = entry["path"]  # an Image feature that stores the file's path, not its bytes
    if isinstance(entry, str):
        return {"bytes": None, "path": _checked_image(at, j, entry, base, max_pixels)}
    data = entry.get("bytes") if isinstance(entry, dict) else entry
    if not isinstance(data, (bytes, bytearray)):
        raise UserError(f"{at}: field 'images' must be a list of image file paths or image bytes, got {_short(entry)}")
    name = entry.get("path") if isinstance(entry, dict) else None
    _verified(at, j, io.BytesIO(data), f"(the embedded image{f' {name!r}' if name else ''})", max_pixels)
    return {"bytes": bytes(data), "path": name}


def _verified(at: str, j: int, source: Any, what: str, max_pixels: int) -> None:
    """`source` (a path or a stream) opens as an image PIL can read, of at most max_pixels."""
    from PIL import UnidentifiedImageError

    try:
        with _opened(at, j, source, what, max_pixels) as image:
            _within(at, j, what, image.size, max_pixels)
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(
            f"{at}: images[{j}] {what} is not an image PIL can read ({first}); replace or remove it"
        ) from None


def _opened(at: str, j: int, source: Any, what: str, max_pixels: int):
    """PIL's image (its header read, not its pixels), PIL's own bomb bound named as the row's one line."""
    from PIL import Image

    if max_pixels > (Image.MAX_IMAGE_PIXELS or 0):  # a bound raised past PIL's: datasets decodes with PIL later
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        return Image.open(source)
    except Image.DecompressionBombError:
        raise UserError(
            f"{at}: images[{j}] {what} is too large to load safely (over {2 * Image.MAX_IMAGE_PIXELS:,} "
            f"pixels, data.image_file_max_pixels={max_pixels:,}); resize it"
        ) from None


def _within(at: str, j: int, what: str, size: tuple[int, int], max_pixels: int) -> None:
    """One line for an image over data.image_file_max_pixels, before its pixels are decoded."""
    width, height = size
    if width * height > max_pixels:
        raise UserError(
            f"{at}: images[{j}] {what} is {width} x {height} = {width * height:,} pixels, over "
            f"data.image_file_max_pixels={max_pixels:,}; resize it, or raise data.image_file_max_pixels"
        )


def _fit_seq_len(stats: dict, splits: dict, processor: Any) -> dict:
    """Each row's tokens as the processor renders it (image tokens included); trainer.seq_len=auto
    resolved from the train rows; rows over seq_len dropped under data.too_long=drop, else refused."""
    import numpy as np

    lengths = {k: np.array([_row_tokens(processor, r) for r in ds], dtype=np.int64) for k, ds in splits.items()}
    if callable(stats["seq_len"]):
        stats["seq_len"] = stats["seq_len"](lengths["train"], stats["source"])
    seq_len = stats["seq_len"]
    stats["max_tokens"] = {k: int(lengths[k].max()) if k in lengths else 0 for k in ("train", "eval")}
    stats["over_seq_len"] = {k: int((lengths[k] > seq_len).sum()) if k in lengths else 0 for k in ("train", "eval")}
    stats["dropped_too_long"] = {"train": 0, "eval": 0}
    kept = {}
    for k, ds in splits.items():
        over = np.flatnonzero(lengths[k] > seq_len)
        if len(over) and stats["too_long"] != "drop":
            where = stats["source"] if k == "train" else stats["eval_source"]
            raise UserError(
                f"{where}: {len(over)} {k} row(s) (first: row {int(over[0])}, {int(lengths[k][over[0]])} tokens with "
                f"its image tokens) are longer than trainer.seq_len={seq_len}, and a cut would split an image's tokens; "
                "raise trainer.seq_len, or set data.too_long=drop to leave them out"
            )
        if len(over) == len(ds):
            raise UserError(f"trainer.seq_len={seq_len}: every {k} row is longer; raise trainer.seq_len")
        if len(over):
            log.warning(
                "%d of %d %s rows are longer than trainer.seq_len=%d and are dropped", len(over), len(ds), k, seq_len
            )
            stats["dropped_too_long"][k] = len(over)
        kept[k] = ds.select(np.flatnonzero(lengths[k] <= seq_len)) if len(over) else ds
    return kept


def _row_tokens(processor: Any, row: dict) -> int:
    """The tokens the trainer's collator makes of this row (its image tokens included)."""
    from trl.data_utils import prepare_multimodal_messages

    messages = prepare_multimodal_messages(row["messages"], images=row["images"])
    out = processor.apply_chat_template(
        [messages], tokenize=True, return_dict=True, processor_kwargs={"add_special_tokens": False}
    )
    return len(out["input_ids"][0])
