"""The simulator on hand-made graphs whose makespans are easy to work out by hand."""

import dataclasses

import numpy as np
import pytest

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
from jaxrlhf.planner.simulator import MIN_STEPS, Op, Span, Timeline, build_ops, schedule, steady_state

# gen (actor) -> score (reward), value (critic) -> train (actor)
G = CallGraph((
    CallSpec("actor.generate", "actor", "generate"),
    CallSpec("reward.inference", "reward", "inference", "reward", deps=("actor.generate",)),
    CallSpec("critic.inference", "critic", "inference", "value", deps=("actor.generate",)),
    CallSpec("actor.train", "actor", "train", deps=("reward.inference", "critic.inference")),
))
T = {"actor.generate": 4.0, "reward.inference": 1.0, "critic.inference": 2.0, "actor.train": 3.0}
GROUPS = {"all": DeviceGroup("all", 0, 4), "lo": DeviceGroup("lo", 0, 2), "hi": DeviceGroup("hi", 2, 2)}


def plan(where: dict[str, str], layouts: dict[str, Layout] | None = None, **kw) -> ExecutionPlan:
    layouts = layouts or {}
    calls = {c: Placement(g, layouts.get(c, Layout(data=GROUPS[g].size))) for c, g in where.items()}
    return ExecutionPlan("test", 4, GROUPS, calls, **kw)


def run(p: ExecutionPlan, steps: int = 2, moves=None):
    return schedule(build_ops(G, p, T, moves or {}, steps), 4)


def test_everything_on_all_devices_serialises():
    tl = run(plan({c: "all" for c in G.names}), steps=3)
    assert tl.makespan == pytest.approx(3 * sum(T.values()))
    assert tl.step_s == pytest.approx(sum(T.values()))


def test_disjoint_groups_overlap():
    p = plan({"actor.generate": "all", "reward.inference": "lo", "critic.inference": "hi", "actor.train": "all"})
    tl = run(p, steps=1)
    assert tl.makespan == pytest.approx(4 + max(1, 2) + 3)


def test_groups_sharing_a_hosts_cores_take_turns():
    """Simulated CPU devices: the reward and critic calls on disjoint halves of one host run one after
    the other (the cores are the same); with hosts of 2 devices they are on two hosts and overlap."""
    p = plan({"actor.generate": "all", "reward.inference": "lo", "critic.inference": "hi", "actor.train": "all"})
    ops = build_ops(G, p, T, {}, 1)
    assert schedule(ops, 4, shared_host=4).makespan == pytest.approx(4 + 1 + 2 + 3)
    assert schedule(ops, 4, shared_host=2).makespan == pytest.approx(4 + 2 + 3)


def test_next_step_waits_for_the_roles_previous_train_call():
    # reward and critic live on "hi"; actor entirely on "lo". The critic call of step 1 need not
    # wait for anything but its deps, yet actor.generate@1 must wait for actor.train@0.
    p = plan({"actor.generate": "lo", "reward.inference": "hi", "critic.inference": "hi", "actor.train": "lo"})
    tl = run(p, steps=2)
    spans = {s.op.name: s for s in tl.spans}
    assert spans["actor.generate@1"].start == pytest.approx(spans["actor.train@0"].end)
    # gen 4, then reward 1 + critic 2 serialised on hi, then train 3: 10 per step, strictly sequential.
    assert tl.makespan == pytest.approx(20)


def test_reallocation_occupies_both_groups():
    # actor home is "hi" (train); generation runs on "lo" after a 0.5 s reallocation over lo + hi.
    p = plan({"actor.generate": "lo", "reward.inference": "lo", "critic.inference": "hi", "actor.train": "hi"})
    tl = run(p, steps=1, moves={"actor.generate": 0.5})
    spans = {s.op.name: s for s in tl.spans}
    r = spans["actor.generate:realloc@0"]
    assert (r.start, r.end) == (0.0, 0.5) and set(r.op.ranges) == {(0, 2), (2, 4)}
    assert spans["actor.generate@0"].start == pytest.approx(0.5)
    # then reward (lo) and critic (hi) overlap, then train: 0.5 + 4 + max(1, 2) + 3
    assert tl.makespan == pytest.approx(9.5)


