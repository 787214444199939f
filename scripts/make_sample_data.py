"""Write the shipped sample fine-tuning set: teach the tiny base a new instruction, `order: s`.

The tiny base (scripts/make_tiny_model.py) knows `sort: s` but has never seen `order:`; after the
fine-tune, greedy generations on held-out strings match the sorted string. Eval strings never occur
in train. Seeded, so the files are reproducible byte for byte.

    python scripts/make_sample_data.py [--out assets/data/order] [--train 2000] [--eval 64]
"""

import argparse
import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def row(s: str) -> dict:
    return {"prompt": f"order: {s}\n", "completion": "".join(sorted(s))}


def make(out: Path, n_train: int, n_eval: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    seen: set[str] = set()

    def fresh() -> str:
        while True:
            s = "".join(rng.sample(LETTERS, rng.randint(3, 6)))
            if s not in seen:
                seen.add(s)
                return s

    eval_rows = [row(fresh()) for _ in range(n_eval)]
    train_rows = [row(fresh()) for _ in range(n_train)]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {n_train} train and {n_eval} eval rows to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "data" / "order")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=64)
    args = parser.parse_args()
    make(args.out, args.train, args.eval)


if __name__ == "__main__":
    main()
