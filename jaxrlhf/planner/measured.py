"""Measured call times (`python -m jaxrlhf.profile`) and their interpolation; no JAX here.

A profile file is a hardware profile (`jaxrlhf.planner.hardware`) with a
`measured` section: `calls`, a list of tables, `moves`, the parameter and
batch moves the profiler timed (a parameter move it timed prices that move,
`Measured.move`; the formulas price the others), and `runs`, whole calls a training run timed
on its own plan (`Run`, written by the re-planner, `plan.replan_every`).
Each table is one phase of one model on one placement, timed at a small grid
of shapes:

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
these sizes), and never below zero; a call split into micro-batches pays a
whole pass per micro-batch (`Table.split_seconds`), and a pipelined layout is
priced from the tables of one stage's placement (`cost._table_parts`).
Entries are matched on the model's dimensions and dtype, the number of devices
and the layout exactly. Other placements of a timed model are priced by the
formulas of `jaxrlhf.planner.cost` scaled by how far they are off where the
tables reach (`cost.measured_cost`: for a layout mixing axes, data 4 x tensor 2,
the single-axis layouts of the same devices; else every timed placement);
models never timed, by the formulas alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

PHASES = ("prefill", "decode", "inference", "train")
# The phases whose tables price a call of each kind (`cost._table_parts`); the profiler times these.
CALL_PHASES = {"generate": ("prefill", "decode"), "inference": ("inference",), "train": ("train",)}
# What priced a call from the profile alone (`cost.profile_call_cost`): a table of this placement, the
# formulas scaled by how far they are off on the placements the tables cover, or the formulas.
PROFILE_SOURCES = ("measured", "calibrated", "formula")


def model_key(cfg, head: str) -> str:
    """What a measured time depends on about a model: its dimensions, dtypes and head. A head width other
    than hidden / heads (Qwen3, Gemma) is part of the key; the keys of models without one are unchanged."""
    width = "" if cfg.dim_per_head * cfg.num_heads == cfg.hidden_size else f"-d{cfg.dim_per_head}"
    experts = "" if not getattr(cfg, "num_experts", 0) else (
        f"-e{cfg.num_experts}k{cfg.num_experts_per_tok}f{cfg.expert_intermediate_size}"
        f"s{cfg.shared_expert_intermediate_size or 0}"
        + ("g" if getattr(cfg, "moe_dispatch", "dense") == "grouped" else ""))  # a mixture of experts' MLP: its own key
    return (f"{cfg.architecture}-h{cfg.hidden_size}-l{cfg.num_layers}-q{cfg.num_heads}-kv{cfg.num_kv_heads}{width}"
            f"-f{cfg.intermediate_size}{experts}-v{cfg.vocab_size}-{cfg.param_dtype}-{cfg.dtype}-{head}")


def timed_placement(devices: int, layout):
    """(devices, layout) of the tables that price a call placed on `devices` x `layout`: the placement
    itself, or for a pipelined layout (S stages) one stage's, devices / S under the layout without stages
    (`cost._table_parts`). The profiler times exactly these, so what it records is what the lookup reads."""
    if layout.stage == 1:
        return devices, layout
    return devices // layout.stage, type(layout)(layout.data, layout.fsdp, layout.tensor)


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

    def split_seconds(self, rows: float, length: float, parts: int) -> float:
        """Seconds of one call that runs `rows` as `parts` micro-batches of rows / parts: each micro-batch
        costs what a pass of its rows costs. What the line in rows holds at zero rows is mostly per
        pass (kernel launches, FSDP weight gathers, the simulated devices' lockstep), not per call: on
        8 CPU devices an inference in 2 micro-batches took 1.23 s, 2 x its half-batch time (0.62 s);
        charging the zero-rows time once had priced it 0.86 s."""
        if parts <= 1:
            return self.seconds(rows, length)
        return parts * self.seconds(rows / parts, length)

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


@dataclasses.dataclass(frozen=True)
class Run:
    """One call of a training run, timed by the run itself on its plan's placement (the median of its
    `time/<call>_s` over the steps since the last re-plan), beside what the cost model estimated for it
    there without any run's times (`estimate`, priced from `source`: a profile table or the formulas).

    It prices that call on that placement at that shape exactly, and corrects the other placements of
    the call that the same source prices by seconds / estimate (`Measured.correction`): a run on one
    placement says how far the profile or the formulas are off for that call."""

    call: str  # the call's name in the algorithm's graph ("actor.generate")
    model: str  # `model_key` of the call's role
    devices: int
    layout: str
    rows: int  # sequences the call feeds at once (`Workload.call_seqs`)
    length: int  # tokens per sequence
    micro: int  # micro-batches the run split the call into
    source: str  # "measured", "calibrated" or "formula": what priced `estimate` (`CallCost.source`)
    estimate: float
    seconds: float
    knobs: str = ""  # the other knobs the run ran the call with (`planner.knobs.knob_tag`: remat, engine pool)

    def key(self) -> tuple:
        return (self.call, self.model, self.devices, self.layout, self.rows, self.length, self.micro, self.knobs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "Run":
        need = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, Mapping) or not need - {"knobs"} <= set(d) <= need:  # knobs: absent in older files
            raise ValueError(f"{where}: a run entry has keys {sorted(need)}, got {sorted(d) if isinstance(d, Mapping) else d}")
        try:
            run = cls(str(d["call"]), str(d["model"]), int(d["devices"]), str(d["layout"]), int(d["rows"]),
                      int(d["length"]), int(d["micro"]), str(d["source"]), float(d["estimate"]), float(d["seconds"]),
                      str(d.get("knobs", "")))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: devices, rows, length, micro must be integers, estimate and seconds numbers") from None
        if run.source not in PROFILE_SOURCES or not (run.estimate > 0 and run.seconds > 0):
            raise ValueError(f"{where}: source must be one of {PROFILE_SOURCES}, estimate and seconds > 0")
        return run


class Measured:
    """The measured tables of a profile, looked up by (model, phase, devices, layout), its moves, and the
    calls runs timed on their plans (`Run`)."""

    def __init__(self, tables: Iterable[Table] = (), moves: Sequence[Mapping[str, Any]] = (),
                 runs: Iterable[Run] = ()):
        self.tables = {(t.model, t.phase, t.devices, t.layout): t for t in tables}
        self.moves = [dict(m) for m in moves]
        self.runs = {r.key(): r for r in runs}  # a later run of the same call and placement replaces an earlier

    def __bool__(self) -> bool:
        return bool(self.tables or self.moves or self.runs)

    def find(self, model: str, phase: str, devices: int, layout: str) -> Table | None:
        return self.tables.get((model, phase, devices, layout))

    def move(self, model: str, what: str, src: str, dst: str) -> float | None:
        """Seconds the profiler measured for moving `model`'s parameters (`what="params"`) or a batch
        (`"batch"`) from placement `src` to `dst` (each "start+size:layout", e.g. "0+4:d4f1t1"), if it
        timed that move."""
        for m in self.moves:
            if (m["model"], m["what"], m["src"], m["dst"]) == (model, what, src, dst):
                return float(m["seconds"])
        return None

    def run(self, call: str, model: str, devices: int, layout: str, rows: int, length: int, micro: int,
            knobs: str = "") -> Run | None:
        """The run's own time of exactly this call, placement, shape and knobs, if a run timed it."""
        return self.runs.get((call, model, devices, layout, rows, length, micro, knobs))

    def correction(self, call: str, model: str, source: str) -> float | None:
        """How far `source`'s estimates of `call` were off in runs: the geometric mean of seconds /
        estimate over the runs of that call priced by that source (None when no run was)."""
        ratios = [r.seconds / r.estimate for r in self.runs.values()
                  if (r.call, r.model, r.source) == (call, model, source)]
        return float(np.exp(np.mean(np.log(ratios)))) if ratios else None

    def with_runs(self, runs: Iterable[Run]) -> "Measured":
        """These tables and moves, with `runs` added (replacing earlier runs of the same key)."""
        return Measured(self.tables.values(), self.moves, [*self.runs.values(), *runs])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"calls": [t.to_dict() for t in self.tables.values()], "moves": self.moves}
        if self.runs:
            out["runs"] = [r.to_dict() for r in self.runs.values()]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str = "profile") -> "Measured":
        if d is None:
            return cls()
        if not isinstance(d, Mapping) or set(d) - {"calls", "moves", "runs"}:
            raise ValueError(f"{where}.measured must be a mapping with 'calls', 'moves' and 'runs' lists")
        calls, moves, runs = d.get("calls") or [], d.get("moves") or [], d.get("runs") or []
        if not isinstance(calls, list) or not isinstance(moves, list) or not isinstance(runs, list):
            raise ValueError(f"{where}.measured.calls, .moves and .runs must be lists")
        for i, m in enumerate(moves):
            if not isinstance(m, Mapping) or set(m) != MOVE_KEYS:
                raise ValueError(f"{where}.measured.moves[{i}] needs exactly the keys {sorted(MOVE_KEYS)}")
        return cls((Table.from_dict(e, f"{where}.measured.calls[{i}]") for i, e in enumerate(calls)), moves,
                   [Run.from_dict(e, f"{where}.measured.runs[{i}]") for i, e in enumerate(runs)])
