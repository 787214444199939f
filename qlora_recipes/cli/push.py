"""`qlora push DIR REPO`: push a run's adapter, or a merged model, with its model card, to the Hugging Face Hub.

    qlora push RUN_DIR REPO [--private] [--revision BRANCH]      the run's adapter (RUN_DIR/adapter)
    qlora push MERGED_DIR REPO [--private] [--revision BRANCH]   a model `qlora merge` wrote

What `hub.push=true` does after training and `qlora merge --push-to-hub` after merging, for a dir
already on disk (e.g. after a push that failed). The card is written again naming REPO; the token
comes from HF_TOKEN or `hf auth login`; the push is one commit, all files or none, with
huggingface_hub's upload progress bars (HF_HUB_DISABLE_PROGRESS_BARS=1 turns them off).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .runner import ArgumentParser, run_plain


def _parser(prog: str) -> ArgumentParser:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1])
    parser.add_argument("dir", help="a run dir written by train (or its adapter/), or a merged model dir")
    parser.add_argument("repo", help="the hub repo: USER/NAME or ORG/NAME (created when missing)")
    parser.add_argument("--private", action="store_true", default=None, help="create the repo private (when new)")
    parser.add_argument("--revision", help="the branch to commit to (created when missing; default: main)")
    return parser


def _push_merged(folder: Path, repo: str, private: bool | None, revision: str | None) -> str:
    """A merged dir: its card written again for `repo` when the run it came from is still here."""
    from ..integrations.modelcard import base_model
    from ..merge import export
    from ..merge.quality import quality_line
    from ..outputs.generation import check_merged
    from ..outputs.rundir import MERGE_REPORT, load_run_config
    from ..outputs.runfiles import read_json

    check_merged(folder)  # damaged files are named before anything is pushed
    report = read_json(folder / MERGE_REPORT) if (folder / MERGE_REPORT).is_file() else {}
    run_dir = Path(report.get("run_dir", "")) if report.get("run_dir") else None
    base_id = None
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        export.write_card(folder, run_dir, report, quality_line(report), repo)
        base_id = base_model(load_run_config(run_dir).model)[0]
    return export.push(folder, repo, private, revision, report, base_id)


def run(argv: list[str], prog: str = "qlora push") -> None:
    parser = _parser(prog)

    def push_run() -> int:
        args = parser.parse_args(argv)
        from ..integrations.hub import check_push, push_adapter, quiet_but_upload_progress

        quiet_but_upload_progress(logging.INFO)  # huggingface_hub's upload bars stay on for the push
        from ..outputs.rundir import load_run_config, resolve_dir

        kind, path = resolve_dir(args.dir, allow_merged=True)
        check_push(args.repo, args.revision, flag="qlora push")
        if kind == "run":
            url = push_adapter(load_run_config(path), path, args.repo, args.private, args.revision)
        else:
            url = _push_merged(path, args.repo, args.private, args.revision)
        print(f"pushed the {'adapter' if kind == 'run' else 'merged model'} to {url}")
        return 0

    run_plain(push_run)
