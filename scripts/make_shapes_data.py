"""Write the shipped image sample: small PNGs of one coloured shape each, asked about in chat rows.

Each image is a filled circle, square or triangle in red, green, blue or yellow, at a seeded size and
position on black. Each image gets two rows: `What shape is this?` -> `circle` and `What colour is
this?` -> `red`, as a vision-language model trains on them (data/images.py: `messages` with an image
part, `images` naming the file relative to the data file). The held-out images are distinct from the
train ones (no two images share shape, colour, size and position), while every shape and colour occurs
in both. Seeded, so the files are reproducible byte for byte.

    python scripts/make_shapes_data.py [--out assets/data/shapes] [--train 192] [--eval 32]
"""

import argparse
import json
import random
from pathlib import Path

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (40, 60, 230), "yellow": (230, 220, 30)}
SIDE = 32  # pixels a side: small enough to ship, large enough for a tiny CLIP's 14-px patches
HALF_SIZES = (5, 7, 9)  # the shape's half extent in pixels
MARGIN = 2  # pixels kept clear at each edge (a processor's centre crop then keeps the whole shape)
QUESTIONS = {"shape": "What shape is this?", "colour": "What colour is this?"}


def draw(shape: str, colour: str, half: int, cx: int, cy: int):
    """One PIL image: the shape centred at (cx, cy), `half` pixels to each side."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), (0, 0, 0))
    pen = ImageDraw.Draw(image)
    box = (cx - half, cy - half, cx + half, cy + half)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    return image


def rows_of(shape: str, colour: str, image: str) -> list[dict]:
    """The image's two rows: its shape and its colour, each a one-word answer."""
    answers = {"shape": shape, "colour": colour}
    return [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[q]}]},
                {"role": "assistant", "content": [{"type": "text", "text": answers[q]}]},
            ],
            "images": [image],
        }
        for q in ("shape", "colour")
    ]


def specs(n: int, rng: random.Random, seen: set) -> list[tuple]:
    """n distinct (shape, colour, half, cx, cy), cycling through every shape and colour."""
    out = []
    while len(out) < n:
        shape, colour = SHAPES[len(out) % 3], list(COLOURS)[(len(out) // 3) % 4]
        half = rng.choice(HALF_SIZES)
        cx, cy = (rng.randint(MARGIN + half, SIDE - 1 - MARGIN - half) for _ in range(2))
        key = (shape, colour, half, cx, cy)
        if key not in seen:
            seen.add(key)
            out.append(key)
    return out


def make(out: Path, n_train: int, n_eval: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    seen: set = set()
    splits = {"eval": specs(n_eval, rng, seen), "train": specs(n_train, rng, seen)}
    (out / "images").mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        order = splits[split]
        random.Random(seed + 1).shuffle(order)  # rows not grouped by shape or colour
        rows = []
        for i, (shape, colour, half, cx, cy) in enumerate(order):
            name = f"images/{split}-{i:03d}.png"
            draw(shape, colour, half, cx, cy).save(out / name)
            rows += rows_of(shape, colour, name)
        with open(out / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {2 * n_train} train and {2 * n_eval} eval rows ({n_train} + {n_eval} images) to {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "data" / "shapes")
    parser.add_argument("--train", type=int, default=192, help="train images (two rows each)")
    parser.add_argument("--eval", type=int, default=32, help="held-out images (two rows each)")
    args = parser.parse_args()
    make(args.out, args.train, args.eval)


if __name__ == "__main__":
    main()
