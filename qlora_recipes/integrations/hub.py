"""The Hugging Face Hub: an adapter's model card after training, and pushing an adapter or a merged model.

    check_push(repo_id, revision, flag)   before any work: a valid repo id, the hub not offline, a
                                                   token, and the hub reachable with it (one UserError line)
    publish_adapter(cfg, run_dir)    adapter/README.md (modelcard.py); with hub.push=true the adapter pushed
    push_adapter(cfg, run_dir, repo_id, private, revision)   that push (also `qlora push RUN_DIR REPO`)
    push_folder(folder, repo_id, private, revision, message, replace)   one commit: every file or none
    quiet_but_upload_progress(level)   a pushing command's quiet setup that keeps the upload's progress bars

The token is never passed, printed or written by this code: huggingface_hub reads it itself (HF_TOKEN,
then the token file `hf auth login` wrote), and the config has no key for it. A push is one
`create_commit`, which the hub applies whole or not at all, so a failed or interrupted push leaves
the repo as it was (large files uploaded before the commit stay unreferenced).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from ..config.schema import TrainConfig
from ..console import library_bars_on
from ..errors import UserError

log = logging.getLogger("train")

# Files of a local run that a hub repo has no use for: the pickled TrainingArguments hold this
# machine's paths; a half-written card or weights left by an interrupted write are never pushed.
NOT_PUSHED = ("training_args.bin",)
NOT_PUSHED_SUFFIXES = (".partial", ".tmp", ".lock")
PROGRESS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"  # huggingface_hub's switch, which wins over its calls


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return re.sub(r"\s+", " ", text.splitlines()[0]) if text else type(err).__name__


def check_push(repo_id: str | None, revision: str | None, flag: str = "hub.push=true") -> None:
    """Everything a push needs, checked before the work that produces what is pushed."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    key = "hub.repo_id" if flag.startswith("hub.") else "the repo id"
    if not repo_id:
        raise UserError(f"{flag} needs {key}=USER/NAME (or ORG/NAME): the hub repo to push to")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise UserError(f"{key}={repo_id} is not a hub repo id ({_first_line(err)}); write USER/NAME") from None
    if revision is not None and not re.fullmatch(r"[\w][\w.\-/]*", revision):
        raise UserError(f"revision {revision!r} is not a branch name; use letters, digits, '-', '_', '.', '/'")
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{flag}: the hub is switched off here (HF_HUB_OFFLINE=1); unset it to push, or drop {flag}")
    if get_token() is None:
        raise UserError(
            f"{flag} needs a Hugging Face token with write access: set HF_TOKEN or run `hf auth login` "
            "(it is read from there, never from the config)"
        )
    from huggingface_hub import HfApi

    try:
        HfApi().whoami()
    except Exception as err:  # network, TLS, a rejected token: each library raises its own types
        raise UserError(
            f"{flag}: cannot reach the hub at {constants.ENDPOINT} ({_first_line(err)}); check the network and "
            f"the token, or drop {flag}"
        ) from None


def quiet_but_upload_progress(log_level: int) -> None:
    """console.quiet_libraries for a command that pushes, minus its HF_HUB_DISABLE_PROGRESS_BARS=1: that
    variable, read when huggingface_hub is imported, would also silence the upload's own progress
    bars for good. The bars are switched off in code instead (transformers' loading bars follow
    that when it is imported), and `upload_progress` switches them on for the push. A user's own
    HF_HUB_DISABLE_PROGRESS_BARS is kept."""
    from ..console import quiet_libraries

    users = os.environ.get(PROGRESS_ENV)
    quiet_libraries(log_level)
    if users is None:
        os.environ.pop(PROGRESS_ENV, None)
        from huggingface_hub import constants
        from huggingface_hub.utils import disable_progress_bars

        if constants.HF_HUB_DISABLE_PROGRESS_BARS is None:  # huggingface_hub was not imported with it set
            disable_progress_bars()


def upload_progress():
    """huggingface_hub's progress bars on while a push uploads (a merged model takes minutes), unless
    HF_HUB_DISABLE_PROGRESS_BARS=1 was set when it was imported; as they were afterwards."""
    from huggingface_hub import constants
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    env_decides = constants.HF_HUB_DISABLE_PROGRESS_BARS is not None
    return library_bars_on(env_decides, are_progress_bars_disabled, enable_progress_bars, disable_progress_bars)


def _files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.name not in NOT_PUSHED and not p.name.endswith(NOT_PUSHED_SUFFIXES)
    )


def push_folder(
    folder: Path,
    repo_id: str,
    private: bool | None,
    revision: str | None,
    message: str,
    replace: dict[str, bytes] | None = None,
) -> str:
    """Every file of `folder` (some replaced by the given bytes) in one commit to `repo_id`; the commit's
    URL. A failure is one UserError line, and the repo keeps what it had."""
    from huggingface_hub import CommitOperationAdd, HfApi

    replace = replace or {}
    api = HfApi()
    operations = []
    for path in _files(folder):
        rel = path.relative_to(folder).as_posix()
        operations.append(CommitOperationAdd(path_in_repo=rel, path_or_fileobj=replace.get(rel, str(path))))
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        with upload_progress():
            commit = api.create_commit(repo_id, operations=operations, commit_message=message, revision=revision)
    except Exception as err:  # network, permissions, quota: the commit either happened whole or not at all
        raise UserError(
            f"pushing {folder} to {repo_id} failed, nothing was committed ({_first_line(err)}); "
            f"the files stay in {folder}; push them again with: qlora push {folder} {repo_id}"
        ) from None
    return commit.commit_url


def portable_adapter_config(adapter_dir: Path, base_id: str | None) -> dict[str, bytes]:
    """adapter_config.json as pushed: `base_model_name_or_path` is the base's hub id (peft loads the
    base from it), never this machine's path; the local copy is left as the run's loaders read it."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    from .modelcard import portable

    config["base_model_name_or_path"] = base_id or portable(config.get("base_model_name_or_path", ""))
    return {"adapter_config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}


def publish_adapter(cfg: TrainConfig, run_dir: Path) -> None:
    """The adapter's model card (adapter/README.md), and with hub.push=true the adapter dir in one commit."""
    from . import modelcard

    if not cfg.hub.push:
        modelcard.write_card(modelcard.run_card(Path(run_dir), "adapter"), Path(run_dir) / "adapter")
        return
    url = push_adapter(cfg, run_dir, cfg.hub.repo_id, cfg.hub.private, cfg.hub.revision)
    log.info("hub: pushed the adapter to %s", url)
    print(f"pushed the adapter to {url}", flush=True)


def push_adapter(cfg: TrainConfig, run_dir: Path, repo_id: str, private: bool | None, revision: str | None) -> str:
    """The run's adapter dir, its card naming `repo_id`, in one commit; the commit's URL."""
    from . import modelcard

    adapter = Path(run_dir) / "adapter"
    card = modelcard.run_card(Path(run_dir), "adapter", repo_id=repo_id)
    modelcard.write_card(card, adapter)
    base_id, _ = modelcard.base_model(cfg.model)
    return push_folder(
        adapter,
        repo_id,
        private,
        revision,
        f"qlora-recipes: {cfg.peft.method} adapter, {repo_id}",
        replace=portable_adapter_config(adapter, base_id),
    )
