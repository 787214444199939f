"""`resume=auto` / `resume.checkpoint`: `resume_checkpoint` runs the stack check, "already complete",
the data and base-model checks, and the fallback past an incomplete or corrupt newest checkpoint.
`data_fingerprint` says what the training data is, `base_fingerprint` what the base weights are:
each checkpoint records both (lifecycle) and a resume compares them.
"""

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from ..config.adapters import adapter_dtype
from ..config.fields import resume_safe_prefixes
from ..config.loader import read_saved
from ..config.schema import DataConfig, ModelConfig, TrainConfig
from ..errors import UserError
from .checkpoints import CHECKPOINT, checkpoint_problem, newest_sound, read_record
from .reuse import ASIDE
from .schedule import lr_factors, schedule_end

log = logging.getLogger(__name__)
CONTENT_HASH_LIMIT = 4 << 30  # data up to this size is fingerprinted by content, larger by size + mtime

# Keys that may differ between a run and its resumption without changing what is trained: the fields
# marked resume_safe in config/schema.py ("group." for a whole group).
RESUME_SAFE_PREFIXES = resume_safe_prefixes(TrainConfig)


class AlreadyComplete(Exception):
    """resume=auto on a run that finished and was not given more steps: nothing to do, exit 0.
    `metrics` is the finished run's metrics.json."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


def _flatten(node, prefix="") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def stack_changes(saved: TrainConfig, current: TrainConfig, dropped: Sequence[str] = ()) -> list[str]:
    """Keys whose change alters what is trained (micro-batch/accumulation may trade off when the
    effective batch is kept: the data position stays exact). A key the saved config lacked (added to
    the schema after that run) reads as its schema default, as the older code did; `dropped` are keys
    the saved config had and this schema no longer reads."""
    a = _flatten(dataclasses.asdict(saved))
    b = _flatten(dataclasses.asdict(current))
    a.update(dict.fromkeys(dropped, _GONE))
    if a.get("peft.adapter_dtype") == "auto":  # a config.yaml from before the key: those runs trained fp32
        a["peft.adapter_dtype"] = "float32"
    if b.get("peft.adapter_dtype") == "auto":  # the run saved what auto resolved to
        b["peft.adapter_dtype"] = adapter_dtype(current)
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(RESUME_SAFE_PREFIXES)]
    if "data.format" in changed and b.get("data.format") == "auto" and _detected_format(current) == a["data.format"]:
        changed.remove("data.format")  # an older run saved the format it detected; auto detects it again
    if "trainer.seq_len" in changed and b.get("trainer.seq_len") == "auto":
        changed.remove("trainer.seq_len")  # the run saved what auto resolved to; the same data resolves it again
    if b.get("trainer.micro_batch_size") == "auto":  # auto splits grad_accum's rows; the run saved its split
        b["trainer.micro_batch_size"] = 1
    batch_keys = {"trainer.micro_batch_size", "trainer.grad_accum"}
    same_effective = a.get("trainer.micro_batch_size", 0) * a.get("trainer.grad_accum", 0) == b.get(
        "trainer.micro_batch_size", 0
    ) * b.get("trainer.grad_accum", 0)
    return [k for k in changed if not (k in batch_keys and same_effective)]


_GONE = object()  # the value of a saved key that the current schema no longer has


def _detected_format(cfg: TrainConfig) -> str | None:
    """The format `data.format=auto` detects in the training data now; None when it cannot be read."""
    from ..data.formats import detect
    from ..data.readers import read_source

    try:
        rows, _ = read_source(cfg.data.path, cfg.data.split or "train", "data.path")
        return detect(rows)
    except UserError:
        return None


def resume_checkpoint(cfg: TrainConfig, run_dir: Path) -> str | None:
    """The checkpoint to resume from (None: start fresh), after checking it belongs to this stack
    and this data. resume=auto on a finished run with no more steps asked for raises
    AlreadyComplete; an incomplete or corrupt newest checkpoint is skipped, saying so in one line."""
    from omegaconf.errors import OmegaConfBaseException

    r = cfg.resume
    if not r.auto and not r.checkpoint:
        return None
    if r.checkpoint:
        checkpoint = Path(r.checkpoint)
        if not CHECKPOINT.match(checkpoint.name) or not (checkpoint / "trainer_state.json").is_file():
            raise UserError(
                f"resume.checkpoint={checkpoint}: not a complete checkpoint dir (checkpoint-N with trainer_state.json)"
            )
        problem = checkpoint_problem(checkpoint, deep=True)
        if problem:
            raise UserError(f"resume.checkpoint={checkpoint}: incomplete or corrupt ({problem}); choose another one")
        owner = checkpoint.parent.parent
    else:
        found, skipped = newest_sound(run_dir / "checkpoints", deep=True)
        if skipped:
            fallback = f"falling back to {Path(found).name}" if found else "no complete checkpoint is left"
            log.warning("resume: skipping incomplete or corrupt %s; %s", "; ".join(skipped), fallback)
        checkpoint, owner = (Path(found) if found else None), run_dir
        if checkpoint is None and _finished_run(run_dir) is None:
            log.warning("resume=auto: no complete checkpoint in %s; starting fresh", run_dir / "checkpoints")
            return None
    saved = owner / "config.yaml"
    if not saved.is_file() and (owner / ASIDE / "config.yaml").is_file():
        # another rank of this job has set the run's files aside to write its own (run/reuse.py): the
        # same saved config, read where it is for the moment
        saved = owner / ASIDE / "config.yaml"
    if not saved.is_file():
        raise UserError(f"resume: {owner} has no config.yaml, so it is not a run dir of this repository")
    dropped: list[str] = []
    try:
        saved_cfg = read_saved(saved, dropped)
    except (OmegaConfBaseException, ValueError) as err:  # yaml errors are ValueErrors too
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"resume: {saved} is not a config this version of train.py can read ({first})") from None
    changed = stack_changes(saved_cfg, cfg, dropped)
    record = read_record(checkpoint)
    if changed and not r.allow_changes:
        # another rank count first: it alone can change what auto resolves to (peft.adapter_dtype is bf16 in
        # one process only), and its line says how to relaunch; a relaunch as trained then names what else differs
        _check_world_size(cfg, checkpoint, record)
        raise UserError(
            f"resume: this stack differs from the one that wrote {checkpoint or owner} in {', '.join(changed)}; "
            "relaunch with the original values, or set resume.allow_changes=true"
        )
    if not r.checkpoint:
        _unless_complete(cfg, run_dir, checkpoint, record, saved_cfg)
    _check_world_size(cfg, checkpoint, record)
    _check_data(cfg, checkpoint, record)
    _check_base(cfg, checkpoint, record)
    _check_schedule_goes_on(cfg, checkpoint, record)
    return str(checkpoint) if checkpoint else None


def _finished_run(run_dir: Path) -> dict | None:
    """metrics.json of a run that finished (status ok, adapter/ written), else None."""
    path = run_dir / "metrics.json"
    if not (run_dir / "adapter").is_dir() or not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text())
    except ValueError:
        return None
    return metrics if metrics.get("status") == "ok" else None


def _target_steps(cfg: TrainConfig, record: dict, saved_cfg: TrainConfig | None, done: int) -> int | None:
    """The total this config asks for, in optimizer steps; None: more than `done`, by an amount only
    the data loader knows (trainer.epochs raised with no checkpoint to say how long an epoch is)."""
    t = cfg.trainer
    if t.max_steps > 0:
        return t.max_steps
    if record.get("steps_per_epoch"):
        return math.ceil(t.epochs * record["steps_per_epoch"])  # transformers' own rounding
    if saved_cfg is not None and saved_cfg.trainer.max_steps <= 0 and t.epochs <= saved_cfg.trainer.epochs:
        return done
    return None


def _unless_complete(
    cfg: TrainConfig, run_dir: Path, checkpoint: Path | None, record: dict, saved_cfg: TrainConfig
) -> None:
    """A finished run (adapter/ and metrics.json, no checkpoint past it) resumed without more steps
    is complete: raise AlreadyComplete. With more steps it continues from its last checkpoint."""
    done = _finished_run(run_dir)
    if done is None:
        return
    steps = int(done.get("steps") or 0)
    if checkpoint is not None and int(CHECKPOINT.match(checkpoint.name).group(1)) > steps:
        return  # a continuation got further than the finished run: go on with it
    target = _target_steps(cfg, record, saved_cfg, steps)
    if target is not None and target <= steps:
        raise AlreadyComplete(
            f"resume: the run in {run_dir} already completed {steps} steps (adapter/, metrics.json); nothing to do "
            "and nothing changed. Raise trainer.max_steps or trainer.epochs to train further",
            done,
        )
    if checkpoint is None:
        raise UserError(
            f"resume: the run in {run_dir} finished at step {steps} and kept no checkpoint to continue from "
            "(trainer.save_steps=0); train the longer run in a new run dir"
        )


def _check_world_size(cfg: TrainConfig, checkpoint: Path | None, record: dict) -> None:
    """The checkpoint's ranks (WORLD_SIZE when it was written) must be this run's: each optimizer
    step takes a micro-batch per rank, so another number changes the global batch and where in the
    data the run goes on. resume.allow_changes=true accepts it."""
    saved, now = record.get("world_size"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    if checkpoint is None or not saved or saved == now:
        return  # the same; or written before checkpoints recorded it
    batch = cfg.trainer.micro_batch_size * cfg.trainer.grad_accum
    ranks = lambda n: "1 process" if n == 1 else f"{n} ranks"  # noqa: E731
    what = (
        f"{checkpoint.name} was trained on {ranks(saved)} (global batch {saved * batch}) and this run is "
        f"{ranks(now)} (global batch {now * batch})"
    )
    how = (
        "as one process" if saved == 1 else f"on {saved} ranks (torchrun --nproc_per_node {saved} ..., or qlora launch)"
    )
    _refuse_unless_allowed(
        cfg,
        what,
        f"on {ranks(now)}",
        f"so the batches and the data position would change; start it {how} as the run's resume line says, or set "
        "resume.allow_changes=true",
    )


def _check_data(cfg: TrainConfig, checkpoint: Path, record: dict) -> None:
    """The training data must be the bytes the checkpoint was trained on: its saved data position
    would otherwise point into other examples. resume.allow_changes=true accepts new data."""
    saved = record.get("data") or {}
    if checkpoint is None:
        return
    if not saved:
        log.warning(
            "resume: %s has no data fingerprint (written before checkpoints recorded one), so the training data "
            "could not be checked; resuming on %s as it is now",
            checkpoint.name,
            cfg.data.path,
        )
        return
    if "sha256" not in saved:
        return  # a hub dataset: not fingerprinted
    now = data_fingerprint(cfg.data)
    if "sha256" not in now or now["sha256"] == saved["sha256"]:
        return  # equal; or the path is gone, which loading the data reports
    what = (
        f"the training data {saved['path']} changed since {checkpoint.name} was written ({saved['files']} file(s), "
        f"{saved['bytes']} bytes, sha256 {saved['sha256'][:12]} -> {now['files']} file(s), {now['bytes']} bytes, "
        f"sha256 {now['sha256'][:12]})"
    )
    _refuse_unless_allowed(
        cfg,
        what,
        "on the new data",
        "so the saved data position would point into other examples; restore the original data, train in a new "
        "run dir, or set resume.allow_changes=true to continue on the new data",
    )


def _check_base(cfg: TrainConfig, checkpoint: Path | None, record: dict) -> None:
    """The base weights must be the ones the checkpoint's adapter was trained on: the same path
    holding other weights (a re-download of another revision, a merged model saved over it) would
    go on silently with a meaningless adapter. resume.allow_changes=true accepts new weights."""
    saved = record.get("base") or {}
    if checkpoint is None or "sha256" not in saved:
        return  # written before checkpoints recorded the base, or a hub id: not checked
    now = base_fingerprint(cfg.model)
    if "sha256" not in now or now["sha256"] == saved["sha256"]:
        return  # the same; or the dir is gone, which the model check reports
    what = (
        f"the base model {saved['path']} changed since {checkpoint.name} was written (config.json and weights: "
        f"{saved['files']} file(s), {saved['bytes']} bytes, sha256 {saved['sha256'][:12]} -> {now['files']} file(s), "
        f"{now['bytes']} bytes, sha256 {now['sha256'][:12]})"
    )
    _refuse_unless_allowed(
        cfg,
        what,
        "on the new weights",
        "and the adapter was trained on the other weights; restore them, train in a new run dir, or set "
        "resume.allow_changes=true to continue on these",
    )


def _refuse_unless_allowed(cfg: TrainConfig, what: str, continuing: str, refusal: str) -> None:
    """A change since the checkpoint: one warning under resume.allow_changes=true, else one line."""
    if cfg.resume.allow_changes:
        log.warning("resume: %s; continuing %s (resume.allow_changes=true)", what, continuing)
        return
    raise UserError(f"resume: {what}, {refusal}")


def _check_schedule_goes_on(cfg: TrainConfig, checkpoint: Path, record: dict) -> None:
    """More steps after the schedule has ended run at its final LR (continue_schedule); where that
    is 0 (cosine, linear) they cannot change the adapter, and the run says so in one line."""
    schedule, step = record.get("schedule"), record.get("step")
    if not schedule or step is None:
        return
    target, end = _target_steps(cfg, record, None, step), schedule_end(schedule)
    if target is None or target <= step or step < end:
        return
    if max(lr_factors(schedule, end)) == 0:
        log.warning(
            "resume: %s is at the end of its %s LR schedule (step %d), where the learning rate is 0: the %d more "
            "steps run at LR 0 and do not change the adapter; raise trainer.max_steps or trainer.epochs before a run "
            "ends, or start a new run for more training",
            checkpoint.name,
            schedule["type"],
            end,
            target - step,
        )


# ---------------------------------------------------------------- data fingerprint
_FINGERPRINTS: dict = {}
# One fingerprint computed at a time: a caller finds one that prefetch_fingerprints is computing
# done, instead of hashing the same bytes beside it.
_COMPUTING = threading.Lock()


def prefetch_fingerprints(cfg: TrainConfig) -> threading.Thread:
    """Fingerprints the training data and the base on a thread, started once the data is read: the
    guarded trainer records both in every checkpoint and asks for them as its timed part begins, and
    hashing a large data file there (all of it up to CONTENT_HASH_LIMIT) would be a second pass over
    the data inside train_s. hashlib and file reads release the GIL, so this overlaps the model's load."""

    def work() -> None:
        try:
            data_fingerprint(cfg.data)
            base_fingerprint(cfg.model)
        except Exception:  # noqa: BLE001 - the trainer's own call computes it again and says what failed
            pass

    thread = threading.Thread(target=work, name="fingerprints", daemon=True)
    thread.start()
    return thread


