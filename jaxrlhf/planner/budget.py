"""The packed micro-batch token budget as a plan choice (`algorithm.max_tokens_per_micro_batch` unset).

With `algorithm.pack_sequences` the train and inference calls run micro-batches of at most a budget of
real tokens (`models.packing.micro_batches`). A small budget holds fewer activations (a plan may fit
that would not) and runs more, smaller forwards (each a fixed cost: weight gathers, kernel launches);
no budget runs each update in one. Which is fastest depends on the placement, so the search is run
once per candidate budget (`budget_candidates`: from the drawn lengths, down to the longest sequence,
the smallest budget there is) and the fastest plan that fits is kept with its budget
(`ExecutionPlan.token_budget`), which the run then packs with (`ExecutionPlan.execution`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jaxrlhf.planner.plan import PlanError, seconds_text
from jaxrlhf.planner.workload import Workload

BUDGET_SPLITS = (2, 4, 8)  # candidate budgets: an update's drawn tokens over these (about that many micro-batches)
BUDGET_ROUND = 64  # budgets rounded up to a multiple of this many tokens


def budget_candidates(wl: Workload, group: int = 1) -> tuple[int | None, ...]:
    """Budgets the search tries: None (one micro-batch per update), an update's mean drawn real tokens
    (`Workload.response_lengths` plus prompts, a minibatch's sequences) over each of BUDGET_SPLITS, and
    the longest `group` of sequences (prompt_len + gen_len each: every budget must hold one, the config's
    rule), the smallest a plan can need; those at or above an update's tokens are the same as None."""
    update = wl.minibatch_size * group * (wl.prompt_len + float(wl.response_lengths(wl.minibatch_size * group).mean()))
    longest = group * wl.seq_len
    out: list[int | None] = [None]
    for split in BUDGET_SPLITS:
        b = max(BUDGET_ROUND * math.ceil(update / split / BUDGET_ROUND), longest)
        if b < update and b not in out:
            out.append(b)
    if longest < update and longest not in out:
        out.append(longest)
    return tuple(out)


def choose_token_budget(search: Callable[[Workload], "SearchResult"], wl: Workload, group: int = 1):  # noqa: F821
    """The search (`search(workload)`, a SearchResult; a PlanError when no plan fits) run for each of
    `budget_candidates`; the fastest plan that fits wins, its budget in `plan.token_budget`, every
    candidate's step time (None: nothing fits) in `token_budgets`, and seconds and evaluations summed.
    Nothing fits at any budget: the smallest budget's error."""
    tried, error = [], None
    for budget in budget_candidates(wl, group):
        try:
            tried.append((budget, search(dataclasses.replace(wl, token_budget=budget))))
        except PlanError as e:
            tried.append((budget, None))
            error = e
    fits = [(b, r) for b, r in tried if r is not None and r.best.feasible]
    if not fits:
        raise error or PlanError("no plan fits at any token budget")
    budget, best = min(fits, key=lambda t: t[1].best.step_s)
    plan = dataclasses.replace(best.best.plan, token_budget=budget)
    done = [r for _, r in tried if r is not None]
    syncs = [r.best_sync for r in done if r.best_sync is not None and r.best_sync.feasible]
    return dataclasses.replace(
        best, best=dataclasses.replace(best.best, plan=plan), presets=_presets_at_their_best(done),
        best_sync=min(syncs, key=lambda e: e.step_s) if syncs else best.best_sync,
        token_budgets=tuple((b, r.best.step_s if r is not None and r.best.feasible else None) for b, r in tried),
        seconds=sum(r.seconds for r in done), evaluations=sum(r.evaluations for r in done),
        budget_hit=any(r.budget_hit for r in done))


def _presets_at_their_best(results: list) -> dict:
    """Each preset at the budget where it is fastest (its plan carries that budget), as the best synchronous
    plan is: a preset priced at the budget the search's pick chose can be far from its best (verl's at a
    20k-token question: 740 s there, its own best budget elsewhere). A preset that fits no budget keeps the
    first reason it was given."""
    out: dict = {}
    for r in results:
        for name, est in r.presets.items():
            held = out.get(name)
            if held is None or (not isinstance(est, str) and est.feasible and (
                    isinstance(held, str) or not held.feasible or est.step_s < held.step_s)):
                out[name] = est
    return out


def budget_line(res) -> str | None:
    """`jaxrlhf.plan`'s why-line for a chosen budget (None when the search chose none)."""
    if not getattr(res, "token_budgets", ()):
        return None
    name = lambda b: "none" if b is None else f"{b}"  # noqa: E731
    tried = ", ".join(f"{name(b)}: {'does not fit' if s is None else f'{seconds_text(s)} s'}" for b, s in res.token_budgets)
    chosen = res.best.plan.token_budget
    what = f"{chosen} tokens per micro-batch" if chosen else "none (one micro-batch per update)"
    return f"token budget (algorithm.max_tokens_per_micro_batch unset): {what}, the fastest that fits of {tried}"
