"""`qlora export RUN --to gguf`: the merged model as one GGUF file, with an Ollama Modelfile beside it.

    export_gguf(path, quant="f16", out=None, progress=print) -> report

`path` is a run dir (its RUN/merged is used, made first with the merge pipeline when missing) or a
merged dir. llama.cpp's own converter (converter.py) writes `model-QUANT.gguf` into `<out>.partial`;
the file is read back and held to the merged weights (readback.py); the Modelfile (ollama.py) and
export_report.json join it, and the dir is renamed to `out` (default: RUN/gguf, or MERGED-gguf
beside a merged dir): complete or absent. A model the converter refuses (a tokenizer it cannot read,
a family it does not know) is one line naming what it refused; nothing is left.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from ..outputs.rundir import is_merged_dir, resolve_dir
from . import converter

QUANTS = ("f16", "bf16", "q8_0")
REPORT = "export_report.json"
PARTIAL_MARK = ".qlora-export-partial"  # an unfinished export's dir, safe to clear


def _tokenizer_kind(model_dir: Path) -> str:
    """How the model's tokenizer is stored: the tokenizers model type of tokenizer.json, or a SentencePiece file."""
    if (model_dir / "tokenizer.model").is_file():
        return "SentencePiece (tokenizer.model)"
    try:
        kind = json.loads((model_dir / "tokenizer.json").read_text())["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no tokenizer.json"
    return f"{kind} (tokenizer.json)"


def refusal(model_dir: Path, stderr: str, shown: Path | None = None) -> str:
    """The converter's failure on `model_dir` (`shown`: the dir the user named) as one line: what it
    refused, and what it takes."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    last = next(
        (ln for ln in reversed(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)), lines[-1] if lines else ""
    )
    who = f"llama.cpp's converter ({converter.PACKAGE} {converter.VERSION}) refused {shown or model_dir}"
    arch = re.search(r"Architecture '?([\w.]+)'? not supported", last)
    if arch:
        return f"{who}: its model family {arch.group(1)} (config.json architectures) is none it converts; nothing was written"
    if (
        "pre-tokenizer was not recognized" in last
        or "Cannot find Llama BPE tokenizer" in last
        or "tokenizer" in last.lower()
    ):
        return (
            f"{who}: its tokenizer, {_tokenizer_kind(model_dir)}, is no tokenizer it converts ({last}); it takes a "
            "SentencePiece tokenizer.model, a Llama-style byte-fallback BPE, or a BPE whose pre-tokenizer it "
            "knows (published models'); nothing was written"
        )
    return f"{who}: {last or 'no message'}; nothing was written"


def _vocab_first(kind: str, folder: Path) -> None:
    """The converter's vocabulary step alone (--vocab-only) before a merge or a conversion is spent on
    the model: a run's tokenizer (adapter/) with its base's config.json, or a merged dir; a tokenizer
    it refuses is the one line here."""
    import tempfile

    if kind == "merged":
        tokenizer_dir, config = folder, folder / "config.json"
    else:
        from ..outputs.rundir import load_run_config

        tokenizer_dir = folder / "adapter"
        config = Path(str(load_run_config(folder).model.name_or_path)).expanduser() / "config.json"
        if not config.is_file():
            return  # a hub id: the merge brings its config, the conversion then says what it refuses
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(config, Path(tmp) / "config.json")
        for f in tokenizer_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens")):
                shutil.copy(f, tmp)
        proc = converter.run_converter(Path(tmp), Path(tmp) / "vocab.gguf", "f16", vocab_only=True)
    if proc.returncode != 0:
        raise UserError(refusal(tokenizer_dir, proc.stderr, folder))


def _source(kind: str, folder: Path, progress: Callable[[str], None]) -> tuple[Path, Path]:
    """(the merged dir, the default out dir); a run without RUN/merged is merged first."""
    if kind == "merged":
        return folder, folder.with_name(folder.name + "-gguf")
    merged = folder / "merged"
    if not is_merged_dir(merged):
        from ..merge.pipeline import merge

        progress(f"export: {merged} is not there yet; merging first (qlora merge {folder}) ...")
        merge(folder)
    return merged, folder / "gguf"


def _prepare(out: Path) -> Path:
    if out.exists() and not (out / REPORT).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is no earlier export (no {REPORT}); choose a new or empty dir")
    partial = out.with_name(out.name + ".partial")
    if partial.exists() or partial.is_symlink():
        if partial.is_symlink() or not (partial / PARTIAL_MARK).is_file():
            raise UserError(
                f"{partial}: exists and was not made by qlora export; move or delete it, or choose another --out"
            )
        shutil.rmtree(partial)  # an export that died
    partial.mkdir(parents=True)
    (partial / PARTIAL_MARK).write_text("written by qlora export; renamed into place when the export finishes\n")
    return partial


def _finish(partial: Path, out: Path) -> None:
    (partial / PARTIAL_MARK).unlink()
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def export_gguf(
    path: str | Path, quant: str = "f16", out: str | Path | None = None, progress: Callable[[str], None] = print
) -> dict:
    """The GGUF of a run's merged model, read back and checked, with its Modelfile; returns the report."""
    from ..outputs.generation import check_merged
    from .ollama import modelfile
    from .readback import check_gguf

    if quant not in QUANTS:
        raise UserError(f"--quant {quant}: use one of {', '.join(QUANTS)}")
    kind, folder = resolve_dir(path, allow_merged=True)  # bad input before anything runs
    converter.converter_dir()
    started = time.time()
    _vocab_first(kind, folder)
    merged, default_out = _source(kind, folder, progress)
    check_merged(merged)  # its files as merge wrote them
    out = Path(out).expanduser() if out else default_out
    partial = _prepare(out)
    try:
        name = f"model-{quant}.gguf"
        progress(f"export: converting {merged} to {quant} with llama.cpp's converter ...")
        proc = converter.run_converter(merged, partial / name, quant)
        if proc.returncode != 0 or not (partial / name).is_file():
            raise UserError(refusal(merged, proc.stderr))
        progress(f"export: reading {name} back against the merged weights ...")
        check = check_gguf(partial / name, merged)
        (partial / "Modelfile").write_text(modelfile(merged, name))
        report = {
            "merged_dir": str(merged),
            "gguf": name,
            "quant": quant,
            "converter": f"{converter.PACKAGE} {converter.VERSION} (sha256 {converter.SDIST_SHA256})",
            "bytes": (partial / name).stat().st_size,
            "check": check,
            "wall_s": round(time.time() - started, 1),
        }
        (partial / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        _finish(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    report["out_dir"] = str(out)
    return report
