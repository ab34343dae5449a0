"""A loss-curve PNG with no plotting library: a raster drawn by hand, encoded with zlib.

Training loss is drawn in blue, evaluation loss as red squares, on axes scaled to the data (x: step,
y: loss from the minimum to the maximum seen). There is no text in the image; the numbers are in
`metrics.jsonl` and `trainer_state.json`.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (220, 220, 220)
BLUE, RED = (31, 119, 180), (214, 39, 40)


def encode_png(width: int, height: int, rgb: bytearray) -> bytes:
    """An 8-bit RGB PNG of `rgb` (row-major, 3 bytes per pixel)."""
    raw = b"".join(b"\x00" + bytes(rgb[y * width * 3:(y + 1) * width * 3]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.rgb = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.rgb[i:i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color, thick: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                self.dot(x0, y0 + t, color)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def square(self, x: int, y: int, r: int, color) -> None:
        for yy in range(y - r, y + r + 1):
            for xx in range(x - r, x + r + 1):
                self.dot(xx, yy, color)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.rgb)


def loss_curve_png(train: Sequence[tuple[float, float]], evals: Sequence[tuple[float, float]] = (),
                   width: int = 640, height: int = 400) -> bytes:
    """PNG bytes of (step, loss) points: train as a line, eval as squares."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 40, width - 20, 20, height - 30
    points = [(s, v) for s, v in list(train) + list(evals) if math.isfinite(v)]
    for i in range(5):  # grid
        y = top + (bottom - top) * i // 4
        canvas.line(left, y, right, y, GREY)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)
    if points:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x_lo, x_hi = min(xs), max(xs)
        y_lo, y_hi = min(ys), max(ys)
        x_hi = x_hi if x_hi > x_lo else x_lo + 1
        y_hi = y_hi if y_hi > y_lo else y_lo + 1

        def px(s: float, v: float) -> tuple[int, int]:
            return (round(left + (s - x_lo) / (x_hi - x_lo) * (right - left)),
                    round(bottom - (v - y_lo) / (y_hi - y_lo) * (bottom - top)))

        prev = None
        for s, v in train:
            if not math.isfinite(v):
                continue
            cur = px(s, v)
            if prev is not None:
                canvas.line(*prev, *cur, BLUE, thick=2)
            else:
                canvas.square(*cur, 1, BLUE)
            prev = cur
        for s, v in evals:
            if math.isfinite(v):
                canvas.square(*px(s, v), 3, RED)
    return canvas.png()


def write_loss_curve(path: str, log_history: Sequence[dict]) -> str:
    """Draw `loss` and `eval_loss` from a log history into `path`; returns the path."""
    train = [(e["step"], float(e["loss"])) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], float(e["eval_loss"])) for e in log_history if "eval_loss" in e and "step" in e]
    with open(path, "wb") as f:
        f.write(loss_curve_png(train, evals))
    return path


__all__ = ["encode_png", "loss_curve_png", "write_loss_curve"]
