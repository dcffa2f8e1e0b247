"""The loss-curve PNG: drawn with matplotlib when it is installed, else by a tiny built-in
renderer (curves and grid, no text) so that a run always leaves a picture behind."""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["write_loss_plot"]

Series = Sequence[tuple[int, float]]
_W, _H, _MARGIN = 640, 400, 40
_BLUE, _ORANGE, _GREY, _BLACK = (31, 119, 180), (255, 127, 14), (225, 225, 225), (40, 40, 40)


def write_loss_plot(train: Series, val: Series, path: Path, title: str = "") -> str:
    """Draw training and validation loss against the step into ``path``.

    Returns:
        ``"matplotlib"`` or ``"basic"`` (the built-in renderer: blue = train, orange = val).
    """
    try:
        import matplotlib
    except ImportError:
        _basic_png(train, val, path)
        return "basic"
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", color="#1f77b4", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", color="#ff7f0e")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "kolossos train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
    return "matplotlib"


def _png_bytes(pixels: bytearray, width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    stride = width * 3
    raw = b"".join(b"\x00" + bytes(pixels[y * stride : (y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, color: tuple[int, int, int], size: int = 1) -> None:
        for dx in range(-(size // 2), size - size // 2):
            for dy in range(-(size // 2), size - size // 2):
                px, py = x + dx, y + dy
                if 0 <= px < self.width and 0 <= py < self.height:
                    i = (py * self.width + px) * 3
                    self.pixels[i : i + 3] = bytes(color)

    def line(
        self, a: tuple[int, int], b: tuple[int, int], color: tuple[int, int, int], size: int = 1
    ) -> None:
        steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(steps + 1):
            t = i / steps
            self.dot(round(a[0] + (b[0] - a[0]) * t), round(a[1] + (b[1] - a[1]) * t), color, size)


def _basic_png(train: Series, val: Series, path: Path) -> None:
    canvas = _Canvas(_W, _H)
    points = [*train, *val]
    x0, x1 = (min(p[0] for p in points), max(p[0] for p in points)) if points else (0, 1)
    y0, y1 = (min(p[1] for p in points), max(p[1] for p in points)) if points else (0.0, 1.0)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1e-6)

    def place(step: int, loss: float) -> tuple[int, int]:
        px = _MARGIN + (step - x0) / (x1 - x0) * (_W - 2 * _MARGIN)
        py = _H - _MARGIN - (loss - y0) / (y1 - y0) * (_H - 2 * _MARGIN)
        return round(px), round(py)

    for k in range(5):  # grid
        gx = _MARGIN + k * (_W - 2 * _MARGIN) // 4
        gy = _MARGIN + k * (_H - 2 * _MARGIN) // 4
        canvas.line((gx, _MARGIN), (gx, _H - _MARGIN), _GREY)
        canvas.line((_MARGIN, gy), (_W - _MARGIN, gy), _GREY)
    canvas.line((_MARGIN, _H - _MARGIN), (_W - _MARGIN, _H - _MARGIN), _BLACK, 2)
    canvas.line((_MARGIN, _MARGIN), (_MARGIN, _H - _MARGIN), _BLACK, 2)
    for series, color in ((train, _BLUE), (val, _ORANGE)):
        placed = [place(s, v) for s, v in series]
        for a, b in itertools.pairwise(placed):
            canvas.line(a, b, color, 2)
        if color == _ORANGE:
            for p in placed:
                canvas.dot(*p, color, 6)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(_png_bytes(canvas.pixels, _W, _H))
    tmp.replace(path)
