"""`planner.budget.choose_token_budget`: the search once per candidate budget, the fastest plan kept with its
budget, and the presets and the best synchronous plan each at the budget where they are fastest."""

from __future__ import annotations

import dataclasses

from jaxrlhf.planner.budget import budget_candidates, choose_token_budget
from jaxrlhf.planner.search import SearchResult
from jaxrlhf.planner.workload import Workload


@dataclasses.dataclass(frozen=True)
class _Plan:
    token_budget: int | None = None


@dataclasses.dataclass(frozen=True)
class _Estimate:
    plan: _Plan
    feasible: bool
    step_s: float | None


def _est(budget, step_s):
    return _Estimate(_Plan(budget), step_s is not None, step_s)


def test_presets_and_the_synchronous_plan_are_priced_at_their_own_best_budget():
    wl = Workload(batch_size=64, prompt_len=64, gen_len=1024, minibatches=1, packed=True, gen_len_median=256,
                  gen_len_sigma=0.8)
    budgets = budget_candidates(wl)
    assert budgets[0] is None and len(budgets) >= 3
    # per budget: (best, best synchronous, verl preset, colocated preset)
    table = {budgets[0]: (10.0, 30.0, 50.0, "does not fit at this budget"),
             budgets[1]: (8.0, 25.0, 90.0, None),
             budgets[2]: (9.0, 20.0, 12.0, 40.0)}

    def search(w):
        best, sync, verl, colocated = table.get(w.token_budget, (None, None, None, None))
        if best is None:
            from jaxrlhf.planner.plan import PlanError
            raise PlanError("nothing fits")
        b = w.token_budget
        presets = {"verl": _est(b, verl),
                   "colocated": colocated if isinstance(colocated, str) else _est(b, colocated)}
        return SearchResult(_est(b, best), [], presets, 1.0, 10, False, best_sync=_est(b, sync))

    res = choose_token_budget(search, wl)
    assert res.best.step_s == 8.0 and res.best.plan.token_budget == budgets[1]
    assert (res.presets["verl"].step_s, res.presets["verl"].plan.token_budget) == (12.0, budgets[2])
    assert res.presets["colocated"].step_s == 40.0  # its only fitting budget, not the first one's reason
    assert (res.best_sync.step_s, res.best_sync.plan.token_budget) == (20.0, budgets[2])
    assert res.evaluations == 30 and dict(res.token_budgets)[budgets[1]] == 8.0
