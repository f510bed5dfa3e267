"""`scripts/bench_async.py --repredict`: a pick of a search run again is matched to the bench row that ran
its placement (what `pick_vs_best` reports), by hand on the committed result."""

import dataclasses
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_async", os.path.join(ROOT, "scripts", "bench_async.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_async"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_pick_is_matched_to_the_row_that_ran_its_placement():
    from jaxrlhf.planner.plan import ExecutionPlan, Layout

    bench = _bench()
    with open(os.path.join(ROOT, "docs", "results", "bench_async.json")) as f:
        rows = json.load(f)["rows"]
    plan_of = {r["name"]: ExecutionPlan.from_dict(r["plan"]) for r in rows}
    colocated = plan_of["sync colocated"]
    # synchronous: only eta 0 rows; the colocated placement ran as "sync colocated"
    assert bench.measured_match(bench.Candidate("pick", colocated, bench.SYNC, 0), rows)["name"] == "sync colocated"
    # a stream at eta 2 on the colocated placement: the eta 2 row, not eta 1's
    streamed = bench.Candidate("pick", colocated, bench.streamed(2), 2)
    assert bench.measured_match(streamed, rows)["name"] == "async colocated eta=2"
    # a placement the bench never ran (the generate call on data 8): no match, nothing invented
    calls = dict(colocated.calls)
    calls["actor.generate"] = dataclasses.replace(calls["actor.generate"], layout=Layout(data=8))
    other = dataclasses.replace(colocated, calls=calls)
    assert bench.measured_match(bench.Candidate("pick", other, bench.SYNC, 0), rows) is None
