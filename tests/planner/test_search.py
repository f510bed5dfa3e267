import dataclasses
import itertools
import random

import pytest

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner import search as search_module
from jaxrlhf.planner.cost import CostCache
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.plan import Layout, PlanError
from jaxrlhf.planner.search import SearchSpace, State, candidate_groups, search, state_to_plan, valid_layouts
from jaxrlhf.planner.simulator import estimate_plan
from jaxrlhf.planner.workload import Workload
from jaxrlhf.testing.graphs import ppo_graph

H100 = get_profile("h100")
GRAPH = CallGraph((
    CallSpec("actor.generate", "actor", "generate"),
    CallSpec("critic.inference", "critic", "inference", "value", deps=("actor.generate",)),
    CallSpec("actor.train", "actor", "train", deps=("actor.generate", "critic.inference")),
))


def test_groups_respect_hosts():
    groups = candidate_groups(32, 8)
    for start, size in groups:
        if size <= 8:
            assert start // 8 == (start + size - 1) // 8, (start, size)
        else:
            assert start % 8 == 0 and size % 8 == 0
    assert (0, 32) in groups and (8, 8) in groups and (6, 2) in groups and (4, 8) not in groups


def test_layouts_divide_the_model_and_batch():
    cfg = preset("llama2-34b")  # 64 heads, 8 kv heads
    wl = Workload(batch_size=64, minibatches=4)
    for kind in ("generate", "inference", "train"):
        call = CallSpec(f"actor.{kind}", "actor", kind)
        lays = valid_layouts(call, cfg, 16, wl, 8)
        assert lays
        for lay in lays:
            assert lay.num_devices == 16 and lay.tensor <= 8 and cfg.num_kv_heads % lay.tensor == 0
            assert wl.call_batch(kind) % (lay.data * lay.fsdp) == 0
            assert kind != "generate" or lay.fsdp == 1


def _small_instance():
    hw = dataclasses.replace(H100, devices_per_host=4)
    # 3 layers: no pipeline stage divides them, which keeps the exhaustive enumeration small
    models = {"actor": preset("llama-100m", num_layers=3), "critic": preset("llama-100m", num_layers=3)}
    wl = Workload(batch_size=16, prompt_len=64, gen_len=64, minibatches=2)
    return hw, models, wl


@pytest.mark.slow
def test_search_finds_the_exhaustive_optimum():
    hw, models, wl = _small_instance()
    space = SearchSpace.build(GRAPH, models, wl, 4, hw)
    cache = CostCache(models, wl, hw)
    best = float("inf")
    names = [c.name for c in GRAPH.calls]
    for combo in itertools.product(*(space.slots(n) for n in names)):
        for shadow in (frozenset(), frozenset({"actor"})):
            est = estimate_plan(state_to_plan(State(tuple(zip(names, combo)), shadow), 4), GRAPH, models, wl, hw,
                                cache=cache)
            if est.feasible:
                best = min(best, est.step_s)
    res = search(models, wl, hw, 4, GRAPH, seeds={}, iterations=3000, seed=1)
    assert res.best.step_s == pytest.approx(best, rel=1e-9)


def test_search_is_deterministic_for_a_seed():
    hw, models, wl = _small_instance()
    a = search(models, wl, hw, 4, GRAPH, seeds={}, iterations=400, seed=7)
    b = search(models, wl, hw, 4, GRAPH, seeds={}, iterations=400, seed=7)
    assert a.best.plan.to_dict() == b.best.plan.to_dict() and a.evaluations == b.evaluations


@pytest.mark.slow
def test_search_never_returns_an_over_memory_plan():
    models = {r: preset("llama2-13b") for r in ("actor", "critic", "ref", "reward")}
    wl = Workload(batch_size=128, gen_len=384)
    res = search(models, wl, H100, 8, ppo_graph(), iterations=600, seed=0)
    for est in [res.best, *res.runners_up]:
        assert est.feasible and est.memory.max_peak <= H100.usable_memory
    # never worse than any preset that fits
    for name, p in res.presets.items():
        if not isinstance(p, str) and p.feasible and not p.plan.offpolicy:
            assert res.best.step_s <= p.step_s + 1e-9, name