def test_no_reallocation_at_home_or_when_free():
    p = plan({c: "all" for c in G.names})
    ops = build_ops(G, p, T, {"actor.generate": 0.0}, 1)
    assert [o.kind for o in ops] == ["call"] * 4


def test_shadow_sync_and_one_step_off_policy_overlap():
    # Generation on a shadow copy on "lo"; everything else on "hi". On-policy: gen@1 waits for the
    # sync after train@0. Off-policy: gen@1 only needs the sync of step -1, so it overlaps train@0.
    where = {"actor.generate": "lo", "reward.inference": "hi", "critic.inference": "hi", "actor.train": "hi"}
    moves = {"actor.generate": 0.5}
    on = run(plan(where, shadow_roles=("actor",)), steps=3, moves=moves)
    # per step: gen 4, reward 1 + critic 2 (hi), train 3 (hi), sync 0.5 (lo + hi)
    assert on.step_s == pytest.approx(4 + 3 + 3 + 0.5)
    off = run(plan(where, shadow_roles=("actor",), offpolicy=True), steps=4, moves=moves)
    # steady state: hi does reward + critic + train + sync = 6.5 per step; lo's 4 s of gen hides behind it
    assert off.step_s == pytest.approx(6.5)
    syncs = [s for s in off.spans if s.op.kind == "sync"]
    assert len(syncs) == 4 and all(set(s.op.ranges) == {(0, 2), (2, 4)} for s in syncs)


def test_list_scheduler_rejects_cycles_and_unknown_deps():
    with pytest.raises(ValueError, match="unknown op"):
        schedule([Op("a", "a", "call", 0, ((0, 1),), 1.0, ("ghost",))], 1)
    with pytest.raises(ValueError, match="cycle"):
        schedule([Op("a", "a", "call", 0, ((0, 1),), 1.0, ("b",)), Op("b", "b", "call", 0, ((0, 1),), 1.0, ("a",))], 1)


def _timeline(ends: list[float]) -> Timeline:
    """A timeline with one op per step ending at `ends[step]`."""
    spans = [Span(Op(f"x@{i}", "x", "call", i, ((0, 1),), 1.0), e - 1.0, e) for i, e in enumerate(ends)]
    return Timeline(spans, len(ends))


def test_step_time_is_the_repeating_gap_without_the_first_and_last_steps():
    # The first step fills an empty pipeline (10 s); the last two end early because no later step
    # competes for their devices (70B/128: 8.96 s gaps, then 7.49 s). Steady state: 8 s per step.
    tl = _timeline([10, 18, 26, 34, 42, 50, 55, 58])
    assert tl.step_gaps() == [8, 8, 8, 8, 8] and tl.period() == 1
    assert tl.step_s == pytest.approx(8.0)
    assert (58 - 10) / 7 < 7  # the mean over all steps, what a short schedule reported
    # gaps that alternate (an off-policy shadow two steps behind): the mean over the period
    tl = _timeline([4, 9, 16, 21, 28, 33, 40, 45, 47, 48])
    assert tl.period() == 2 and tl.step_s == pytest.approx(6.0)


def test_steady_state_simulates_until_the_gaps_repeat():
    where = {"actor.generate": "lo", "reward.inference": "hi", "critic.inference": "hi", "actor.train": "hi"}
    tl = steady_state(G, plan(where, shadow_roles=("actor",), offpolicy=True), T, {"actor.generate": 0.5})
    assert tl.steps >= MIN_STEPS and tl.period() == 1 and tl.step_s == pytest.approx(6.5)
    tl = steady_state(G, plan(where, shadow_roles=("actor",), offpolicy=True), T, {"actor.generate": 0.5}, steps=2)
    assert tl.steps > 2 and tl.step_s == pytest.approx(6.5)  # too short to see a period: simulated longer


