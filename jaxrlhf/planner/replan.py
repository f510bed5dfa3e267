"""Re-planning while a run goes: the run's own call times fed back into the cost model, and whether
another plan is then worth switching to. No JAX here (the switch itself is the executor's,
`jaxrlhf.placement.executor.Executor.moved_to`; the loop is `jaxrlhf.run.stages.Replanner`).

The runtime times every call of every step on its plan (`time/<call>_s`). Each timed call becomes
a `measured.Run` in the hardware profile: it prices exactly that call on that placement from then
on, and corrects the other placements of the call by how far the profile's estimate (its tables or
its formulas) was off there. The search then runs again on the corrected profile, through the same
path as at the start (`jaxrlhf.run.planning.search_plan`), and `decide` compares its best plan with the
running one, both estimated on the corrected profile.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxrlhf.graph import CallGraph
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.planner import knobs
from jaxrlhf.planner.cost import profile_call_cost
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.measured import Measured, Run, model_key
from jaxrlhf.planner.plan import ExecutionPlan
from jaxrlhf.planner.simulator import PlanEstimate, estimate_plan, generate_seconds
from jaxrlhf.planner.workload import Workload

DEFAULT_THRESHOLD = 0.1  # plan.replan_threshold's default: switch for a predicted gain over 10 %


def timed_runs(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload,
               hw: HardwareProfile, call_seconds: Mapping[str, float]) -> list[Run]:
    """The calls a run timed on `plan` (`call_seconds`: call -> seconds per step) as `Run`s, each beside
    the profile's own estimate of it (tables or formulas, never earlier runs: the correction a run
    gives is against the profile, not against a corrected estimate). A generate call of drawn
    response lengths is priced as if every response ran to the cap, and each step's batch then by its
    lengths (`simulator.generate_seconds`): its timed mean is put on the cap's scale (times the
    estimate over its mean per-batch estimate), so the lengths are not counted twice. The calls ran under the
    plan's memory knobs (`knobs.fixed_by`), and each run says which (`Run.knobs`)."""
    wl = knobs.fixed_by(plan, wl)
    out = []
    for call in graph.calls:
        seconds = call_seconds.get(call.name)
        if not seconds or seconds <= 0:
            continue
        group, layout = plan.group_of(call.name), plan.calls[call.name].layout
        base = profile_call_cost(call, models[call.role], group, layout, wl, hw)
        if call.kind == "generate" and wl.priced_per_batch(call, layout.batch_ways):
            per_batch = generate_seconds(base, plan, wl, call)
            seconds = seconds * base.seconds / max(sum(per_batch) / len(per_batch), 1e-12)
        out.append(Run(call.name, model_key(models[call.role], call.head), group.size, str(layout),
                       wl.call_seqs(call), wl.seq_len, wl.micro_batches(call), base.source,
                       max(base.seconds, 1e-12), float(seconds), knobs.knob_tag(call, wl)))
    return out


def with_runs(hw: HardwareProfile, runs: list[Run]) -> HardwareProfile:
    """`hw` with `runs` added to its measured section (a run of the same call and placement replaces
    an earlier one: the latest times count)."""
    return dataclasses.replace(hw, measured=(hw.measured or Measured()).with_runs(runs))


def placements(plan: ExecutionPlan) -> tuple:
    """What a plan decides, without names: where each call runs, shadows, off-policy, offloads."""
    calls = tuple(sorted((c, plan.group_of(c).start, plan.group_of(c).size, p.layout) for c, p in plan.calls.items()))
    return (calls, tuple(sorted(plan.shadow_roles)), plan.offpolicy, tuple(sorted(plan.offload_roles)),
            tuple(sorted(plan.offload_optimizer)))


@dataclasses.dataclass(frozen=True)
class Decision:
    """Whether to move from the running plan to the search's best, and why."""

    switch: bool
    current_s: float | None  # the running plan's step, estimated with the run's times
    best_s: float | None  # the search's best plan's step, likewise
    gain: float  # predicted: current_s / best_s - 1 (0 when either is unknown)
    plan: ExecutionPlan  # the plan to run from now on (the running one when not switching)
    reason: str

    def line(self, step: int) -> str:
        if self.switch:
            return (f"step {step}: re-plan: switching plans, predicted {self.current_s:.4g} -> {self.best_s:.4g} s "
                    f"per step ({100 * self.gain:+.1f} % faster) from the run's own call times")
        return f"step {step}: re-plan: keeping the plan ({self.reason})"


def decide(current: ExecutionPlan, best: PlanEstimate, graph: CallGraph, models: Mapping[str, ModelConfig],
           wl: Workload, hw: HardwareProfile, threshold: float) -> Decision:
    """Switch to `best` (the search's pick on `hw`, which holds the run's times) when it is another
    plan and predicted faster than the running `current` by more than `threshold` (0.1 = 10 %);
    the running plan is estimated on the same profile, so both sides use the run's times."""
    now = estimate_plan(current, graph, models, wl, hw)
    if not best.feasible or best.step_s is None:
        return Decision(False, now.step_s, None, 0.0, current, f"the search found no feasible plan: {best.reason}")
    if placements(best.plan) == placements(current):
        return Decision(False, now.step_s, best.step_s, 0.0, current, "the search picks the running plan")
    if not now.feasible or now.step_s is None:  # the memory model now rejects the running plan: it runs, so keep it
        return Decision(False, None, best.step_s, 0.0, current, f"the running plan cannot be estimated: {now.reason}")
    gain = now.step_s / best.step_s - 1.0
    if gain <= threshold:
        return Decision(False, now.step_s, best.step_s, gain, current,
                        f"the best other plan is predicted {100 * gain:+.1f} % faster, "
                        f"not more than plan.replan_threshold={threshold:g}")
    return Decision(True, now.step_s, best.step_s, gain, best.plan, "predicted faster")
