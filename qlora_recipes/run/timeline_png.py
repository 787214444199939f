"""memory.png, drawn with Pillow: the measured series per step from 0, the planned peak as a dashed line.

It is drawn at the end of train(), so its cost counts in every run's training time: importing matplotlib
and laying a figure out took ~0.7 s of CPU, more than the first steps of a small model; Pillow draws the
same chart in a few hundredths. Drawn at twice the size and scaled down, so lines and text are smooth."""

from __future__ import annotations

import math
from pathlib import Path

SIZE, SCALE = (700, 350), 2  # pixels (7 x 3.5 in at 100 dpi), drawn at SCALE times and scaled down
MARGIN = {"left": 64, "right": 16, "top": 30, "bottom": 42}
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
GRID, TEXT = "#e6e6e6", "#000000"
TITLE = "memory over the run: measured vs planned"


def nice_ticks(top: float, count: int = 6) -> list[float]:
    """Ticks from 0 to at least `top`, at a step of 1, 2, 2.5 or 5 times a power of ten."""
    raw = max(top, 1e-9) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    return [round(i * step, 10) for i in range(int(math.ceil(top / step - 1e-9)) + 1)]


def draw(series: dict[str, list[tuple[float, float]]], planned: tuple[float, str] | None, png: Path) -> None:
    """`series`: name -> (step, GiB) points; `planned`: (GiB, the quantity it predicts) or None."""
    from PIL import Image, ImageDraw, ImageFont

    s = SCALE
    image = Image.new("RGB", (SIZE[0] * s, SIZE[1] * s), "white")
    pen = ImageDraw.Draw(image)
    font, small = ImageFont.load_default(size=11 * s), ImageFont.load_default(size=10 * s)
    values = [v for points in series.values() for _, v in points if v is not None]
    top = max(values + [planned[0] if planned else 0.0] + [0.0])
    yticks = nice_ticks(1.15 * top or 1.0)
    last = max([x for points in series.values() for x, _ in points] + [1])
    xticks = [int(t) for t in nice_ticks(last, 8) if t == int(t)] or [0, last]
    box = (MARGIN["left"] * s, MARGIN["top"] * s, (SIZE[0] - MARGIN["right"]) * s, (SIZE[1] - MARGIN["bottom"]) * s)

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            box[0] + (box[2] - box[0]) * x / max(xticks[-1], last),
            box[3] - (box[3] - box[1]) * y / yticks[-1],
        )

    for y in yticks:
        _, py = at(0, y)
        pen.line([(box[0], py), (box[2], py)], fill=GRID, width=s)
        pen.text((box[0] - 6 * s, py), f"{y:g}", font=font, fill=TEXT, anchor="rm")
    for x in xticks:
        px, _ = at(x, 0)
        pen.line([(px, box[1]), (px, box[3])], fill=GRID, width=s)
        pen.text((px, box[3] + 6 * s), str(x), font=font, fill=TEXT, anchor="mt")
    legend = []
    for i, (name, points) in enumerate(sorted(series.items())):
        color = COLORS[i % len(COLORS)]
        xy = [at(x, v) for x, v in points if v is not None]
        if len(xy) > 1:
            pen.line(xy, fill=color, width=2 * s, joint="curve")
        for px, py in xy:
            pen.ellipse([(px - 2.5 * s, py - 2.5 * s), (px + 2.5 * s, py + 2.5 * s)], fill=color)
        legend.append((name, color, "solid"))
    if planned:
        _, py = at(0, planned[0])
        _dashed(pen, box[0], box[2], py, s)
        legend.append((f"planned peak ({planned[1]}): {planned[0]:.3g} GiB", TEXT, "dashed"))
    pen.rectangle(box, outline=TEXT, width=s)
    pen.text(((box[0] + box[2]) / 2, box[1] - 8 * s), TITLE, font=font, fill=TEXT, anchor="md")
    pen.text(((box[0] + box[2]) / 2, SIZE[1] * s - 6 * s), "step", font=font, fill=TEXT, anchor="md")
    _y_label(image, "GiB", font, (14 * s, (box[1] + box[3]) / 2))
    _legend(pen, legend, small, (box[0] + 10 * s, box[3] - 10 * s), s)
    image.resize(SIZE, Image.Resampling.LANCZOS).save(png)


def _dashed(pen, x0: float, x1: float, y: float, s: int) -> None:
    x = x0
    while x < x1:
        pen.line([(x, y), (min(x + 7 * s, x1), y)], fill=TEXT, width=2 * s)
        x += 11 * s


def _y_label(image, text: str, font, centre: tuple[float, float]) -> None:
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(text)
    label = Image.new("RGB", (right - left + 4, bottom - top + 4), "white")
    ImageDraw.Draw(label).text((2 - left, 2 - top), text, font=font, fill=TEXT)
    label = label.rotate(90, expand=True)
    image.paste(label, (int(centre[0] - label.width / 2), int(centre[1] - label.height / 2)))


def _legend(pen, rows: list[tuple[str, str, str]], font, corner: tuple[float, float], s: int) -> None:
    """A boxed legend whose lower-left corner is `corner` (inside the axes, above the x axis)."""
    if not rows:
        return
    line_h, swatch = 16 * s, 24 * s
    width = swatch + 8 * s + max(font.getlength(name) for name, _, _ in rows) + 10 * s
    x0, y1 = corner
    y0 = y1 - line_h * len(rows) - 8 * s
    pen.rectangle([(x0, y0), (x0 + width, y1)], fill="white", outline="#cccccc", width=s)
    for i, (name, color, style) in enumerate(rows):
        y = y0 + 4 * s + line_h * i + line_h / 2
        if style == "dashed":
            _dashed(pen, x0 + 5 * s, x0 + 5 * s + swatch, y, s)
        else:
            pen.line([(x0 + 5 * s, y), (x0 + 5 * s + swatch, y)], fill=color, width=2 * s)
            pen.ellipse(
                [(x0 + 5 * s + swatch / 2 - 2.5 * s, y - 2.5 * s), (x0 + 5 * s + swatch / 2 + 2.5 * s, y + 2.5 * s)],
                fill=color,
            )
        pen.text((x0 + 13 * s + swatch, y), name, font=font, fill=TEXT, anchor="lm")