def test_micro_batch_count_is_chosen_per_call():
    """With `micro_batch="auto"`, each call gets the fewest micro-batches that let the plan fit (fastest
    first). One count for every call charges the calls that need no split for the kernel launches
    and FSDP gathers of 16 micro-batches."""
    import dataclasses

    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.cost import CostCache
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.knobs import front
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.planner.workload import Workload
    from jaxrlhf.testing.graphs import ppo_graph

    graph, hw = ppo_graph(), get_profile("h100")
    models = {r: preset("llama2-7b") for r in graph.roles}
    fixed = Workload.from_tokens(2**17, 128, 128, micro_batch=8, remat="none")  # 16 per minibatch
    searched = dataclasses.replace(fixed, micro_batch="auto")
    plan = build_plan("colocated", 8, models, graph, batch_size=fixed.batch_size, devices_per_host=8)
    est = estimate_plan(plan, graph, models, searched, hw)
    assert est.feasible and {k.micro for k in est.knobs.values()} <= {1, None}  # 7B fits on 8 H100s unsplit
    slow = estimate_plan(plan, graph, models, fixed, hw)
    assert slow.feasible and est.step_s < slow.step_s
    # with 80 % of the memory, one micro-batch no longer fits: the calls on the full devices split
    tight = dataclasses.replace(hw, hbm_capacity=hw.hbm_capacity * 0.8)
    est = estimate_plan(plan, graph, models, searched, tight)
    cache = CostCache(models, searched, tight)
    assert est.feasible and est.knobs["actor.train"].micro > 1 and est.knobs["actor.generate"].micro is None
    for c in graph.calls:
        assert est.knobs[c.name] in front(c, plan.group_of(c.name), plan.calls[c.name].layout, searched, cache)


# Asynchronous RL: the generator runs up to eta steps ahead on its shadow copy ("lo"); the rest share
# "hi", which is busy 1 + 2 + 3 + 0.5 (reward, critic, train, sync) = 6.5 s per step.
ASYNC = {"actor.generate": "lo", "reward.inference": "hi", "critic.inference": "hi", "actor.train": "hi"}


def test_a_deeper_buffer_buys_nothing_when_every_generate_lasts_the_same():
    p = plan(ASYNC, shadow_roles=("actor",), offpolicy=True)
    times = [steady_state(G, p, T, {"actor.generate": 0.5}, staleness=eta).step_s for eta in (1, 2, 4)]
    assert times == pytest.approx([6.5, 6.5, 6.5])
    ops = build_ops(G, p, T, {"actor.generate": 0.5}, 6, staleness=3)
    gen = next(o for o in ops if o.name == "actor.generate@5")
    assert gen.deps == ("actor.generate:sync@1",)  # step i waits for the sync of step i - (eta + 1)


def test_a_deeper_buffer_absorbs_a_long_generate():
    """Generate lasts 2 s in seven steps of eight and 30 s in the eighth (mean 5.5 s; with its 0.5 s
    sync "lo" is busy 6 s per step, "hi" 6.5 s). One step ahead, the long one holds up the trainer;
    every further step of buffer hides more of it, down to the bound of the busier group."""
    p = plan(ASYNC, shadow_roles=("actor",), offpolicy=True)
    cycle = {**T, "actor.generate": (2.0,) * 7 + (30.0,)}
    steps = {eta: steady_state(G, p, cycle, {"actor.generate": 0.5}, staleness=eta) for eta in (1, 2, 8)}
    assert steps[1].period() == 8 and steps[1].step_s == pytest.approx(9.5)
    assert steps[2].step_s == pytest.approx(8.75) and steps[2].step_s < steps[1].step_s
    bound = max(sum(cycle["actor.generate"]) / 8 + 0.5, 6.5)
    assert all(tl.step_s >= bound - 1e-9 for tl in steps.values()) and steps[8].step_s == pytest.approx(bound)


def _llama_async(**wl_kw):
    import dataclasses

    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.planner.workload import Workload
    from jaxrlhf.testing.graphs import ppo_graph

    # the h100 profile's efficiencies before their calibration on the H200 (scripts/calibrate_gpu_profiles.py),
    # which the pinned estimate below was made with
    graph, hw = ppo_graph(), dataclasses.replace(get_profile("h100"), matmul_efficiency=0.6, memory_efficiency=0.8)
    models = {r: preset("llama-100m") for r in graph.roles}
    wl = Workload(batch_size=16, prompt_len=64, gen_len=512, minibatches=2, **wl_kw)
    p = build_plan("disaggregated", 8, models, graph, batch_size=wl.batch_size, devices_per_host=8)
    return graph, models, wl, hw, dataclasses.replace(p, offpolicy=True)


