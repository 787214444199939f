"""Write the shipped sample fine-tuning set: teach the tiny base a new instruction, `order: s`.

The tiny base (scripts/make_tiny_model.py) knows `sort: s` but has never seen `order:`; after the
fine-tune, greedy generations on held-out strings match the sorted string. Eval strings never occur
in train. Seeded, so the files are reproducible byte for byte.

Beside them, `preference/` holds the same prompts as preference pairs for `objective=dpo`: chosen the
sorted string, rejected a plausible wrong answer (the string as given, two neighbouring letters of the
sorted string swapped, or the sorted string reversed), picked by a second seeded generator so the SFT
files stay as they were. `kto/` holds those pairs as unpaired rows for `objective=kto`: each pair's
chosen answer a row labelled true, its rejected answer one labelled false, in an order shuffled by a
third seeded generator (KTO trains in file order and estimates its KL term within each micro-batch).

And `grpo/` holds the same prompts with their reference answers (`prompt`, `answer`) for
`objective=grpo`: the rewards score sampled completions against `answer`.

    python scripts/make_sample_data.py [--out assets/data/order] [--train 2000] [--eval 64]
"""

import argparse
import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def row(s: str) -> dict:
    return {"prompt": f"order: {s}\n", "completion": "".join(sorted(s))}


def wrong(s: str, rng: random.Random) -> str:
    """A plausible wrong answer to `order: s`, never the sorted string."""
    right = "".join(sorted(s))
    i = rng.randrange(len(right) - 1)
    candidates = [s, right[:i] + right[i + 1] + right[i] + right[i + 2 :], right[::-1]]
    return rng.choice([c for c in candidates if c != right])


def pair(sft_row: dict, rng: random.Random) -> dict:
    s = sft_row["prompt"].removeprefix("order: ").rstrip("\n")
    return {"prompt": sft_row["prompt"], "chosen": sft_row["completion"], "rejected": wrong(s, rng)}


def unpaired(pairs: list[dict], rng: random.Random) -> list[dict]:
    rows = [
        {"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
        for p in pairs
        for k in ("chosen", "rejected")
    ]
    rng.shuffle(rows)
    return rows


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
    pairs_rng = random.Random(seed + 1)
    (out / "preference").mkdir(exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(out / "preference" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(pair(r, pairs_rng)) + "\n" for r in rows)
    kto_rng = random.Random(seed + 2)
    (out / "kto").mkdir(exist_ok=True)
    for name in ("train", "eval"):
        pairs = [json.loads(line) for line in (out / "preference" / f"{name}.jsonl").read_text().splitlines()]
        with open(out / "kto" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in unpaired(pairs, kto_rng))
    (out / "grpo").mkdir(exist_ok=True)
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(out / "grpo" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"prompt": r["prompt"], "answer": r["completion"]}) + "\n" for r in rows)
    print(
        f"wrote {n_train} train and {n_eval} eval rows to {out} (and beside them: preference pairs, unpaired rows, prompts)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "data" / "order")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=64)
    args = parser.parse_args()
    make(args.out, args.train, args.eval)


if __name__ == "__main__":
    main()
