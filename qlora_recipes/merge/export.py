"""Export: the merged model written as a standalone transformers dir, safely.

The output goes to `<out>.partial` (`prepare_out`) and is renamed to `<out>` only when everything,
report included, is written (`finish_out`): a failed merge leaves no half model. Tensors stream into
safetensors shards (`ShardWriter`) on the CPU in the output dtype, a shard written as soon as it is
full, so CPU memory stays near one shard. Single shard: `model.safetensors`; several:
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, named as transformers does.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..outputs.rundir import MERGE_REPORT, is_merged_dir
from ..outputs.runfiles import give_umask_modes, write_manifest
from ..units import parse_size

if TYPE_CHECKING:  # torch loads lazily: the checks of bad input answer fast
    import torch


def shard_bytes(value: str | int) -> int:
    """--shard-size in bytes: '2GB' / '500MB' / '512MiB' / a number of bytes (units.parse_size), positive."""
    try:
        size = parse_size(value, "--shard-size")
    except UserError:
        size = 0  # one message for every bad value, worded for this option (not units' "or auto")
    if size < 1:
        raise UserError(f"--shard-size {value}: not a positive size; write e.g. 2GB, 500MB or 512MiB")
    return size


class ShardWriter:
    """Accumulate tensors (on the CPU, in the output dtype) and write a safetensors shard whenever the
    next tensor would take the current one past `max_bytes`; `close` names the shards as
    transformers does and writes the index when there is more than one."""

    def __init__(self, folder: Path, max_bytes: int, dtype: torch.dtype):
        self.folder, self.max_bytes, self.dtype = folder, max_bytes, dtype
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0
        self.params = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor, keep_dtype: bool = False) -> None:
        """`tensor` in the output dtype (`keep_dtype`: as it is, e.g. a vision tower written unchanged)."""
        if name in self.names:
            raise RuntimeError(f"tensor {name} written twice")
        self.names.add(name)
        cast = tensor.is_floating_point() and not keep_dtype
        out = tensor.to("cpu", dtype=self.dtype if cast else tensor.dtype).contiguous()
        nbytes = out.numel() * out.element_size()
        if self.buffer and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buffer[name] = out
        self.size += nbytes
        self.total += nbytes
        self.params += out.numel()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buffer:
            return
        name = f"shard-{len(self.files) + 1:05d}.tmp"
        save_file(self.buffer, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.buffer)))
        self.buffer, self.size = {}, 0

    def close(self) -> list[str]:
        self.flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for (tmp, keys), final in zip(self.files, names, strict=True):
            (self.folder / tmp).rename(self.folder / final)
            weight_map.update(dict.fromkeys(keys, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total, "total_parameters": self.params}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return names


def checkpoint_layout(model, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged tensors under the names and shapes of the base's checkpoint. transformers 5 converts some
    checkpoints while loading (Qwen3-MoE's, Mixtral's per-expert weights fused into 3-D experts) and
    save_pretrained converts them back; the merge does the same, one decoder layer at a time (transformers'
    conversions stay within a layer), so the merged dir has its base's layout, which other tools read too. A model loaded
    without a conversion passes through unchanged."""
    base = model.get_base_model()
    if not getattr(base, "_weight_conversions", None):
        yield from tensors
        return
    from transformers.core_model_loading import revert_weight_conversion

    from .progress import decoder_layers

    prefix = decoder_layers(model)[0]
    layer = re.compile(rf"^{re.escape(prefix)}\.\d+\.") if prefix else None
    group: dict = {}
    key = None
    for name, tensor in tensors:
        match = layer.match(name) if layer else None
        here = match.group(0) if match else name  # outside the decoder layers: each tensor alone
        if group and here != key:
            yield from revert_weight_conversion(base, group).items()
            group = {}
        key = here
        group[name] = tensor
    if group:
        yield from revert_weight_conversion(base, group).items()