def test_impossible_instance_says_why():
    models = {r: preset("llama2-70b") for r in ("actor", "critic", "ref", "reward")}
    with pytest.raises(PlanError, match="no plan fits"):
        search(models, Workload(), H100, 2, ppo_graph(), iterations=100)


@pytest.mark.slow
def test_more_devices_are_never_estimated_slower_and_seeds_repeat():
    hw = dataclasses.replace(H100, devices_per_host=4)
    models = {"actor": preset("llama-100m"), "critic": preset("llama-100m")}
    wl = Workload(batch_size=32, prompt_len=64, gen_len=64, minibatches=2)
    best = {n: search(models, wl, hw, n, GRAPH, iterations=200, seed=3).best.step_s for n in (2, 4, 8)}
    for n in (4, 8):
        assert best[n] <= best[n // 2] + 1e-12, best
    search_module._RESULTS.clear()  # really search again, not the remembered result
    assert search(models, wl, hw, 8, GRAPH, iterations=200, seed=3).best.step_s == best[8]


def test_narrowing_keeps_the_best_of_each_basin_before_a_second_of_any(monkeypatch):
    """A basin whose start is worse than two starts of another basin still reaches the final."""
    hw, models, wl = _small_instance()
    space = SearchSpace.build(GRAPH, models, wl, 4, hw)
    ann = search_module._Annealer(space, models, wl, hw, steps=3, allow_offpolicy=False)
    together = search_module.greedy_seed(ann)  # everything on all 4 devices
    others = [together.with_slot("critic.inference", (0, 4, lay))
              for lay in space.layouts[("critic.inference", 4)] if lay != together.get("critic.inference")[2]]
    apart = ann.place_home(ann.place_home(together, "actor", (0, 2, ann.ranked("actor.train", 0, 2)[0])),
                           "critic", (2, 2, space.layouts[("critic.inference", 2)][0]))
    pool = sorted([together, *others], key=lambda st: ann.energy(st)[0])[:3]
    assert len({ann.basin(st) for st in pool}) == 1 and ann.basin(apart) != ann.basin(together)
    assert ann.energy(apart)[0] > ann.energy(pool[1])[0]  # apart would lose a plain halving
    monkeypatch.setattr(ann, "chain", lambda st, *args, **kw: (st, False))  # judge the starts as they are
    finalists, hit = ann.successive_halving([*pool, apart], 400, random.Random(0))
    assert not hit and finalists == [pool[0], apart]


def _annealer_on_h100(sizes: dict[str, str], n: int = 64) -> search_module._Annealer:
    """The search's annealer for PPO with LLaMA-2 models of `sizes` on `n` H100s, batch as in bench_planner.py.
    The landscapes below (a local optimum, a bottom only a kick leaves) were found on the h100 profile's
    efficiencies before their calibration on the H200 (scripts/calibrate_gpu_profiles.py): they test the
    search's moves, so they keep those numbers."""
    models = {role: preset(f"llama2-{size}") for role, size in sizes.items()}
    wl = Workload.from_tokens(2**17, 128, 128, micro_batch=16)
    hw = dataclasses.replace(H100, matmul_efficiency=0.6, memory_efficiency=0.8)
    space = SearchSpace.build(ppo_graph(), models, wl, n, hw)
    return search_module._Annealer(space, models, wl, hw, steps=3, allow_offpolicy=False)


def _lay(data: int, tensor: int, stage: int) -> Layout:
    return Layout(data=data, fsdp=1, tensor=tensor, stage=stage)


@pytest.mark.slow
def test_side_by_side_reaches_a_split_no_single_call_move_reaches():
    """Scaled critic, 34B critic and reward with 7B actor and reference on 32 H100s: every call on all
    devices (each at the layout single-call moves settle on) is a local optimum for single-call moves,
    but reward and critic inference on the two halves at once (the critic keeping a shadow copy there)
    are faster. The polish finds it. (The gain is small, 6.420 -> 6.419 s: the test is about reaching it.)"""
    ann = _annealer_on_h100({"actor": "7b", "ref": "7b", "critic": "34b", "reward": "34b"}, n=32)
    together = State((("actor.generate", (0, 32, _lay(4, 8, 1))), ("reward.inference", (0, 32, _lay(16, 1, 2))),
                      ("ref.inference", (0, 32, _lay(8, 1, 4))), ("critic.inference", (0, 32, _lay(4, 2, 4))),
                      ("actor.train", (0, 32, _lay(4, 2, 4))), ("critic.train", (0, 32, _lay(4, 2, 4)))))
    e_together = ann.energy(together)[0]
    assert e_together < 1e6  # fits
    for call, _ in together.slots:
        for slot in ann.slots[call]:
            assert ann.energy(together.with_slot(call, slot))[0] >= e_together * (1 - 1e-9), (call, slot)
    assert ("reward.inference", "critic.inference") in ann.independent
    assert ("actor.generate", "critic.inference") not in ann.independent  # critic.inference reads the samples
    polished, hit = ann.polish(together)
    assert not hit and ann.energy(polished)[0] < e_together * (1 - 1e-6)
    halves = {polished.get(c)[:2] for c in ("reward.inference", "critic.inference")}
    assert halves == {(0, 16), (16, 16)} and "critic" in polished.shadow


@pytest.mark.slow
def test_a_kick_leaves_a_bottom_the_polish_cannot_and_stops_at_one_no_kick_beats():
    """Four 70B models on 64 H100s: generation on all devices, the trained roles' calls on halves, without
    shadow copies, is a bottom for the polish (every single-call and compound move is slower), and no shadow
    move alone helps. A kick (a critic shadow copy with one critic call moved, then a sweep) reaches the
    critic-shadow family 11 % faster (12.8 s vs 14.4 s); from there no kick helps, and the bottom is kept."""
    ann = _annealer_on_h100({"actor": "70b", "ref": "70b", "critic": "70b", "reward": "70b"})
    bottom = State((("actor.generate", (0, 64, _lay(8, 8, 1))), ("reward.inference", (32, 32, _lay(4, 1, 8))),
                    ("ref.inference", (0, 32, _lay(4, 1, 8))), ("critic.inference", (0, 64, _lay(2, 2, 16))),
                    ("actor.train", (32, 32, _lay(2, 8, 2))), ("critic.train", (0, 32, _lay(2, 8, 2)))))
    e_bottom = ann.energy(bottom)[0]
    assert e_bottom < 1e6  # fits
    polished, hit = ann.polish(bottom)
    assert not hit and polished == bottom
    kicks = sorted(dict.fromkeys(ann.shadow_moves(bottom)), key=lambda k: ann.energy(k)[0])
    assert ann.energy(kicks[0])[0] > e_bottom  # no move alone helps
    kicked, hit = ann.kicked(bottom)
    assert not hit and kicked.shadow == {"critic"} and ann.energy(kicked)[0] < e_bottom * 0.95
    again, hit = ann.kicked(kicked)
    assert not hit and again == kicked


def _async_annealer(staleness: int):
    """The small instance with long-tailed response lengths (median 8 of 128 tokens, sigma 1.5), the
    generator allowed `staleness` steps ahead, and its disaggregated plan made off-policy."""
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.planner.search import plan_to_state

    hw, models, wl = _small_instance()
    wl = dataclasses.replace(wl, gen_len=128, gen_len_median=8, gen_len_sigma=1.5, ppo_epochs=2, staleness=staleness)
    ann = search_module._Annealer(SearchSpace.build(GRAPH, models, wl, 4, hw), models, wl, hw, steps=3,
                                  allow_offpolicy=True)
    plan = build_plan("disaggregated", 4, models, GRAPH, batch_size=wl.batch_size, devices_per_host=4)
    return ann, dataclasses.replace(plan_to_state(plan, GRAPH), offpolicy=True)


def test_the_search_chooses_the_fewest_steps_ahead_that_reach_the_best_time():
    """An off-policy state carries its eta within 1..the budget (Workload.staleness); the plan says it
    (YAML key staleness). Of the etas that reach the best time, the fewest wins: a staler rollout
    that buys no speed only costs learning. Here the tail makes eta 2 faster than 1."""
    from jaxrlhf.planner.plan import ExecutionPlan

    ann, st = _async_annealer(staleness=3)
    e = {eta: ann.energy(dataclasses.replace(st, staleness=eta))[0] for eta in (1, 2, 3)}
    assert e[2] < e[1]
    fewest = min(eta for eta in e if e[eta] <= min(e.values()) * (1 + 1e-9))
    chosen = ann.freshest(dataclasses.replace(st, staleness=3))
    assert chosen.staleness == fewest > 1
    plan = state_to_plan(chosen, 4)
    assert plan.staleness == fewest and f"staleness: {fewest}" in plan.to_yaml()
    assert ExecutionPlan.from_yaml(plan.to_yaml()).staleness == fewest
    rng = random.Random(0)
    assert {ann.restaled(dataclasses.replace(st, staleness=eta), rng).staleness
            for eta in (1, 2, 3) for _ in range(8)} == {1, 2, 3}
    assert state_to_plan(dataclasses.replace(chosen, offpolicy=False), 4).staleness is None
    # with the budget at 1 there is nothing to choose: the plan leaves staleness out, as before
    ann, st = _async_annealer(staleness=1)
    assert ann.freshest(st) is st and "staleness" not in state_to_plan(st, 4).to_yaml()


def test_a_disaggregated_seed_puts_generation_and_training_on_the_two_halves():
    """With off-policy plans allowed, the search starts one plan per generating trained role with its
    generate call on the first half, its training on the second (each in its fastest layout that fits
    alone) and a shadow copy running ahead; every other call sits where the plan is fastest. Without
    off-policy plans there is no such seed."""
    ann, _ = _async_annealer(staleness=2)
    greedy = search_module.greedy_seed(ann)
    (seed,) = search_module.disaggregated_seeds(ann, greedy)
    assert seed.get("actor.generate") == (0, 2, ann.ranked("actor.generate", 0, 2)[0])
    assert seed.get("actor.train") == (2, 2, ann.ranked("actor.train", 2, 2)[0])
    assert seed.shadow == {"actor"} and seed.offpolicy and seed.staleness is None
    e_seed = ann.energy(seed)[0]
    assert e_seed < 1e6  # fits
    for side in ((0, 2), (2, 2), greedy.get("critic.inference")[:2]):
        for lay in ann.ranked("critic.inference", *side):
            assert ann.energy(seed.with_slot("critic.inference", (*side, lay)))[0] >= e_seed * (1 - 1e-9)
    plan = state_to_plan(seed, 4)
    assert plan.offpolicy and plan.shadow_roles == ("actor",)
    on_policy = search_module._Annealer(ann.space, ann.models, ann.wl, ann.hw, steps=3, allow_offpolicy=False)
    assert search_module.disaggregated_seeds(on_policy, greedy) == []


@pytest.mark.slow
def test_the_search_reaches_a_split_plan_no_colocated_or_preset_start_leads_to():
    """verl's fully-async Qwen3-30B-A3B workload on 128 H20s (its length as validate_published fits it):
    generation and the reference on one half with the trainer on the other is 244.9 s a step, and every
    start but the disaggregated seed polishes to a plan on all devices at 273 s or more."""
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("validate_published", root / "scripts" / "validate_published.py")
    vp = importlib.util.module_from_spec(spec)
    sys.modules["validate_published"] = vp
    spec.loader.exec_module(vp)
    from jaxrlhf.run.assembly import Machine, setup

    case = next(c for c in vp.load_cases(str(root / "docs" / "results" / "published_cases.yaml"))
                if c["name"] == "verl-fully-async-30b-a3b-async-96-32")
    case = {**case, "response_len": {**case["response_len"], "mean": 2489.2}}
    cfg = vp.run_config(case, peer_knobs=False)
    run = setup(cfg, machine=Machine.described(cfg, 128), runtime=False)
    wl = dataclasses.replace(run.algorithm.workload(), token_budget=1410368)
    res = search(run.planned_models, wl, run.hardware, 128, run.graph, evaluations=2400, iterations=3200,
                 allow_offpolicy=True)
    plan = res.best.plan
    assert res.best.step_s < 250 and plan.shadow_roles == ("actor",) and plan.offpolicy
    assert plan.group_of("actor.generate").start == 0 and plan.group_of("actor.train").start == 64
    assert plan.group_of("actor.generate").size == plan.group_of("actor.train").size == 64


def test_an_off_policy_plan_whose_generator_shares_devices_with_training_is_never_picked():
    """The runtime refuses an off-policy plan whose generate call shares devices with a train call
    (`plan.offpolicy_problem`); the search prices it as infeasible, so it never returns one."""
    from jaxrlhf.planner.plan import validate

    ann, st = _async_annealer(staleness=2)
    plan = state_to_plan(st, 4)
    assert ann.energy(st)[1].feasible
    shared = dataclasses.replace(plan, calls={**plan.calls, "actor.generate": plan.calls["actor.train"]})
    est = estimate_plan(shared, GRAPH, ann.models, ann.wl, ann.hw)
    assert not est.feasible and "share devices" in est.reason
    hw, models, wl = _small_instance()
    wl = dataclasses.replace(wl, gen_len=128, gen_len_median=8, gen_len_sigma=1.5, staleness=2)
    for seed in range(3):
        best = search(models, wl, hw, 4, GRAPH, iterations=150, seed=seed, allow_offpolicy=True).best.plan
        validate(best, GRAPH, models, devices=4, batch_size=wl.batch_size)


def test_the_search_reports_the_best_on_policy_plan_beside_the_best():
    """With off-policy plans allowed, `best_sync` is the best plan whose rollouts are on-policy and
    `async_gain` what the generator running ahead buys over it (1.0 when an on-policy plan wins);
    without, nothing is claimed about asynchronous plans."""
    hw, models, wl = _small_instance()
    graph = ppo_graph()
    models = {**models, "ref": models["actor"], "reward": models["critic"]}
    sync = search(models, wl, hw, 4, graph, iterations=200, time_budget_s=30)
    assert not sync.offpolicy_searched and sync.async_gain is None and sync.best_sync is sync.best
    both = search(models, wl, hw, 4, graph, iterations=200, time_budget_s=30, allow_offpolicy=True)
    assert both.offpolicy_searched and not both.best_sync.plan.offpolicy
    assert both.async_gain == pytest.approx(both.best_sync.step_s / both.best.step_s) and both.async_gain >= 1.0


def test_a_kept_search_answers_the_same_question_and_only_that(tmp_path, monkeypatch):
    """`cache_dir` keeps a finished search: the same question is answered from the file (no plan
    estimated), another seed or device count searches, and a damaged file is searched again and replaced."""
    hw = dataclasses.replace(H100, devices_per_host=4)
    models = {"actor": preset("llama-100m"), "critic": preset("llama-100m")}
    wl = Workload(batch_size=32, prompt_len=64, gen_len=64, minibatches=2)
    first = search(models, wl, hw, 4, GRAPH, iterations=200, seed=11, cache_dir=str(tmp_path))
    # 4 devices, and the 2 seeding it (a 1-device seed search would get fewer than MIN_EVALUATIONS)
    assert first.kept_in is None and len(list(tmp_path.iterdir())) == 2
    monkeypatch.setattr(search_module, "_RESULTS", {})  # a new process: only the folder remembers
    estimated = []
    real = search_module.estimate_plan
    monkeypatch.setattr(search_module, "estimate_plan", lambda *a, **k: estimated.append(1) or real(*a, **k))
    again = search(models, wl, hw, 4, GRAPH, iterations=200, seed=11, cache_dir=str(tmp_path))
    assert again.kept_in == str(tmp_path) and not estimated
    assert again.best.plan == first.best.plan and again.best.step_s == first.best.step_s
    assert again.evaluations == first.evaluations

    other = search(models, wl, hw, 4, GRAPH, iterations=200, seed=12, cache_dir=str(tmp_path))
    assert other.kept_in is None and estimated

    monkeypatch.setattr(search_module, "_RESULTS", {})
    for path in tmp_path.iterdir():
        path.write_bytes(b"not a pickle")
    redone = search(models, wl, hw, 4, GRAPH, iterations=200, seed=11, cache_dir=str(tmp_path))
    assert redone.kept_in is None and redone.best.plan == first.best.plan
    monkeypatch.setattr(search_module, "_RESULTS", {})
    assert search(models, wl, hw, 4, GRAPH, iterations=200, seed=11, cache_dir=str(tmp_path)).kept_in == str(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
