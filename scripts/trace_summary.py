"""Device op time of a profiled step, by kind of op: what the compiled calls spend their time on.

    python scripts/trace_summary.py RUN/profile/step_N [--top 25] [--call actor.train] [--out ops.json]

Reads the Perfetto trace that `run.profile_steps` writes (`perfetto_trace.json.gz`) and sums the
duration of every XLA op executed on the device threads, grouped by op name without its numeric
suffix (`ynn_fusion.27` -> `ynn_fusion`, `loop_add_fusion_3` -> `loop_add_fusion`). Device threads
are XLA:CPU's compute threads, or on a GPU the kernel streams of its `/device:GPU:N` process. Runtime
wrappers (thunk executors, thread-pool waits, loop bodies) are left out so that the ops add up once.
On XLA:CPU, `ynn_fusion`/`dot` are matmuls (with fused elementwise work), `all-reduce`/`all-gather`/
`Rendezvous`/`Wait: ...` are collectives between simulated devices and the time their threads wait for
each other, `dynamic-slice`/`dynamic-update-slice` fusions are the scanned decoder layers reading and
writing their stacked weights and residuals, and `copy`/`transpose` fusions are layout changes.
Durations are wall time on each thread: on a loaded machine they include time the thread was
descheduled, so compare shares, not seconds.

`--call NAME` keeps the ops of one model call: those that start between the call's launch (the
executor's `NAME` trace annotation) and the next call's launch. Exact where calls run one after the
other (one device group; on a GPU a launch returns when its call has nearly run); approximate where
calls on disjoint device groups overlap.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool", "while")
DEVICE_THREADS = ("tf_XLA",)  # XLA's device and intra-op threads (python threads hold host work)
GPU_STREAMS = "Stream"  # a GPU's kernels, one thread per CUDA stream, in the `/device:GPU:N` process


def find_trace(folder: str) -> str:
    hits = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))
    if not hits:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {folder} (was it written with run.profile_steps?)")
    return hits[-1]


CALL = re.compile(r"^\w+\.(generate|inference|train)$")  # the executor's annotation of a model call


def call_windows(events: list[dict], call: str) -> list[tuple[float, float]]:
    """[launch, next call's launch) of every launch of `call`, in trace microseconds."""
    spans = [e for e in events if e.get("ph") == "X"]
    launches = sorted((e["ts"], e["name"]) for e in spans if CALL.match(e["name"]))
    end = max((e["ts"] + e["dur"] for e in spans), default=0.0)
    windows = [(t, launches[i + 1][0] if i + 1 < len(launches) else end)
               for i, (t, name) in enumerate(launches) if name == call]
    if not windows:
        raise ValueError(f"no launch of {call!r} in the trace; its calls: {sorted({n for _, n in launches})}")
    return windows


def op_times(trace_path: str, call: str | None = None) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and counts per op kind on the device threads (of `call`'s launches only, when given)."""
    with gzip.open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    windows = call_windows(events, call) if call else [(float("-inf"), float("inf"))]
    names = {(e["pid"], e.get("tid") if e.get("name") == "thread_name" else None): e["args"]["name"]
             for e in events if e.get("ph") == "M" and e.get("name") in ("thread_name", "process_name")}
    device = {key for key, name in names.items() if key[1] is not None and (
        name.startswith(DEVICE_THREADS)
        or (names.get((key[0], None), "").startswith("/device:") and name.startswith(GPU_STREAMS)))}
    seconds: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or (e["pid"], e["tid"]) not in device or e["name"].startswith(WRAPPERS):
            continue
        if not any(a <= e["ts"] < b for a, b in windows):
            continue
        kind = re.sub(r"[._]\d+$", "", e["name"])
        seconds[kind] += e["dur"] / 1e6
        counts[kind] += 1
    return dict(seconds), dict(counts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="a profiled step's folder: RUN/profile/step_N")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--call", help="only this model call's ops (e.g. actor.train)")
    p.add_argument("--out", help="write {kind: {seconds, count, share}} as JSON here")
    args = p.parse_args(argv)
    try:
        seconds, counts = op_times(find_trace(args.folder), args.call)
    except (OSError, ValueError, KeyError) as e:
        print(f"trace_summary: {e}", file=sys.stderr)
        return 2
    total = sum(seconds.values()) or float("nan")
    rows = sorted(seconds.items(), key=lambda kv: -kv[1])
    print(f"device op time {total:.3f} s (summed over device threads{', ' + args.call if args.call else ''})")
    print(f"{'seconds':>9} {'share':>6} {'count':>7}  op")
    for kind, s in rows[:args.top]:
        print(f"{s:9.3f} {100 * s / total:5.1f}% {counts[kind]:7d}  {kind}")
    out = {k: {"seconds": s, "count": counts[k], "share": s / total} for k, s in rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
