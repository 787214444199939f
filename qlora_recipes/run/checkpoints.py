"""Checkpoint dirs on disk: their names (`checkpoint-N`), the staging dir a checkpoint is written
into, and RECORD (`qlora_state.json`), the manifest each sealed checkpoint carries; the fsync
helpers that make a save durable, and which checkpoint is the newest sound one.

`guard.Guarded` (every objective's trainer) writes and seals checkpoints; `resume` and `schedule` read them back.
"""

import errno
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

# transformers' name for a Trainer checkpoint (trainer_utils.PREFIX_CHECKPOINT_DIR + "-N"), matched exactly.
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STAGING = ".partial"
RECORD = "qlora_state.json"  # in each checkpoint: its manifest, LR schedule, data fingerprint, totals


def sync_file(path: Path) -> dict:
    """Flush one file to disk; its size and sha256 for the manifest."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def fsync_dir(path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where the filesystem cannot)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


# torch.save's words for a write that failed (its stream writer sees no errno): "file write failed",
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" (after "basic_ios::clear:
# iostream error"), what a full disk gives it.
_TORCH_WRITE_FAILED = ("file write failed", "basic_ios::clear", "unexpected pos")


def disk_full(err: BaseException | None) -> bool:
    """ENOSPC / EDQUOT anywhere in the chain; torch.save reports a full disk as a RuntimeError."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left on device" in text or any(words in text for words in _TORCH_WRITE_FAILED):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_bytes(path) -> int | None:
    """Free space of the filesystem holding `path` (None when it cannot be read)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


# ---------------------------------------------------------------- checkpoints
def find_checkpoint(checkpoints_dir: Path, deep: bool = False) -> str | None:
    """The newest complete checkpoint: staging dirs never are, and one whose files do not match
    its manifest (missing, truncated; with `deep`, a different sha256) is skipped."""
    return newest_sound(checkpoints_dir, deep)[0]


def newest_sound(checkpoints_dir: Path, deep: bool) -> tuple[str | None, list[str]]:
    """(the newest sound checkpoint or None, "checkpoint-N (why)" for each newer one skipped)."""
    skipped = []
    for path in _newest_first(checkpoints_dir):
        problem = checkpoint_problem(path, deep)
        if problem is None:
            return str(path), skipped
        skipped.append(f"{path.name} ({problem})")
    return None, skipped


def _newest_first(checkpoints_dir: Path) -> list[Path]:
    """The `checkpoint-N` dirs, newest first, as transformers finds them: `get_last_checkpoint` (what the
    Trainer resumes from) first, then the older ones in `sort_checkpoints`' step order, for the fallback
    past a newest one that is not sound. Names only `checkpoint-N` exactly (sort_checkpoints also takes
    `checkpoint-N<anything>`)."""
    if not checkpoints_dir.is_dir():
        return []
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    last = get_last_checkpoint(str(checkpoints_dir))
    if last is None:
        return []
    older = [Path(p) for p in reversed(sort_checkpoints(str(checkpoints_dir))) if CHECKPOINT.match(Path(p).name)]
    return [Path(last)] + [p for p in older if p.name != Path(last).name]


def checkpoint_problem(path: Path, deep: bool = False) -> str | None:
    """Why a checkpoint dir cannot be resumed from, or None. Checked against its RECORD: every file
    listed there, at its size (with `deep`, its sha256). A checkpoint written before RECORD
    existed needs a readable trainer_state.json only."""
    try:
        json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "trainer_state.json missing or unreadable"
    if not (path / RECORD).exists():
        return None
    try:
        files = json.loads((path / RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{RECORD} unreadable"
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{rel} has {f.stat().st_size} bytes, {meta['bytes']} were written"
        if deep and _sha256(f) != meta["sha256"]:
            return f"{rel} differs from what was written (sha256)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_bytes(checkpoint: str | Path | None) -> int | None:
    """What a sealed checkpoint's files take, from its RECORD (None without one)."""
    files = read_record(checkpoint).get("files")
    return sum(int(meta.get("bytes", 0)) for meta in files.values()) if isinstance(files, dict) else None


def read_record(checkpoint: str | Path | None) -> dict:
    """A checkpoint's RECORD ({} for none, or one written before RECORD existed)."""
    if checkpoint is None:
        return {}
    try:
        return json.loads((Path(checkpoint) / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def trainer_state(checkpoint: str | Path) -> dict:
    try:
        return json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------- finite values
def first_nonfinite(named: Iterable[tuple[str, object]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf, or None."""
    import torch

    for name, value in named:
        if not torch.is_tensor(value) or not value.is_floating_point():
            continue
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor (FSDP2): this rank's shard
        if not bool(torch.isfinite(local).all()):
            return name
    return None


def tensors_in(state, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted name, tensor) for every tensor in nested dicts and lists (an optimizer's state_dict)."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, (dict, list, tuple)):
            yield from tensors_in(value, f"{name}.")
        else:
            yield name, value


def nonfinite_values(checkpoint: Path) -> str | None:
    """What in a checkpoint holds NaN or Inf ("adapter_model.safetensors: NAME"), or None: the
    adapter's weights (every .safetensors file) and the optimizer state (optimizer*.pt). A NaN update
    saved in a checkpoint poisons every run resumed from it."""
    import torch
    from safetensors.torch import load_file

    for f in sorted(checkpoint.rglob("*.safetensors")):
        bad = first_nonfinite(load_file(f).items())
        if bad:
            return f"{f.relative_to(checkpoint)}: {bad}"
    for f in sorted(checkpoint.glob("optimizer*.pt")):
        try:
            state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception:  # a layout torch will not load safely (a ZeRO shard): unchecked
            continue
        bad = first_nonfinite(tensors_in(state))
        if bad:
            return f"{f.name}: {bad}"
    return None


def newest_finite(checkpoints_dir: Path, remove: bool = True) -> tuple[str | None, list[str]]:
    """The newest sound checkpoint whose values are all finite; each newer one that is not (a NaN
    update saved before the loss showed it) is removed (`remove`; ranks other than 0 leave that to
    rank 0): (its path or None, "checkpoint-N (what)" for each one passed over)."""
    removed = []
    for path in _newest_first(checkpoints_dir):
        if checkpoint_problem(path) is not None:
            continue
        bad = nonfinite_values(path)
        if bad is None:
            return str(path), removed
        if remove:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(f"{path.name} ({bad} holds NaN/Inf)")
    return None, removed
