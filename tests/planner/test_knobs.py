"""The memory knobs (micro-batches, remat) the planner chooses with the placement, and what the run does
with them (planner/knobs.py, ExecutionPlan.execution)."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import declare
from jaxrlhf.models.config import preset
from jaxrlhf.plan import main
from jaxrlhf.planner import knobs
from jaxrlhf.planner.cost import CostCache
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, PlanError
from jaxrlhf.planner.presets import build_plan
from jaxrlhf.planner.simulator import estimate_plan
from jaxrlhf.planner.workload import AUTO, Workload
from jaxrlhf.testing.graphs import ppo_graph

H100 = get_profile("h100")
GRAPH = ppo_graph()
MODELS = {r: preset("llama2-70b") for r in GRAPH.roles}
# ReaLHF's 70B setup on 64 H100, its longest generation: 128 rows of 128 + 896 tokens, 4 minibatches
WL = Workload.from_tokens(2**17, 128, 896, micro_batch=AUTO, remat=AUTO)


def test_unset_keys_are_the_planners_and_set_keys_stay():
    free = declare(cfglib.load_config(None, ["algorithm.name=ppo"])).workload()
    assert free.micro_batch == AUTO and free.remat_setting("actor") == free.remat_setting("critic") == AUTO
    assert free.remat_for("actor") == "none"  # priced as the fastest until chosen
    fixed = declare(cfglib.load_config(None, ["algorithm.name=ppo", "algorithm.micro_batch_size=4",
                                              "model.actor.remat=dots"])).workload()
    assert fixed.micro_batch == 4 and fixed.remat_setting("actor") == "dots"
    assert fixed.remat_setting("critic") == AUTO


def test_a_train_calls_options_form_a_time_memory_front():
    """A free train call weighs remat none / dots / full times every micro-batch count dividing its rows on a
    device; its front runs fastest first, each next option needing less memory. A fixed key is the only
    option; generation has none."""
    train, generate = GRAPH["actor.train"], GRAPH["actor.generate"]
    layout, group = Layout(data=8, tensor=8), DeviceGroup("all", 0, 64)
    per_device = WL.call_batch("train") // layout.batch_ways  # 32 / 8 = 4 rows
    opts = knobs.options(train, layout, WL)
    assert {k.remat for k in opts} == {"none", "dots", "full"}
    assert sorted({k.micro for k in opts}) == [m for m in range(1, per_device + 1) if per_device % m == 0]
    cache = CostCache(MODELS, WL, H100)
    front = knobs.front(train, group, layout, WL, cache)
    seconds = [cache.call(train, group, layout, k).seconds for k in front]
    work = [knobs.working_bytes(train, MODELS["actor"], layout, WL, k) for k in front]
    assert len(front) > 2 and front[0] == knobs.CallKnobs(1, "none")
    assert seconds == sorted(seconds) and all(a > b for a, b in zip(work, work[1:]))
    assert knobs.options(generate, layout, WL) == [knobs.CallKnobs()]
    fixed = dataclasses.replace(WL, micro_batch=8, remat="full")
    assert knobs.options(train, layout, fixed) == [knobs.CallKnobs()]


def test_each_call_gets_the_fastest_knobs_that_let_the_plan_fit():
    """The colocated 4 x 70B plan on 64 H100: with the fastest knobs (one micro-batch, no remat) it is over
    memory; the chooser steps the calls that overflow until it fits, and no call is leaner than needed:
    every call that could be one option faster makes the plan overflow."""
    plan = build_plan("colocated", 64, MODELS, GRAPH, batch_size=WL.batch_size, devices_per_host=8)
    cache = CostCache(MODELS, WL, H100)
    chosen, mem = knobs.choose(plan, GRAPH, MODELS, WL, H100, cache)
    assert mem.feasible
    fronts = {c.name: knobs.front(c, plan.group_of(c.name), plan.calls[c.name].layout, WL, cache) for c in GRAPH.calls}
    fastest = {c: f[0] for c, f in fronts.items()}
    from jaxrlhf.planner.memory import plan_memory

    assert not plan_memory(plan, GRAPH, MODELS, WL, H100, cache.memory, fastest).feasible
    assert any(chosen[c] != fastest[c] for c in chosen)
    assert chosen["actor.generate"] == knobs.CallKnobs()
    stepped = {c: fronts[c].index(k) for c, k in chosen.items()}
    for c, i in stepped.items():
        if i:
            faster = dict(chosen, **{c: fronts[c][i - 1]})
            assert not plan_memory(plan, GRAPH, MODELS, WL, H100, cache.memory, faster).feasible
    # the estimate prices every call under its chosen knobs and the plan says what they are
    est = estimate_plan(plan, GRAPH, MODELS, WL, H100, cache=cache)
    assert est.feasible and est.knobs == chosen
    written = knobs.with_knobs(plan, GRAPH, WL, chosen)
    assert set(written.remat) == {"actor", "critic"}
    for call, rows in written.micro_batch_size.items():
        count = chosen[call].micro
        assert count > 1 and rows * count == WL.call_batch(GRAPH[call].kind)


def test_a_fixed_micro_batch_that_a_layout_cannot_split_is_not_priced():
    """One row per micro-batch on a layout splitting the batch 8 ways would leave devices a fraction of a row:
    the runtime cannot run it, so the planner neither prices nor searches it."""
    wl = dataclasses.replace(WL, micro_batch=1)
    train = GRAPH["actor.train"]
    assert wl.micro_misfit(train, 8) and "algorithm.micro_batch_size" in wl.micro_misfit(train, 8)
    assert wl.micro_misfit(train, 1) is None and dataclasses.replace(WL, micro_batch=8).micro_misfit(train, 8) is None
    plan = build_plan("colocated", 64, MODELS, GRAPH, batch_size=wl.batch_size, devices_per_host=8)
    est = estimate_plan(plan, GRAPH, MODELS, wl, H100)
    assert not est.feasible and "do not split over" in est.reason


def test_a_plan_file_carries_its_knobs():
    plan = ExecutionPlan.from_yaml("""