def data_fingerprint(data_cfg: DataConfig) -> dict:
    """What the training data (`data.path`) is: for a local file or dir, its files' count, bytes
    and a sha256 over their names and contents (over names, sizes and mtimes above
    CONTENT_HASH_LIMIT); for a hub dataset, its name only (not checked)."""
    spec = str(data_cfg.path or "").strip()
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        root, files = path.parent, [path]
    elif path.is_dir():
        root = path
        files = sorted(
            f
            for f in path.rglob("*")
            if f.is_file()
            and not any(part.startswith(".") for part in f.relative_to(path).parts)
            and not f.name.startswith("cache-")  # datasets' own cache files
        )
    else:
        return {"path": spec, "kind": "hub"}
    stats = [(str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = (str(path.resolve()), tuple(stats))
    with _COMPUTING:
        if key not in _FINGERPRINTS:
            _FINGERPRINTS[key] = _data_digest(path, files, stats)
    return _FINGERPRINTS[key]


def _data_digest(path: Path, files: list[Path], stats: list[tuple]) -> dict:
    total = sum(size for _, size, _ in stats)
    by_content = total <= CONTENT_HASH_LIMIT
    digest = hashlib.sha256()
    for (rel, size, mtime), f in zip(stats, files, strict=True):
        digest.update(f"{rel}\0{size}\0".encode())
        if by_content:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
        else:
            digest.update(str(mtime).encode())
    return {
        "path": str(path.resolve()),
        "files": len(files),
        "bytes": total,
        "sha256": digest.hexdigest(),
        "kind": "content" if by_content else "size+mtime",
    }


# ---------------------------------------------------------------- base fingerprint
BASE_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")  # weights and shard indexes, beside config.json
SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # per weight file: 16 pieces of 64 KiB spread over it (all of a small file)


def base_fingerprint(model_cfg: ModelConfig) -> dict:
    """What the base model is: for a local dir, its config.json and weight files' count, bytes and
    a sha256 over their names, sizes, config.json and, per weight file, SAMPLES pieces of its bytes
    spread from its header to its end (a copy matches, other weights of the same shapes do not;
    about 1 MiB read per file). A hub id: its name only (not checked; model.revision pins it)."""
    spec = str(model_cfg.name_or_path or "").strip()
    path = Path(os.path.expanduser(spec))
    if not path.is_dir():
        return {"path": spec, "kind": "hub"}
    files = sorted(
        f for f in path.iterdir() if f.is_file() and (f.name == "config.json" or f.name.endswith(BASE_FILES))
    )
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = ("base", str(path.resolve()), tuple(stats))
    with _COMPUTING:
        if key not in _FINGERPRINTS:
            _FINGERPRINTS[key] = _base_digest(path, files, stats)
    return _FINGERPRINTS[key]


def _base_digest(path: Path, files: list[Path], stats: list[tuple]) -> dict:
    digest = hashlib.sha256()
    for (name, size, _), f in zip(stats, files, strict=True):
        digest.update(f"{name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for offset in _sample_offsets(size):
                fh.seek(offset)
                digest.update(fh.read(SAMPLE_BYTES))
    return {
        "path": str(path.resolve()),
        "files": len(files),
        "bytes": sum(size for _, size, _ in stats),
        "sha256": digest.hexdigest(),
        "kind": "sampled",
    }


def _sample_offsets(size: int) -> range | list[int]:
    """Where the pieces start: back to back over a small file, else evenly from 0 to the last piece."""
    if size <= SAMPLES * SAMPLE_BYTES:
        return range(0, size, SAMPLE_BYTES)
    last = size - SAMPLE_BYTES
    return [i * last // (SAMPLES - 1) for i in range(SAMPLES)]
