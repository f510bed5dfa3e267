"""Measured call times (`python -m jaxrlhf.profile`) and their interpolation; no JAX here.

A profile file is a hardware profile (`jaxrlhf.planner.hardware`) with a
`measured` section: `calls`, a list of tables, and `moves`, the parameter and
batch moves the profiler timed (recorded for reading; the cost model still
prices moves with its formulas). Each table is one phase of one model on one
placement, timed at a small grid of shapes:

    {model: <model_key>, phase: prefill | decode | inference | train,
     devices: 8, layout: d1f1t8, points: [[rows, length, seconds], ...]}

- prefill: a forward over `rows` prompts of `length` tokens into a KV cache;
- decode: seconds per generated token with `rows` sequences and a cache of
  `length` slots (attention reads every slot, masked, so the step time
  depends on the cache size, not on the position);
- inference: a forward over `rows` sequences of `length` tokens;
- train: one optimizer step (gradient + AdamW) over `rows` sequences of
  `length` tokens (one minibatch).

Rows count sequences of the whole call (all devices together). Estimates are
bilinear in rows and length over the measured grid, extended linearly past
its edges (time grows linearly in rows, and close to linearly in length at
these sizes), and never below zero. Entries are matched on the model's
dimensions and dtype, the number of devices and the layout exactly; anything
else is left to the formulas of `jaxrlhf.planner.cost`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

PHASES = ("prefill", "decode", "inference", "train")


def model_key(cfg, head: str) -> str:
    """What a measured time depends on about a model: its dimensions, dtypes and head."""
    return (f"{cfg.architecture}-h{cfg.hidden_size}-l{cfg.num_layers}-q{cfg.num_heads}-kv{cfg.num_kv_heads}"
            f"-f{cfg.intermediate_size}-v{cfg.vocab_size}-{cfg.param_dtype}-{cfg.dtype}-{head}")


def _line(x: Sequence[float], y: Sequence[float], at: float) -> float:
    """Piecewise-linear through (x, y), extended with the end segments' slopes (constant for one point)."""
    if len(x) == 1:
        return float(y[0])
    i = int(np.clip(np.searchsorted(x, at) - 1, 0, len(x) - 2))
    return float(y[i] + (y[i + 1] - y[i]) * (at - x[i]) / (x[i + 1] - x[i]))


@dataclasses.dataclass(frozen=True)
class Table:
    """One phase of one model on one placement: seconds at a grid of (rows, length)."""

    model: str
    phase: str
    devices: int
    layout: str
    points: tuple[tuple[float, float, float], ...]

    def seconds(self, rows: float, length: float) -> float:
        """Bilinear in rows and length over the grid; at each measured length a line in rows first."""
        lengths = sorted({p[1] for p in self.points})
        at_length = []
        for n in lengths:
            pts = sorted((p[0], p[2]) for p in self.points if p[1] == n)
            xs = [r for r, _ in pts]
            ys = [s for _, s in pts]
            at_length.append(_line(xs, ys, rows))
        return max(_line(lengths, at_length, length), 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "phase": self.phase, "devices": self.devices, "layout": self.layout,
                "points": [list(p) for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "Table":
        need = {"model", "phase", "devices", "layout", "points"}
        if not isinstance(d, Mapping) or set(d) != need:
            raise ValueError(f"{where}: a measured entry has keys {sorted(need)}, got {sorted(d)}")
        if d["phase"] not in PHASES:
            raise ValueError(f"{where}: phase {d['phase']!r} is not one of {PHASES}")
        try:
            points = tuple((float(r), float(n), float(s)) for r, n, s in d["points"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: points must be [rows, length, seconds] triples") from None
        if not points or any(r <= 0 or n <= 0 or s < 0 for r, n, s in points):
            raise ValueError(f"{where}: points need rows > 0, length > 0 and seconds >= 0")
        rows = {(r, n) for r, n, _ in points}
        if len(rows) != len(points):
            raise ValueError(f"{where}: two points share the same (rows, length)")
        return cls(str(d["model"]), str(d["phase"]), int(d["devices"]), str(d["layout"]), points)


MOVE_KEYS = {"model", "what", "src", "dst", "bytes", "seconds"}


class Measured:
    """The measured tables of a profile, looked up by (model, phase, devices, layout), and its moves."""

    def __init__(self, tables: Iterable[Table] = (), moves: Sequence[Mapping[str, Any]] = ()):
        self.tables = {(t.model, t.phase, t.devices, t.layout): t for t in tables}
        self.moves = [dict(m) for m in moves]

    def __bool__(self) -> bool:
        return bool(self.tables or self.moves)

    def find(self, model: str, phase: str, devices: int, layout: str) -> Table | None:
        return self.tables.get((model, phase, devices, layout))

    def to_dict(self) -> dict[str, Any]:
        return {"calls": [t.to_dict() for t in self.tables.values()], "moves": self.moves}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str = "profile") -> "Measured":
        if d is None:
            return cls()
        if not isinstance(d, Mapping) or set(d) - {"calls", "moves"}:
            raise ValueError(f"{where}.measured must be a mapping with 'calls' and 'moves' lists")
        calls, moves = d.get("calls") or [], d.get("moves") or []
        if not isinstance(calls, list) or not isinstance(moves, list):
            raise ValueError(f"{where}.measured.calls and .moves must be lists")
        for i, m in enumerate(moves):
            if not isinstance(m, Mapping) or set(m) != MOVE_KEYS:
                raise ValueError(f"{where}.measured.moves[{i}] needs exactly the keys {sorted(MOVE_KEYS)}")
        return cls((Table.from_dict(e, f"{where}.measured.calls[{i}]") for i, e in enumerate(calls)), moves)
