"""Text charts drawn with block characters: pure functions from numbers to Rich lines.

Bars always start at zero (a sparkline that starts at the minimum makes a
2 % wobble look like a cliff), one column per token, the newest at the right.
"""

from __future__ import annotations

from typing import Sequence

from rich.style import Style
from rich.text import Text

BLOCKS = " ▁▂▃▄▅▆▇█"  # 0..8 eighths of a cell, filled from the bottom


def columns(series: Sequence[Sequence[float]], styles: Sequence[Style], width: int, height: int,
            top: float) -> list[Text]:
    """`height` lines of `width` cells: the series stacked bottom-up, one column per sample.

    Samples are aligned at the right (the newest last); only the last `width` are drawn.
    A cell split between two series uses the lower one's colour as foreground and the
    upper one's as background.
    """
    width, height = max(width, 0), max(height, 0)
    count = min((len(s) for s in series), default=0)
    start = max(count - width, 0)
    cols = [_eighths([s[i] for s in series], height, top) for i in range(start, count)]
    cols = [[] for _ in range(width - len(cols))] + cols
    lines = []
    for row in reversed(range(height)):
        line = Text()
        for col in cols:
            char, style = _cell(col, styles, row)
            line.append(char, style)
        lines.append(line)
    return lines


def sparkline(values: Sequence[float], width: int, top: float, style: Style) -> Text:
    """One line of bars from zero to `top`, right-aligned, the last `width` values."""
    return columns([values], [style], width, 1, top)[0] if width > 0 else Text()


def with_axis(lines: list[Text], top_label: str, unit_label: str = "", label_width: int = 7) -> list[Text]:
    """Prefix chart lines with a y axis: the top value on the first line, 0 on the last."""
    out = []
    for i, line in enumerate(lines):
        if i == 0:
            label = top_label
        elif i == len(lines) - 1:
            label = "0"
        elif i == 1:
            label = unit_label
        else:
            label = ""
        tick = "┤" if i in (0, len(lines) - 1) else "│"
        out.append(Text(label.rjust(label_width - 1)[: label_width - 1] + tick, style="dim") + line)
    return out


def nice_top(value: float) -> float:
    """The smallest of 1, 2, 3, 4, 5, 6, 8 times a power of ten at or above `value` (an axis maximum)."""
    if value <= 0:
        return 1.0
    step = 10 ** _floor_log10(value)
    for m in (1, 2, 3, 4, 5, 6, 8, 10):
        if m * step >= value:
            return m * step
    return 10 * step


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop always returns


def fmt_ms(ms: float) -> str:
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"


def _floor_log10(value: float) -> int:
    exp = 0
    while value >= 10:
        value /= 10
        exp += 1
    while value < 1:
        value *= 10
        exp -= 1
    return exp


def _eighths(values: Sequence[float], height: int, top: float) -> list[int]:
    """Cumulative tops of the stacked values, in eighths of a cell; a positive total shows at least 1."""
    scale = 8 * height / top if top > 0 else 0.0
    tops, acc = [], 0.0
    for v in values:
        acc += max(v, 0.0)
        tops.append(min(round(acc * scale), 8 * height))
    if tops and acc > 0 and tops[-1] == 0:
        tops[-1] = 1
    return tops


def _cell(tops: list[int], styles: Sequence[Style], row: int) -> tuple[str, Style | None]:
    low, high = 8 * row, 8 * row + 8
    lower = next((i for i, t in enumerate(tops) if t > low), None)
    if lower is None:
        return " ", None
    if tops[lower] >= high:  # a full cell is a background: no glyph seams between rows
        return " ", Style(bgcolor=styles[lower].color)
    upper = next((j for j in range(lower + 1, len(tops)) if tops[j] > tops[lower]), None)
    style = styles[lower]
    if upper is not None and 2 * (min(tops[upper], high) - tops[lower]) >= high - tops[lower]:
        style = style + Style(bgcolor=styles[upper].color)
    return BLOCKS[tops[lower] - low], style