def test_the_defaults_reproduce_the_estimate_from_before_staleness_and_lengths():
    """The numbers the planner gave (at the commit before these inputs) for this disaggregated,
    off-policy plan; a median with sigma 0 (no lengths drawn) and eta 1 change nothing."""
    from jaxrlhf.planner.simulator import estimate_plan

    graph, models, wl, hw, p = _llama_async()
    before = estimate_plan(p, graph, models, wl, hw).step_s
    # decode steps read the whole cache, as jaxrlhf's engines do (since 2026-11-29); the context growing step by
    # step, as it was priced then (a paged engine's, `live_kv`), gives the number pinned at that commit
    assert before == pytest.approx(0.4674973579973103, rel=1e-12)
    growing = dataclasses.replace(wl, live_kv=True)
    assert estimate_plan(p, graph, models, growing, hw).step_s == pytest.approx(0.46268016855253413, rel=1e-12)
    for kw in ({"gen_len_median": 32}, {"gen_len_median": 32, "gen_len_sigma": 0.0, "staleness": 1}):
        again = estimate_plan(p, graph, models, wl.__class__(**{**wl.__dict__, **kw}), hw).step_s
        assert again == before


def test_generate_lasts_as_long_as_the_engine_decodes_the_drawn_lengths():
    """Static: each batch decodes until its longest response ends (the runtime's loop stops when every
    row is done), so a batch whose longest row reaches the cap costs the cap's time. Continuous, with a
    pool of 4 slots for 16 rows: the tokens over the pool plus the last round's tail, below the cap."""
    import numpy as np

    from jaxrlhf.models.slots import pool_size
    from jaxrlhf.planner.cost import CostCache, generate_durations
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.planner.workload import LENGTH_BATCHES

    for engine in ("static", "continuous"):
        graph, models, wl, hw, p = _llama_async(gen_engine=engine, gen_slots=4, gen_len_median=16, gen_len_sigma=1.0)
        call = next(c for c in graph.calls if c.kind == "generate")
        lay = p.calls[call.name].layout
        ways = lay.data * lay.fsdp
        cost = CostCache(models, wl, hw).call(call, p.group_of(call.name), lay)
        durations = generate_durations(cost, wl, call, ways)
        lengths = wl.response_lengths(wl.call_seqs(call))
        assert len(durations) == LENGTH_BATCHES and max(durations) <= cost.seconds
        assert lengths.shape == (LENGTH_BATCHES, 16) and lengths.min() >= 1 and lengths.max() <= 512
        prefill = cost.parts["prefill"]
        if engine == "static":
            expect = prefill + (cost.seconds - prefill) * lengths.max(axis=1) / 512
            assert durations == pytest.approx(list(expect))
            assert durations[int(lengths.max(axis=1).argmax())] == pytest.approx(max(durations))
        else:
            share = cost.decode_width_share
            assert 0.0 < share <= 1.0
            slots = pool_size(16, 4, ways) // ways
            steps = [_continuous_by_step(batch, ways, slots, share) for batch in lengths]
            assert durations == pytest.approx(list(prefill + (cost.seconds - prefill) * np.array(steps) / (4 * 512)))
            assert max(durations) < cost.seconds
        est = estimate_plan(p, graph, models, wl, hw)
        assert est.timeline.period() == LENGTH_BATCHES and np.mean(durations) <= est.step_s < cost.seconds


