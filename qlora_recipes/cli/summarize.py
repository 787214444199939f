"""`qlora summarize SWEEP_DIR`: summary.csv, summary.md and summary.png of a Hydra multirun dir.

One row per job (overrides, status, final loss, eval metric, planned and measured peak memory,
tokens/s, the reason for skipped or failed jobs); the plot shows loss against peak memory and
against tokens/s with the Pareto front (lower loss, lower memory, higher tokens/s) marked. A
multirun writes the same files itself when it ends (qlora_recipes.integrations.sweep.SweepSummary); run this
for a sweep that was interrupted or is still going. Exit status 2, with one line, on bad input.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .helptext import docs_pointer, quiet_when_the_reader_goes
from .runner import ArgumentParser, run_plain


def summarize(sweep_dir: Path) -> int:
    from ..integrations.sweep import write_summary

    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir}: no such directory; pass a multirun dir (hydra.sweep.dir)")
    if not any(sweep_dir.glob("*/.hydra/overrides.yaml")):
        raise UserError(f"{sweep_dir}: no job dirs (N/.hydra/overrides.yaml) in it; is it a multirun dir?")
    rows = write_summary(sweep_dir)
    print((sweep_dir / "summary.md").read_text(), end="")
    counts = {s: sum(r["status"] == s for r in rows) for s in dict.fromkeys(r["status"] for r in rows)}
    front = ", ".join(f"{r['job']} ({r['label']})" for r in rows if r["pareto"]) or "none"
    print(f"{len(rows)} jobs ({', '.join(f'{n} {s}' for s, n in counts.items())}); Pareto front: jobs {front}")
    for name in ("summary.csv", "summary.md", "summary.png"):
        if (sweep_dir / name).is_file():
            print(sweep_dir / name)
    return 0


@quiet_when_the_reader_goes()
def run(argv: list[str], prog: str = "qlora summarize") -> None:
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1].strip(), epilog=docs_pointer("Sweeps"))
    parser.add_argument("sweep_dir", type=Path, help="a Hydra multirun dir, e.g. runs/multirun/DATE/TIME")
    run_plain(lambda: summarize(parser.parse_args(argv).sweep_dir))
