"""Summarise a Hydra multirun dir: summary.csv, summary.md and summary.png in that dir.

    python scripts/summarize_sweep.py runs/multirun/2026-11-21/12-00-00
    make summarize ARGS=runs/multirun/2026-11-21/12-00-00

One row per job (overrides, status, final loss, eval metric, planned and measured peak memory,
tokens/s, the reason for skipped or failed jobs); the plot shows loss against peak memory and
against tokens/s with the Pareto front (lower loss, lower memory, higher tokens/s) marked. A
multirun writes the same files itself when it ends (qlora_recipes.sweep.SweepSummary); run this
for a sweep that was interrupted or is still going. Exit status 2, with one line, on bad input.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_recipes.errors import UserError  # noqa: E402


def main(argv: list[str]) -> int:
    from qlora_recipes.sweep import write_summary

    if len(argv) != 1 or argv[0].startswith("-"):
        raise UserError(
            "usage: scripts/summarize_sweep.py SWEEP_DIR (a Hydra multirun dir, e.g. runs/multirun/DATE/TIME)"
        )
    sweep_dir = Path(argv[0])
    if not sweep_dir.is_dir():
        raise UserError(f"{sweep_dir}: no such directory; pass a multirun dir (hydra.sweep.dir)")
    if not any(sweep_dir.glob("*/.hydra/overrides.yaml")):
        raise UserError(f"{sweep_dir}: no job dirs (N/.hydra/overrides.yaml) in it; is it a multirun dir?")
    rows = write_summary(sweep_dir)
    print((sweep_dir / "summary.md").read_text(), end="")
    counts = {s: sum(r["status"] == s for r in rows) for s in dict.fromkeys(r["status"] for r in rows)}
    front = ", ".join(r["job"] for r in rows if r["pareto"]) or "none"
    print(f"{len(rows)} jobs ({', '.join(f'{n} {s}' for s, n in counts.items())}); Pareto front: jobs {front}")
    for name in ("summary.csv", "summary.md", "summary.png"):
        if (sweep_dir / name).is_file():
            print(sweep_dir / name)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
