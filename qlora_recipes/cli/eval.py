"""`qlora eval RUN_DIR --tasks T[,T...]`: a finished run against its base on lm-evaluation-harness tasks.

    qlora eval RUN_DIR --tasks T[,T...] [--include-path DIR] [--limit N] [--batch-size N]

Runs lm-eval in this process on the run's stack as trained (the 4-bit base + adapter), on the same
base with the adapter off, and on RUN_DIR/merged when a merge is there; prints one table (base vs
tuned, vs merged) with the run's own eval figures (metrics.json), writes it to RUN_DIR/eval.json and
adds it to the adapter's model card (RUN_DIR/adapter/README.md). --include-path: a dir of your own
task YAMLs (lm-eval's TaskManager include path), e.g. a task over local JSON lines, which needs no hub.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..console import quiet_libraries
from ..errors import UserError
from .runner import ArgumentParser, run_plain


def _parser(prog: str) -> ArgumentParser:
    parser = ArgumentParser(
        prog=prog, description=__doc__.split("\n\n", 1)[1], epilog="more: docs/after-training.md ('Evaluate')"
    )
    parser.add_argument("run_dir", help="a run dir written by train (config.yaml + adapter/)")
    parser.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
    parser.add_argument("--include-path", help="a dir of your own lm-eval task YAMLs")
    parser.add_argument("--limit", type=int, help="at most N examples per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (default 8)")
    return parser


def _check(args) -> list[str]:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be at least 1 (leave it out for every example)")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be at least 1")
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def _quiet_lm_eval() -> None:
    """lm-eval's info and warning lines (the in-memory model, default aggregations) are not for the user."""
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run(argv: list[str], prog: str = "qlora eval") -> None:
    parser = _parser(prog)

    def eval_run() -> int:
        args = parser.parse_args(argv)
        tasks = _check(args)
        quiet_libraries(logging.WARNING)
        _quiet_lm_eval()
        from ..integrations.modelcard import run_card, write_card
        from ..outputs.evaluation import evaluate_run, table, write_report

        report = evaluate_run(
            args.run_dir,
            tasks,
            include_path=args.include_path,
            limit=args.limit,
            batch_size=args.batch_size,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        path = write_report(report)
        run_dir = Path(report["run_dir"])
        write_card(run_card(run_dir, "adapter"), run_dir / "adapter")
        print(table(report))
        print(
            f"eval: {path} (lm-eval {report['lm_eval']}, {report['wall_s']:.0f} s); model card: {run_dir}/adapter/README.md"
        )
        return 0

    run_plain(eval_run)