num_devices: 2
groups: {all: {start: 0, size: 2}}
calls:
  actor.generate: {group: all, data: 2}
  actor.train: {group: all, data: 2}
micro_batch_size: {actor.train: 4}
remat: {actor: full}
""")
    assert plan.execution.micro_batch("actor.train") == 4 and plan.execution.micro_batch("actor.generate") is None
    assert plan.execution.remat_of("actor") == "full" and plan.execution.remat_of("ref") == "none"
    assert ExecutionPlan.from_yaml(plan.to_yaml()) == plan
    assert "remat actor full" in plan.table() and "4 rows (actor.train)" in plan.table()
    for bad, key in (("micro_batch_size: {actor.train: 0}", "micro_batch_size"), ("remat: {actor: most}", "remat")):
        text = plan.to_yaml().replace("micro_batch_size:\n  actor.train: 4", "").replace("remat:\n  actor: full", "")
        with pytest.raises(PlanError, match=f"plan.{key} must"):
            ExecutionPlan.from_yaml(text + bad + "\n")


QUESTION = ["--model-preset", "llama2-70b", "--hardware", "h100", "--devices", "64", "--gen-len", "896",
            "--prompt-len", "128", "--batch", "128", "--evaluations", "600", "--json"]


def test_70b_ppo_on_64_h100_plans_without_a_hand_set_knob(tmp_path, capsys):
    """The question that said "no plan fits" until the search chose micro-batches and remat itself: 3 x 70B
    PPO, 896-token responses, 64 H100. The plan carries the knobs; a key the user sets is kept."""
    assert main([*QUESTION, "--out", str(tmp_path / "free")]) == 0
    plan = ExecutionPlan.load(str(tmp_path / "free" / "plan.yaml"))
    assert set(plan.remat) == {"actor", "critic"} and plan.micro_batch_size
    assert main([*QUESTION, "--out", str(tmp_path / "set"), "model.actor.remat=full",
                 "algorithm.micro_batch_size=8"]) == 0
    plan = ExecutionPlan.load(str(tmp_path / "set" / "plan.yaml"))
    assert plan.remat["actor"] == "full"
    for call, rows in plan.micro_batch_size.items():
        assert rows == 8 and 8 % plan.calls[call].layout.batch_ways == 0


def test_70b_ppo_on_32_h100_plans_with_optimizer_state_in_host_memory(tmp_path):
    """Llama-2-70B PPO (actor, critic, reference) on 32 H100: no setting of the knobs fits (each trained role's
    optimizer state is 26 GB a device even split over all 32), so the search parks optimizer state in host memory
    between train calls, and the plan says so."""
    assert main(["--model-preset", "llama2-70b", "--hardware", "h100", "--devices", "32", "--gen-len", "896",
                 "--prompt-len", "128", "--batch", "128", "--evaluations", "300", "--out", str(tmp_path)]) == 0
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.offload_optimizer and set(plan.offload_optimizer) <= {"actor", "critic"}


def test_a_preset_whose_first_setting_does_not_fit_is_tuned_to_one_that_does(tmp_path):
    """The 70B question with remat off and 32-row micro-batches set by hand: the verl preset's first layouts
    cannot split 32 rows over their devices, so its tuning started from a plan with no step time and raised a
    TypeError from deep in the planner. It now keeps any setting that fits, and the question plans."""
    assert main([*QUESTION[:-1], "--evaluations", "300", "--out", str(tmp_path), "model.actor.remat=none",
                 "model.critic.remat=none", "algorithm.micro_batch_size=32"]) == 0
    presets = json.loads((tmp_path / "report.json").read_text())["presets"]
    assert presets["verl"]["step_s"] and "do not split" in presets["colocated"]["reason"]


def test_no_plan_fits_names_the_smallest_shortfall(capsys):
    rc = main(["--model-preset", "llama2-70b", "--hardware", "h100", "--devices", "16", "--gen-len", "896",
               "--prompt-len", "128", "--batch", "128", "--evaluations", "300", "--out", "/nonexistent/never"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "no plan fits on 16 x h100: the closest (" in err and "GiB over on its fullest device" in err
    assert "it would fit on devices of" in err


def test_no_plan_fits_with_the_static_engine_names_the_continuous_engine_and_its_plan(capsys, tmp_path):
    """GRPO with Gemma-3-4B on 16 v5e chips (16 GB): the static engine decodes all 512 rows at once, and their KV
    cache does not fit beside the weights on any layout. The search cannot change the engine (the run executes the
    one its config names), so the error says generation is what overflows and what the continuous engine's plan
    would be; with that key set, the planner sizes its pool and plans."""
    question = ["--model-preset", "gemma3-4b", "--hardware", "tpu-v5e", "--devices", "16", "--algorithm", "grpo",
                "--gen-len", "2048", "--prompt-len", "512", "--batch", "64", "--evaluations", "300"]
    assert main([*question, "--out", str(tmp_path / "static")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "largest call actor.generate" in err
    assert "generation is what overflows" in err and err.rstrip().endswith("set generation.engine=continuous")
    assert main([*question, "--out", str(tmp_path / "continuous"), "generation.engine=continuous"]) == 0
    plan = ExecutionPlan.load(str(tmp_path / "continuous" / "plan.yaml"))
    assert f"a pool of {plan.gen_slots} rows decoding at once" in err and plan.gen_slots < 512


def test_70b_generates_on_32_gb_tpu_v4_chips_with_tensor_parallelism_over_two_hosts(tmp_path):
    """Llama-2-70B PPO with a reward model on a v4-512 slice: at most 4 ways of tensor parallelism (one host's
    chips) a device holds 35 GB of the actor's weights to generate, more than a 32 GB v4 chip, and the planner
    said "no plan fits". A slice's hosts share its ICI torus, so generation splits 8 ways over two hosts."""
    assert main(["--model-preset", "llama2-70b", "--hardware", "tpu-v4", "--devices", "512", "--algorithm", "ppo",
                 "--gen-len", "512", "--prompt-len", "512", "--batch", "512", "rewards.model=true",
                 "--evaluations", "300", "--out", str(tmp_path)]) == 0
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.calls["actor.generate"].layout.tensor == 8
    # the generic presets generate 8 ways too; verl and the heuristic keep a GPU node's rule (one host)
    presets = json.loads((tmp_path / "report.json").read_text())["presets"]
    assert all(presets[p]["step_s"] for p in ("colocated", "interleaved", "disaggregated", "reallocated"))
    assert presets["verl"]["step_s"] is None and "does not fit" in presets["verl"]["reason"]