def write_config(model, folder: Path, dtype: torch.dtype, names: set[str]) -> None:
    """The base's config.json without quantization, with the merged dtype; its generation config.
    An adapted lm_head of a tied model is written separately, so the merged model is untied."""
    config = copy.deepcopy(model.get_base_model().config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in names:
        config.tie_word_embeddings = False
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(str(folder))
    gen = getattr(model.get_base_model(), "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(folder))


PARTIAL_MARK = ".qlora-merge-partial"  # in `<out>.partial` while merge writes it: only such a dir is removed


def out_lock(out: Path):
    """The lock one merge into `out` holds (`<out>.lock` beside it): a second merge there is refused."""
    from ..run.lock import RunDirLock

    busy = f"merge output {out}; wait for that merge to finish or stop it, or choose another --out"
    return RunDirLock(out.parent, path=out.with_name(out.name + ".lock"), busy=busy)


def prepare_out(out: Path, run_dir: Path) -> Path:
    """A fresh `<out>.partial` to write into; `out` itself must be new, empty or an earlier merge. A
    `<out>.partial` left by a merge that died is removed (the caller holds `out_lock`); one this tool
    did not make is refused."""
    out = out.expanduser()
    if out.resolve() in (run_dir.resolve(), (run_dir / "adapter").resolve()):
        raise UserError(
            f"--out {out}: is the run dir (or its adapter dir); choose a new dir, e.g. {run_dir / 'merged'}"
        )
    if out.exists():
        if not out.is_dir():
            raise UserError(f"--out {out}: exists and is a file; choose a dir")
        if any(out.iterdir()) and not (is_merged_dir(out) or (out / MERGE_REPORT).is_file()):
            raise UserError(
                f"--out {out}: exists and holds other files (not a merged model); choose a new or empty dir"
            )
    partial = out.with_name(out.name + ".partial")
    if partial.exists() or partial.is_symlink():
        if partial.is_symlink() or not (partial / PARTIAL_MARK).is_file():
            raise UserError(
                f"{partial}: exists and was not made by merge (merge writes there before renaming to {out.name}); "
                "move or delete it, or choose another --out"
            )
        shutil.rmtree(partial)  # a merge into `out` that died; none runs now (out_lock)
    partial.mkdir(parents=True)
    (partial / PARTIAL_MARK).write_text("written by qlora merge; removed when the merge finishes\n")
    return partial


def finish_out(partial: Path, out: Path, report: dict) -> None:
    """Write the report and the manifest into `partial`, then put `partial` in the place of `out` (an
    earlier merge there goes only once the new one is in place)."""
    (partial / MERGE_REPORT).write_text(json.dumps(report, indent=2) + "\n")
    (partial / PARTIAL_MARK).unlink()
    give_umask_modes(partial)  # safetensors writes its shards 0600
    files = [p for p in partial.rglob("*") if p.is_file() and p.name != "README.md"]  # push rewrites the card
    names = sorted(str(p.relative_to(partial)) for p in files)
    write_manifest(partial, names)
    if not out.exists():
        partial.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))  # fresh: nothing of the user's
    out.rename(old / out.name)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def write_card(partial: Path, run_dir: Path, report: dict, quality: str, repo_id: str | None) -> None:
    """The merged model's card (README.md) in `partial`, from the run's files and the merge report."""
    from ..integrations.modelcard import run_card
    from ..integrations.modelcard import write_card as write_readme

    write_readme(run_card(run_dir, "merged", repo_id=repo_id, merge={**report, "quality": quality}), partial)


def _portable_json(path: Path, paths: tuple[str, ...], name_or_path: str | None = None) -> bytes:
    """A JSON file as pushed: the named keys' paths of this machine shortened (modelcard.portable)."""
    from ..integrations.modelcard import portable

    data = json.loads(path.read_text())
    for key in paths:
        if isinstance(data.get(key), str):
            data[key] = portable(data[key])
    if "_name_or_path" in data:
        data["_name_or_path"] = name_or_path or portable(data["_name_or_path"])
    return (json.dumps(data, indent=2) + "\n").encode()


def push(out: Path, repo_id: str, private: bool | None, revision: str | None, report: dict, base_id: str | None) -> str:
    """The merged dir in one commit (hub.push_folder); merge_report.json and config.json go with this
    machine's paths shortened. The commit's URL."""
    from ..integrations.hub import push_folder

    replace = {"config.json": _portable_json(out / "config.json", (), base_id)}
    if (out / MERGE_REPORT).is_file():
        replace[MERGE_REPORT] = _portable_json(out / MERGE_REPORT, ("run_dir", "out_dir", "base"), None)
    what = f"{report.get('peft', 'LoRA')} adapter merged into the {report.get('merged_into', 'base')}"
    message = f"qlora-recipes: {what}, {report.get('dtype', '')}".rstrip(", ")
    return push_folder(out, repo_id, private, revision, message, replace=replace)
