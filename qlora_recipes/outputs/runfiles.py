"""What a finished run (or a merge) wrote, checked when it is read back.

    write_manifest(folder, names)     manifest.json: each file's size and sha256, written last
    check_manifest(folder) -> bool    every file as recorded (False: an older dir without a manifest)
    read_json(path) -> dict           a JSON object, or one UserError line naming the file
    run_file_names(run_dir)           what a run's manifest lists: config.yaml, metrics.json, adapter/*

A run writes its manifest when it finishes (after metrics.json) and removes it when it starts writing
the run dir again; merge writes one into the merged dir with merge_report.json. A file cut short,
garbled or replaced then is named in one line instead of being read as another run. Files above
DEEP_LIMIT (a merged model's shards) are checked by size and safetensors header, not hashed, so a
generate on a 14 GB model does not read it twice. A run's adapter files are hashed whatever their size
(the adapter is what merge, push and init_from pass on), and a file added to its adapter/ is named too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import UserError

MANIFEST = "manifest.json"
DEEP_LIMIT = 64 * 2**20  # bytes: files up to this size are hashed when checked
ALWAYS_HASHED = "adapter/"  # a run's adapter files: hashed at any size
UNLISTED = ("README.md",)  # written into a complete dir after its manifest (the model card)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, names: list[str], complete: tuple[str, ...] = ()) -> None:
    """manifest.json in `folder`: the size and sha256 of each of `names` (paths relative to it), atomically.
    `complete`: sub-dirs whose every file is listed (but UNLISTED): a file added there later is named."""
    files = {name: {"size": (folder / name).stat().st_size, "sha256": sha256(folder / name)} for name in names}
    record: dict = {"files": files}
    if complete:
        record["complete"] = list(complete)
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / MANIFEST)


def remove_manifest(folder: Path) -> None:
    """The dir is being written again: what the manifest recorded no longer holds."""
    (folder / MANIFEST).unlink(missing_ok=True)


def read_json(path: Path, fix: str = "re-run the step that wrote it") -> dict:
    """A JSON object from `path`; a UserError naming the file when it is unreadable, cut short or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: damaged, not readable JSON ({' '.join(str(err).split())}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: damaged, not a JSON object; {fix}")
    return data


def check_manifest(folder: Path, fix: str = "re-run training") -> bool:
    """Every file the manifest lists is there with its recorded size (and sha256, up to DEEP_LIMIT).
    False when the dir has no manifest (written before runs recorded one)."""
    path = folder / MANIFEST
    if not path.is_file():
        return False
    data = read_json(path, f"delete it to skip the check, or {fix}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise UserError(f"{path}: damaged, no `files` in it; delete it to skip the check, or {fix}")
    problems = [
        (name, _file_problem(folder, name, want if isinstance(want, dict) else {})) for name, want in files.items()
    ]
    problems += [(name, "added after the run wrote it") for name in _added(folder, files, data.get("complete"))]
    for name, problem in problems:
        if problem:
            raise UserError(
                f"{folder / name}: {problem} ({MANIFEST} records what was written); restore it, or {fix} "
                f"(changed on purpose: delete {path})"
            )
    return True


def _file_problem(folder: Path, name: str, want: dict) -> str | None:
    path = folder / name
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != want.get("size"):
        return f"damaged: {size} bytes where {want.get('size')} were written"
    hashed = size <= DEEP_LIMIT or name.startswith(ALWAYS_HASHED)
    if hashed and sha256(path) != want.get("sha256"):
        return "damaged or changed: not the sha256 it was written with"
    return None


def _added(folder: Path, files: dict, complete) -> list[str]:
    """Files in the manifest's complete sub-dirs that it does not list (nor UNLISTED)."""
    added = []
    for sub in complete if isinstance(complete, list) else ():
        for path in sorted((folder / str(sub)).rglob("*")):
            name = path.relative_to(folder).as_posix()
            if path.is_file() and name not in files and path.name not in UNLISTED:
                added.append(name)
    return added


def umask_mode() -> int:
    """The mode a new file gets here (0o644 under the usual umask 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def give_umask_modes(folder: Path) -> None:
    """Every file under `folder` gets the umask's mode: safetensors writes its files 0600, every other
    writer (json, tokenizer files) by the umask, and a run's or merge's files should read alike."""
    mode = umask_mode()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def run_file_names(run_dir: Path) -> list[str]:
    """The files a finished run's manifest lists: config.yaml, metrics.json and the adapter's files (the
    model card, README.md, is written after and left out)."""
    adapter = sorted(
        p.relative_to(run_dir).as_posix()
        for p in (run_dir / "adapter").rglob("*")
        if p.is_file() and p.name not in UNLISTED
    )
    return ["config.yaml", "metrics.json", *adapter]