@pytest.mark.slow
def test_the_same_question_gets_the_same_plan_on_a_loaded_machine(tmp_path):
    """The search's budget is plans evaluated, not seconds: the same command twice, the second while two
    busy processes load both cores, prints the same plan and the same times (all but the search's own
    seconds)."""
    def plan(out: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "jaxrlhf.plan", *QUESTION[:-3], "--evaluations", "1500",
                               "--json", "--out", str(tmp_path / out)], capture_output=True, text=True, check=True)
        answer = json.loads(done.stdout)
        answer.pop("search_s"), answer.pop("out")
        return answer

    quiet = plan("quiet")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = plan("loaded")
    finally:
        for h in hogs:
            h.kill()
    assert loaded == quiet
    assert (tmp_path / "quiet" / "plan.yaml").read_text() == (tmp_path / "loaded" / "plan.yaml").read_text()


def test_the_continuous_engines_pool_is_a_knob_where_its_kv_cache_does_not_fit():
    """Every row decoding at once (the default pool) holds every row's KV cache; where that does not fit, the
    planner halves the pool (fewer rows at once, more rounds: vLLM's max_num_seqs) until it does. The plan
    says how many rows run at once and the run's engine takes it."""
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.planner.plan import Execution

    models = {r: preset("llama3-8b") for r in ("actor", "ref")}
    graph = declare(cfglib.load_config(None, ["algorithm.name=grpo", "algorithm.group_size=8"])).graph()
    wl = Workload(batch_size=512, prompt_len=128, gen_len=4096, minibatches=4, gen_engine="continuous",
                  gen_slots=AUTO, gen_group=8, micro_batch=AUTO, remat=AUTO)
    generate = graph["actor.generate"]
    layout = Layout(data=8)
    pools = [k.slots for k in knobs.options(generate, layout, wl)]
    assert pools[0] == 512 and all(a == 2 * b for a, b in zip(pools, pools[1:])) and pools[-1] >= 8
    plan = build_plan("colocated", 8, models, graph, batch_size=wl.batch_size, devices_per_host=8)
    plan = dataclasses.replace(plan, calls={**plan.calls, "actor.generate": dataclasses.replace(
        plan.calls["actor.generate"], layout=layout)})
    cache = CostCache(models, wl, H100)
    chosen, mem = knobs.choose(plan, graph, models, wl, H100, cache)
    assert mem.feasible and chosen["actor.generate"].slots < 512  # 64 rows x 4k tokens a device do not fit
    written = knobs.with_knobs(plan, graph, wl, chosen)
    assert written.gen_slots == chosen["actor.generate"].slots and written.execution.gen_slots == written.gen_slots
    # the run executes the plan's pool, and a re-plan keeps the running plan's knobs
    assert knobs.fixed_by(written, wl).gen_slots == written.gen_slots
    assert knobs.fixed_by(written, wl).micro_batch == written.micro_batch_size
    algorithm = build_algorithm(cfglib.load_config(None, ["algorithm.name=grpo", "generation.engine=continuous"]))
    algorithm.execution = Execution(gen_slots=16)
    assert algorithm.settings().slots == 16