def test_continuous_steps_that_read_only_the_filled_columns_cost_by_their_reads():
    """The continuous engine with its pool holding the whole batch (rows start together) reads the narrowest
    span of response columns that holds step t + 1's tokens (`models.slots.read_columns`: 512, 1024, 2048 of a
    2048 cap). Priced step by step here: a step of width w costs (1 - share) + share x w / slots x
    ((1 - kv) + kv x c(t)) against the call's steps, c(t) its columns read over the whole cache's; a batch's
    time is its steps' share of the call's. Cheaper than the static engine's whole-cache steps."""
    import dataclasses

    from jaxrlhf.models.slots import read_columns
    from jaxrlhf.planner.cost import CostCache, generate_durations

    graph, models, wl, hw, p = _llama_async(gen_engine="continuous", gen_len_median=300, gen_len_sigma=1.0)
    wl = dataclasses.replace(wl, gen_len=2048)
    call = next(c for c in graph.calls if c.kind == "generate")
    lay = p.calls[call.name].layout
    ways = lay.data * lay.fsdp
    assert wl.decode_reads(call, ways) == read_columns(2048, 16) == (2048, 1024, 512)
    cost = CostCache(models, wl, hw).call(call, p.group_of(call.name), lay)
    share, kv = cost.decode_width_share, cost.decode_context_share
    assert 0 < share <= 1 and 0 < kv <= 1
    reads = [512 if t < 512 else 1024 if t < 1024 else 2048 for t in range(2048)]
    c = [(64 + r) / (64 + 2048) for r in reads]
    priced = sum((1 - kv) + kv * x for x in c)
    slots = 16 // ways
    widths = sorted({-(-slots // 2**k) for k in range(4)})
    prefill = cost.parts["prefill"]
    for batch, got in zip(wl.response_lengths(16), generate_durations(cost, wl, call, ways)):
        left = [sorted(s) for s in np.asarray(batch).reshape(ways, -1)]
        steps, row_part = 0, 0.0
        for t in range(int(max(batch))):
            busiest = max(sum(1 for n in s if n > t) for s in left)
            width = next(w for w in widths if w >= busiest)
            steps += 1
            row_part += width / slots * ((1 - kv) + kv * c[t])
        fraction = (1 - share) * steps / 2048 + share * row_part / priced
        assert got == pytest.approx(prefill + (cost.seconds - prefill) * fraction, rel=1e-9)
    whole = CostCache(models, dataclasses.replace(wl, gen_engine="static"), hw).call(call, p.group_of(call.name), lay)
    assert cost.parts["decode"] < whole.parts["decode"]


def _continuous_by_step(lengths, ways: int, slots: int, share: float) -> float:
    """The continuous engine step by step (an independent count for the planner's): each shard's rows
    (contiguous blocks) enter its slots in order as slots free; every step each active row decodes a token
    and the step runs the narrowest of the slot count halved up to 3 times that holds the busiest shard's
    rows, costing (1 - share) + share x width / slots of a full step."""
    import numpy as np

    shards = np.asarray(lengths).reshape(ways, -1)
    left = [list(s) for s in shards]  # rows still to enter, per shard
    running = [[] for _ in range(ways)]  # tokens left of the rows in slots
    widths = sorted({-(-slots // 2**k) for k in range(4)})
    total = 0.0
    while any(left) or any(running):
        for k in range(ways):
            while left[k] and len(running[k]) < slots:
                running[k].append(int(left[k].pop(0)))
        busiest = max(len(r) for r in running)
        width = next(w for w in widths if w >= busiest)
        total += (1 - share) + share * width / slots
        running = [[n - 1 for n in r if n > 1] for r in running]
    return total


def test_decode_steps_of_the_engines_by_hand():
    """Four rows of 5, 1, 1, 1 tokens in 4 slots: one step at width 4, then four at width 1 (widths 4, 2,
    1): 5 steps, 2 full steps' worth of width. A stream (G = 2, one group per batch, 2 decode slots, 2
    group slots: eta = 1) over batches [3, 1] and [1, 1]: batch 0's rows take both slots, batch 1's wait
    for them and finish with it at step 3 (read every step); the second round alike: 3 full-width steps
    for the first batch of a round, none left for the second."""
    from jaxrlhf.planner.workload import _continuous_batch, _stream_batches

    assert _continuous_batch((5, 1, 1, 1), 1, 4) == (5.0, 2.0, 2.0)
    # steps reading spans of 2 or 5 columns of a 5-column cap (no prompt), every row starting at step 0: the
    # width-4 step reads 2 (0.4 of the cache), then steps of width 1/4 read 2, 5, 5, 5: 0.4 + 0.25 x 3.4
    assert _continuous_batch((5, 1, 1, 1), 1, 4, (5, 2), 0, 5) == pytest.approx((5.0, 2.0, 1.25))
    assert _continuous_by_step((5, 1, 1, 1), 1, 4, 1.0) == 2.0 and _continuous_by_step((5, 1, 1, 1), 1, 4, 0.0) == 5.0
    assert _stream_batches(((3, 1), (1, 1)), 2, 1, 2, 2, 1, 1) == ((3.0, 3.0, 3.0), (0.0, 0.0, 0.0))
    # read every 4 steps: the groups done at step 3 are taken at 4, the next round decodes 4-6 (3 steps)
    assert _stream_batches(((3, 1), (1, 1)), 2, 1, 2, 2, 4, 1) == ((3.0, 3.0, 3.0), (0.0, 0.0, 0.0))
    # eta = 0: batch 1 enters only once batch 0 is taken: batch 0's 3-token row runs alone for 2 of its
    # 3 steps (width 1 of 2), then batch 1's two rows take one step
    assert _stream_batches(((3, 1), (1, 1)), 2, 1, 2, 2, 1, 0) == ((3.0, 2.0, 2.0), (1.0, 1.0, 1.0))


def test_a_smaller_pools_steps_read_by_its_oldest_active_row():
    """A continuous pool smaller than its rows admits a row when another ends, so rows of different ages decode
    side by side and a step reads the narrowest span that holds the oldest active row's tokens
    (`PagedEngine.decode`). By hand: rows of 4, 2 and 3 tokens in 2 slots run over steps [0, 4), [0, 2) and
    [2, 5); the oldest active row holds 1, 2, 3, 4 tokens at steps 0-3, then 3 (the first row ended, the one that
    entered at step 2 is oldest). Spans of 3 and 4 columns of a 4-column cap (no prompt): steps read 3, 3, 3, 4,
    3 columns at widths 1, 1, 1, 1, 1/2: 0.75 x 3 + 1 + 0.5 x 0.75 = 3.625 full steps' worth (3.75 had every row
    started at step 0). The planner prices such a pool so (`Workload.aged_reads`), against the call at the whole
    cache."""
    import dataclasses

    from jaxrlhf.planner.cost import CostCache
    from jaxrlhf.planner.workload import _continuous_batch

    assert _continuous_batch((4, 2, 3), 1, 2, (4, 3), 0, 4) == pytest.approx((5.0, 4.5, 3.625))
    graph, models, wl, hw, p = _llama_async(gen_engine="continuous", gen_len_median=300, gen_len_sigma=1.0)
    call = next(c for c in graph.calls if c.kind == "generate")
    lay = p.calls[call.name].layout
    ways = lay.data * lay.fsdp
    whole, small = (dataclasses.replace(wl, gen_len=2048, gen_slots=k) for k in (None, ways))
    assert small.engine_pool(call, ways) < small.call_seqs(call) == whole.engine_pool(call, ways)
    assert small.decode_reads(call, ways) is None and small.aged_reads(call, ways) == (2048, 1024, 512)
    assert whole.aged_reads(call, ways) is None and whole.decode_reads(call, ways) == (2048, 1024, 512)
    cost = CostCache(models, small, hw).call(call, p.group_of(call.name), lay)
    assert 0 < cost.decode_context_share <= 1  # the call is priced at the whole cache, its steps scaled
    at_cap = CostCache(models, dataclasses.replace(small, gen_len_median=None), hw).call(
        call, p.group_of(call.name), lay)
    assert cost.parts["decode"] == pytest.approx(at_cap.parts["decode"])
    fractions = small.decode_fractions(call, ways, width_share=cost.decode_width_share,
                                       context_share=cost.decode_context_share)
    unscaled = small.decode_fractions(call, ways, width_share=cost.decode_width_share)
    assert all(f < u for f, u in zip(fractions, unscaled))


def test_a_streams_steps_read_by_its_oldest_active_row():
    """In a stream rows of several ages decode side by side, and a step reads the narrowest span that holds the
    oldest active row's tokens (`PagedEngine.step`). Ages by hand: rows of one shard over steps [0, 3), [0, 1),
    [2, 6), [3, 4) and of another over [4, 5): the oldest active row at steps 0-5 holds 1, 2, 3, 2 (the first row
    ended), 3, 4 tokens. With spans of 2 and 4 columns of a 4-column cap (no prompt), the eta = 0 stream above:
    batch 0's steps read 2, 2, 4 columns at widths 1, 1/2, 1/2 (1.25 full steps' worth), batch 1's one step 2."""
    from jaxrlhf.planner.workload import _oldest_ages, _stream_batches

    shards = ((np.array([0, 0, 2, 3]), np.array([3, 1, 6, 4])), (np.array([4]), np.array([5])))
    assert _oldest_ages(shards).tolist() == [1, 2, 3, 2, 3, 4]
    assert _stream_batches(((3, 1), (1, 1)), 2, 1, 2, 2, 1, 0, (4, 2), 0, 4) == ((3.0, 2.0, 1.25), (1.0, 1.0, 0.5))


def test_a_streaming_generator_has_no_tail():
    """Partial rollouts (`Workload.gen_stream`): the next batches' rows fill the pool where the last
    round's tail would run, so a batch costs its tokens over the pool, on an off-policy plan and on
    one whose generator waits for training alike (the stream runs ahead on both; only the first
    overlaps its decoding with training)."""
    import dataclasses

    from jaxrlhf.planner.cost import CostCache, generate_durations
    from jaxrlhf.planner.simulator import estimate_plan

    graph, models, wl, hw, p = _llama_async(gen_engine="continuous", gen_slots=4, gen_len_median=16,
                                            gen_len_sigma=1.0)
    streamed = dataclasses.replace(wl, gen_stream=True)
    call = next(c for c in graph.calls if c.kind == "generate")
    lay = p.calls[call.name].layout
    cost = CostCache(models, streamed, hw).call(call, p.group_of(call.name), lay)
    lengths = streamed.response_lengths(streamed.call_seqs(call))
    prefill = cost.parts["prefill"]
    durations = generate_durations(cost, streamed, call, lay.data * lay.fsdp, streamed=True)
    synchronous = generate_durations(cost, streamed, call, lay.data * lay.fsdp)
    # over the cycle, the stream decodes at least the tokens over the pool, and less than the batches
    # one at a time, each with its tail
    tokens = prefill + (cost.seconds - prefill) * lengths.sum(axis=1) / 4 / (4 * 512)
    assert sum(tokens) <= sum(durations) * (1 + 1e-9) and sum(durations) < sum(synchronous)
    assert p.offpolicy
    assert estimate_plan(p, graph, models, streamed, hw).step_s < estimate_plan(p, graph, models, wl, hw).step_s
    serial = dataclasses.replace(p, offpolicy=False, shadow_roles=())
    assert estimate_plan(serial, graph, models, streamed, hw).step_s < estimate_plan(serial, graph, models, wl, hw).step_s


def test_a_run_of_equal_gaps_is_not_mistaken_for_the_period_of_varying_calls():
    """Seven 2 s generate calls and one of 60 s (mean 9.25 s, plus the 0.5 s sync: 9.75 s per step on
    "lo", more than "hi"'s 6.5 s). Behind the short calls the trainer sets the pace, and three equal
    6.5 s gaps in a row looked like a period of 1 (6.5 s per step); periods of calls that cycle
    through 8 durations are multiples of 8. One step ahead, seven steps go at the trainer's 6.5 s and
    the long one at 60 + 0.5 s: 106 s per 8 steps."""
    p = plan(ASYNC, shadow_roles=("actor",), offpolicy=True)
    cycle = {**T, "actor.generate": (2.0,) * 7 + (60.0,)}
    times = {}
    for eta in (1, 2):
        tl = steady_state(G, p, cycle, {"actor.generate": 0.5}, staleness=eta)
        assert tl.period() == 8 and tl.step_s >= 9.75
        times[eta] = tl.step_s
    assert times[1] == pytest.approx((7 * 6.5 + 60.5) / 8) and times[2] < times[1]