def _held_by_brute_force(lengths, ways: int, slots: int, page: int) -> int:
    """The most response pages a shard's rows hold at once, stepping the engine token by token: rows enter
    free slots in order, a row with k tokens holds ceil(k / page) pages and frees them when it ends."""
    most = 0
    for shard in np.asarray(lengths).reshape(ways, -1):
        waiting, active = list(shard), []  # active: [tokens so far, length]
        while waiting or active:
            while waiting and len(active) < slots:
                active.append([0, waiting.pop(0)])
            for row in active:
                row[0] += 1
            most = max(most, sum(-(-k // page) for k, _ in active))
            active = [row for row in active if row[0] < row[1]]
    return most


def test_the_page_pool_is_sized_to_the_tokens_rows_hold():
    """`generation.kv_pages` unset: the planner sizes the continuous engine's page pool to the most pages its
    rows hold at once on the drawn lengths (stepped here token by token; the planner counts them to within a
    page a row), with a quarter to spare, not a full
    response per slot; memory shrinks, the time does not move, the plan carries the pool and the run's engine
    takes it. With every response at the cap, or the key set, the pool is as before."""
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.models.slots import page_size
    from jaxrlhf.planner.plan import Execution
    from jaxrlhf.planner.workload import KV_PAGE_MARGIN, LENGTH_BATCHES

    graph = declare(cfglib.load_config(None, ["algorithm.name=grpo", "algorithm.group_size=8"])).graph()
    generate = graph["actor.generate"]
    small = Workload(batch_size=64, prompt_len=32, gen_len=256, gen_engine="continuous", gen_slots=8, gen_group=8,
                     gen_pages=AUTO, gen_len_median=40, gen_len_sigma=1.0)
    held = max(_held_by_brute_force(batch, 2, 4, page_size(32)) for batch in small.response_lengths(64))
    sized = small.held_pages(generate, 2) / 2  # per shard; counted to within a page a decoding row (4 slots)
    assert np.ceil(held * KV_PAGE_MARGIN) <= sized <= np.ceil((held + 4) * KV_PAGE_MARGIN) < 4 * 256 // 16
    assert LENGTH_BATCHES == len(small.response_lengths(64))

    models = {r: preset("llama3-8b") for r in ("actor", "ref")}
    wl = Workload(batch_size=512, prompt_len=128, gen_len=4096, minibatches=4, gen_engine="continuous",
                  gen_slots=AUTO, gen_group=8, micro_batch=AUTO, remat=AUTO, gen_pages=AUTO,
                  gen_len_median=512, gen_len_sigma=1.0)
    plan = build_plan("colocated", 8, models, graph, batch_size=wl.batch_size, devices_per_host=8)
    cache = CostCache(models, wl, H100)
    chosen, mem = knobs.choose(plan, graph, models, wl, H100, cache)
    written = knobs.with_knobs(plan, graph, wl, chosen)
    ways = plan.calls["actor.generate"].layout.batch_ways
    full = knobs.fixed_by(dataclasses.replace(written, gen_pages=None), dataclasses.replace(wl, gen_pages=None))
    sized = knobs.fixed_by(written, wl)
    assert written.gen_pages == sized.kv_pages(generate, ways) == wl.for_call(
        generate, slots=written.gen_slots).held_pages(generate, ways) is not None
    assert written.gen_pages < written.gen_slots * 4096 // 16  # fewer than a full response per slot
    assert sized.generate_kv_columns(generate, ways) < full.generate_kv_columns(generate, ways) / 3
    assert ExecutionPlan.from_yaml(written.to_yaml()) == written and f"{written.gen_pages} KV pages" in written.table()
    est, est_full = (estimate_plan(written, graph, models, w, H100) for w in (sized, full))
    assert est.calls["actor.generate"].seconds == est_full.calls["actor.generate"].seconds
    assert dataclasses.replace(wl, gen_len_median=None).held_pages(generate, ways) is None  # every row to the cap
    assert knobs.with_knobs(plan, graph, dataclasses.replace(wl, gen_pages=64), chosen).gen_pages == 64
    algorithm = build_algorithm(cfglib.load_config(None, ["algorithm.name=grpo", "generation.engine=continuous"]))
    algorithm.execution = Execution(gen_pages=48)
    assert algorithm.settings().kv_pages == 48
