"""`algorithm.pack_sequences`: packed train and inference calls compute the unpacked math (the same
updates, log-probs, values, scores and statistics), the host packer lays sequences out as documented
and keeps its budget (a packed run on a context-parallel plan against an unpacked colocated one:
tests/models/test_context_parallel.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import build_algorithm, rollout
from jaxrlhf.algorithms.stats import RunningMoments
from jaxrlhf.algorithms.update import minibatch_indices
from jaxrlhf.models.config import preset
from jaxrlhf.models.packing import micro_batches, one_row_rule, pack_batch, size_bucket
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import build_model, positions_from_mask

B, P, N = 8, 4, 8
LENGTHS = np.array([5, 1, 3, 7, 2, 8, 6, 0])  # response tokens; the last row's response is empty


def _batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 300, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    mask[:3, 0] = False  # left padding in three prompts
    mask[5, :2] = False
    response_mask = np.arange(N)[None, :] < LENGTHS[:, None]
    mask[:, P:] = response_mask
    tokens = np.where(mask, tokens, 0)
    return {
        "tokens": tokens, "mask": mask, "positions": np.asarray(positions_from_mask(jnp.asarray(mask))),
        "response_tokens": tokens[:, P:], "response_mask": response_mask,
        "behaviour_logp": np.where(response_mask, -rng.uniform(1, 6, size=(B, N)), 0.0).astype(np.float32),
        "ended_with_eos": rng.uniform(size=B) > 0.3,
        "ref_logp": np.where(response_mask, -rng.uniform(1, 6, size=(B, N)), 0.0).astype(np.float32),
        "values": np.where(response_mask, rng.normal(size=(B, N)), 0.0).astype(np.float32),
        "rule_scores": rng.uniform(-1, 1, size=B).astype(np.float32),
    }


def test_size_buckets():
    assert [size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 25)] == [1, 1, 2, 3, 4, 6, 6, 8, 12, 16, 24, 32]


def test_a_packing_by_hand():
    # three sequences of 3, 2 and 4 real tokens, one shard
    mask = np.array([[0, 1, 1, 1, 0],    # prompt 2 (one pad), response 1
                     [0, 0, 1, 1, 0],    # prompt 1, response 1 ... and a second prompt pad
                     [1, 1, 1, 1, 0]], bool)
    tokens = np.arange(15, dtype=np.int32).reshape(3, 5) + 100
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    out, stats = pack_batch(mask, tokens, positions, 2, np.arange(3)[None], shards=1)
    # rows as wide as the batch (5), longest first: sequence 2 (4 tokens) alone, then 0 (3) and 1 (2)
    np.testing.assert_array_equal(out["tokens"][0, 0, 0], [[110, 111, 112, 113, 0], [101, 102, 103, 107, 108]])
    np.testing.assert_array_equal(out["segments"][0, 0, 0], [[1, 1, 1, 1, 0], [1, 1, 1, 2, 2]])
    np.testing.assert_array_equal(out["positions"][0, 0, 0], [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]])
    np.testing.assert_array_equal(out["slots"][0, 0, 0], [2, 0, 1])
    # padded prompt width 3: padded columns 2 and 3 predict response tokens 0 and 1; flat = row * 5 + column
    np.testing.assert_array_equal(out["read"][0, 0, 0], [[2, 3], [6, 7], [8, 9]])
    np.testing.assert_array_equal(out["last"][0, 0, 0], [3, 7, 9])
    # only the real response tokens are taken (each response's token 0), and where they sit in the grid
    np.testing.assert_array_equal(out["take"][0, 0, 0], [2, 6, 8])
    np.testing.assert_array_equal(out["take_from"][0, 0, 0], [0, 2, 4])
    assert (stats.real_tokens, stats.packed_tokens, stats.padded_tokens) == (9, 10, 15)


def test_micro_batches_keep_the_budget_and_balance_the_shards():
    rng = np.random.RandomState(1)
    lengths = np.clip(np.rint(20 * np.exp(rng.normal(size=64))), 2, 150).astype(np.int64)
    bins = micro_batches(lengths, range(64), 400)
    assert sorted(i for b in bins for i in b) == list(range(64))
    assert all(sum(lengths[i] for i in b) <= 400 for b in bins)
    assert len(bins) == size_bucket(len(bins))
    with pytest.raises(ValueError, match="exceeds the micro-batch budget"):
        micro_batches(lengths, range(64), 100)
    mask = np.arange(160)[None, :] < lengths[:, None]
    tokens = np.ones((64, 160), np.int32)
    out, _ = pack_batch(mask, tokens, np.zeros_like(tokens), 8, np.arange(64).reshape(2, 32), shards=4, budget=400)
    assert out["tokens"].shape[:3] == (4, 2, out["tokens"].shape[2])
    real = (out["segments"] > 0).sum(axis=(3, 4))  # [shards, updates, micro-batches]
    assert real.sum(axis=0).max() <= 400
    # shards of one micro-batch differ by at most one sequence's tokens (longest first onto the lightest)
    assert (real.max(axis=0) - real.min(axis=0)).max() <= lengths.max()
    filled = out["slots"] < 64
    assert sorted(out["slots"][filled]) == list(range(64))  # each sequence once per epoch


def test_sequences_go_longest_first_onto_the_lightest_bin_ties_to_the_lowest():
    """`_spread` keeps its documented rule on ties (many equal weights) and on empty bins, against the plain
    argmin over the bins' loads, which it replaced for speed (the planner packs every token budget it weighs)."""
    from jaxrlhf.models.packing import _spread

    def by_argmin(weights, items, bins):
        loads, out = np.zeros(bins, np.int64), [[] for _ in range(bins)]
        for i in sorted(items, key=lambda i: (-int(weights[i]), i)):
            b = int(np.argmin(loads))
            out[b].append(i)
            loads[b] += weights[i]
        return out

    rng = np.random.default_rng(0)
    for trial in range(500):
        n, bins = int(rng.integers(0, 40)), int(rng.integers(1, 10))
        weights = rng.integers(0, 4 if trial % 2 else 1000, size=n + 3)
        items = [int(i) for i in rng.permutation(n + 3)[:n]]
        assert _spread(weights, items, bins) == by_argmin(weights, items, bins), trial


def test_rows_are_first_fit_decreasing_and_the_planner_shapes_are_the_runtime_ones():
    """`_rows` (an array scan past FIRST_FIT_SCAN items) is the plain first-fit decreasing loop, and
    `packing_shape` (the planner's, which skips empty parts) gives `packing_layout`'s shapes."""
    from jaxrlhf.models.packing import _rows, packing_layout, packing_shape

    def first_fit(lengths, items, width):
        rows, free = [], []
        for i in sorted(items, key=lambda i: (-int(lengths[i]), i)):
            r = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
            if r is None:
                rows.append([i])
                free.append(width - int(lengths[i]))
            else:
                rows[r].append(i)
                free[r] -= int(lengths[i])
        return rows

    rng = np.random.default_rng(0)
    for trial in range(200):
        n, width = int(rng.integers(0, 300)), int(rng.integers(20, 200))
        lengths = rng.integers(1, width + 1, size=n)
        assert _rows(lengths, list(range(n)), width) == first_fit(lengths, range(n), width), trial
        if n % 2 or not n:
            continue
        updates, shards = np.arange(n).reshape(2, -1), int(rng.integers(1, 48))
        budget = None if trial % 3 == 0 else int(rng.integers(width, 6 * width))
        reads = rng.integers(0, 9, size=n)
        assert packing_shape(lengths, updates, shards, width, budget, reads=reads) == \
            packing_layout(lengths, updates, shards, width, budget, reads=reads)[1], trial


@pytest.fixture(scope="module")
def models():
    return (nnx.split(build_model(preset("tiny"), seed=0)), nnx.split(build_model(preset("tiny"), "value", seed=1)),
            nnx.split(build_model(preset("tiny"), "reward", seed=2)))


def _close(a, b, **tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.slow
@pytest.mark.parametrize("estimator, loss, agg, epochs", [  # seq-mean-token-mean: the pipelined test below
    ("gae", "ppo", "token-mean", 2),
    ("grpo", "grpo", "seq-mean-token-sum-norm", 1),  # Dr. GRPO counts rows: empty slots must not count
])
def test_packed_calls_equal_unpacked(models, estimator, loss, agg, epochs):
    (actor_def, actor), (critic_def, critic), (reward_def, reward) = models
    batch = _batch()
    unpacked = {k: jnp.asarray(v) for k, v in batch.items()}
    unpacked.update(kl_coef=jnp.float32(0.05), rng_actor=jax.random.key(3), rng_critic=jax.random.key(4),
                    value_moments=RunningMoments.create())
    packed = {k: v for k, v in unpacked.items() if k not in ("tokens", "mask", "positions")}

    def pack(key, shards):  # two data shards, a budget of 14 real tokens: several micro-batches per update
        updates = np.arange(B)[None] if key is None else np.asarray(minibatch_indices(key, B, 2, epochs))
        out, _ = pack_batch(batch["mask"], batch["tokens"], batch["positions"], N, updates, shards=shards, budget=14)
        assert out["slots"].shape[2] > 1
        return {k: jnp.asarray(v) for k, v in out.items()}

    packed.update(packed_inference=pack(None, 2), packed_actor=pack(unpacked["rng_actor"], 2),
                  packed_critic=pack(unpacked["rng_critic"], 4))
    sampling = SamplingParams(temperature=0.7)
    # the packed side builds its logits 3 positions a device at a time (`logit_chunks`), the unpacked side
    # all at once: chunks, like packing, change memory, not math
    chunks = {"unpacked": None, "packed": 3}
    logp = [rollout.policy_logprobs(actor_def, sampling, None, actor, x, logit_chunk=chunks[name])["ref_logp"]
            for name, x in (("unpacked", unpacked), ("packed", packed))]
    np.testing.assert_allclose(logp[1], logp[0], rtol=1e-5, atol=1e-5)
    scores = [rollout.reward_scores(reward_def, ("",), None, reward, x)["model_scores"] for x in (unpacked, packed)]
    np.testing.assert_allclose(scores[1], scores[0], rtol=1e-5, atol=1e-5)

    opt = optax.sgd(0.1)  # Adam would blow float-noise-sized gradients up to full-size steps
    s = rollout.RLSettings(estimator=estimator, loss=loss, loss_agg=agg, group_size=2, minibatches=2, epochs=epochs,
                           kl_in_reward=loss == "ppo", kl_in_loss=loss == "grpo",
                           kl_estimator="k3" if loss == "grpo" else "k1", max_new_tokens=N, entropy_coef=0.01)
    (p_ref, _, o_ref), (p_got, _, o_got) = (
        jax.jit(functools.partial(rollout.actor_train, actor_def, opt, dataclasses.replace(s, logit_chunk=chunks[name])))(
            actor, opt.init(actor), x) for name, x in (("unpacked", unpacked), ("packed", packed)))
    _close(p_got, p_ref, rtol=1e-5, atol=1e-6)
    for key, value in o_ref["actor_stats"].items():
        np.testing.assert_allclose(o_got["actor_stats"][key], value, rtol=2e-4, atol=1e-6, err_msg=key)
    if estimator == "gae":
        values = [rollout.critic_values(critic_def, None, critic, x)["values"] for x in (unpacked, packed)]
        np.testing.assert_allclose(values[1], values[0], rtol=1e-5, atol=1e-5)
        critic_fn = jax.jit(functools.partial(rollout.critic_train, critic_def, opt, s))
        (c_ref, _, co_ref), (c_got, _, co_got) = (critic_fn(critic, opt.init(critic), x) for x in (unpacked, packed))
        _close(c_got, c_ref, rtol=1e-5, atol=1e-6)
        _close(co_got, co_ref, rtol=2e-4, atol=1e-6)


def _config(*overrides):
    cfg = cfglib.load_config(None, ["model.actor.preset=tiny", "data.batch_size=4", "sft.steps=0", *overrides])
    cfglib.validate(cfg)
    return cfg


def test_the_graph_routes_calls_through_their_packings():
    graph = build_algorithm(_config("algorithm.name=ppo", "algorithm.pack_sequences=true",
                                    "generation.max_new_tokens=16", "rewards.model=true",
                                    "model.reward.init_from=actor")).graph()
    step = graph.node("pack_sequences")
    assert set(step.outputs) == {"packed_inference", "packed_actor", "packed_critic", "packing_stats"}
    assert set(step.shards_of) == {"ref.inference", "critic.inference", "reward.inference", "actor.train",
                                   "critic.train"}
    for call in ("ref.inference", "critic.inference", "reward.inference", "actor.train", "critic.train"):
        assert not {"tokens", "mask", "positions"} & set(graph[call].inputs), call
    assert "packed_actor" in graph["actor.train"].inputs and "packed_critic" in graph["critic.train"].inputs
    order = [n.name for n in graph.order()]
    assert order.index("trim_responses") < order.index("pack_sequences") < order.index("ref.inference")
    # ReMax scores its greedy baseline too: the reward call reads the padded batches, the others pack
    remax = build_algorithm(_config("algorithm.name=remax", "algorithm.pack_sequences=true",
                                    "rewards.model=true", "model.reward.init_from=actor")).graph()
    assert "tokens" in remax["reward.inference"].inputs and "packed_inference" in remax["ref.inference"].inputs


def test_a_packings_one_row_rule_reads_its_readers_models_and_the_plans_context_degrees():
    """`Algorithm.one_row`: the largest blockwise settings of the models reading a packing, none where one
    of them attends densely or the plan splits its rows over context devices (`Execution.contexts`)."""
    from jaxrlhf.planner.plan import DeviceGroup, Execution, ExecutionPlan, Layout, Placement

    alg = build_algorithm(_config("algorithm.name=ppo", "algorithm.pack_sequences=true"))
    tiny = preset("tiny")
    alg.model_configs = {"actor": tiny.replace(blockwise_attention_from=64, attention_block=16),
                         "ref": tiny.replace(blockwise_attention_from=128, attention_block=8),
                         "critic": tiny.replace(blockwise_attention_from=None)}
    alg.execution = Execution()
    assert alg.one_row(("actor.train",)) == (64, 16)
    assert alg.one_row(("actor.inference", "ref.inference")) == (128, 16)
    assert alg.one_row(("ref.inference", "critic.inference")) is None
    plan = ExecutionPlan("t", 4, {"all": DeviceGroup("all", 0, 4)},
                         {"actor.train": Placement("all", Layout(context=4)), "ref.inference": Placement("all", Layout(data=4))})
    alg.execution = plan.execution
    assert alg.execution.contexts == {"actor.train": 4}
    assert alg.one_row(("actor.train",)) is None and alg.one_row(("ref.inference",)) == (128, 8)


@pytest.mark.parametrize("algorithm, unpacked", [("ppo", []), ("grpo", ["algorithm.pack_sequences=false"]),
                                                ("dpo", ["algorithm.pack_sequences=false"])])
def test_a_token_budget_turns_packing_on_and_says_so(algorithm, unpacked, tmp_path, capsys):
    """A token budget means micro-batches sized in tokens: without packing (left out, or off in the file) it
    turns packing on with one line on stderr, which names the way back; a config that packs prints nothing."""
    path = tmp_path / "budget.yaml"
    path.write_text(f"algorithm:\n  name: {algorithm}\n  max_tokens_per_micro_batch: 512\n")
    cfg = cfglib.load_config(path, ["model.actor.preset=tiny", "data.batch_size=4", "sft.steps=0", *unpacked])
    assert cfg.algorithm.pack_sequences and cfg.algorithm.max_tokens_per_micro_batch == 512
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "note: algorithm.max_tokens_per_micro_batch=512 sizes micro-batches in tokens, so algorithm.pack_sequences "
        "is turned on (packed rows, the same math); for row micro-batches set algorithm.max_tokens_per_micro_batch=null"]
    cfglib.with_overrides(cfg, ["run.steps=3"])  # the resolved config packs: no second line
    _config("algorithm.pack_sequences=true", "algorithm.max_tokens_per_micro_batch=512")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.pack_sequences=true", "algorithm.micro_batch_size=2"], "instead of algorithm.micro_batch_size"),
    (["algorithm.max_tokens_per_micro_batch=512", "algorithm.micro_batch_size=2"],
     "instead of algorithm.micro_batch_size"),
    (["algorithm.pack_sequences=true", "algorithm.max_tokens_per_micro_batch=40", "data.max_prompt_len=32",
      "generation.max_new_tokens=16"], "set it to at least 48"),
])
def test_a_budget_that_cannot_apply_is_one_clear_line(overrides, needle):
    with pytest.raises(cfglib.ConfigError, match=needle):
        _config(*overrides)


def test_the_planner_prices_the_packing_the_runtime_makes():
    """`Workload.packed_shape` is the runtime packer's layout of the planner's drawn lengths, and a packed
    call of a long-tailed batch is priced (time and memory) below its padded form."""
    from jaxrlhf.graph import CallSpec
    from jaxrlhf.planner.cost import call_cost
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.memory import working_set
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.planner.workload import LENGTH_BATCHES, Workload

    wl = Workload(batch_size=64, prompt_len=16, gen_len=512, minibatches=4, gen_len_median=64, gen_len_sigma=1.0,
                  remat="none")
    packed = Workload(**{**wl.__dict__, "packed": True, "token_budget": 2048})
    train, infer = CallSpec("actor.train", "actor", "train"), CallSpec("ref.inference", "ref", "inference")
    lengths = wl.response_lengths(64) + 16
    updates = np.arange(64).reshape(4, 16)
    runtime = [pack_batch(np.arange(16 + 512)[None, :] < n[:, None], np.ones((64, 528), np.int32),
                          np.zeros((64, 528), np.int32), 512, updates, shards=2, budget=2048)[0]
               for n in lengths]
    runtime = [(*out["tokens"].shape, out["take"].shape[-1]) for out in runtime]
    shape, peak = packed.packed_shape(train, 2), packed.packed_peak(train, 2)
    assert len(runtime) == LENGTH_BATCHES
    # the priced shape is the runtime's over the draws: micro-batches, padded tokens, tokens x width (dense
    # attention) and the read positions the LM head runs over, each the draws' mean; the memory model's is
    # the largest micro-batch the runtime packs
    u, k, r, w, reads = (np.array([s[i] for s in runtime], np.float64) for i in (1, 2, 3, 4, 5))
    assert shape.updates == u[0] and shape.micro_batches == pytest.approx(k.mean())
    assert shape.tokens_per_shard == pytest.approx((u * k * r * w).mean())
    assert shape.tokens_per_shard * shape.width == pytest.approx((u * k * r * w * w).mean())
    assert shape.micro_batches * shape.reads == pytest.approx((k * reads).mean())
    assert (peak.rows * peak.width, peak.reads) == max(zip(r * w, reads))
    assert shape.reads < shape.slots * 512 / 4  # the real response tokens, not every slot's whole width
    hw, cfg = get_profile("cpu"), preset("small")
    group, layout = DeviceGroup("all", 0, 2), Layout(data=2)
    for call in (train, infer):
        cheaper = call_cost(call, cfg, group, layout, packed, hw).seconds / call_cost(call, cfg, group, layout, wl,
                                                                                     hw).seconds
        assert cheaper < 0.6, (call.name, cheaper)
        assert working_set(call, cfg, layout, packed)["activations"] < working_set(call, cfg, layout,
                                                                                   wl)["activations"] / 2


def test_the_planner_prices_a_shared_packing_as_the_runtime_lays_it_out():
    """The inference calls of a packed PPO step read one packing, which the runtime packs over the lcm of their
    batch ways (`rollout._pack_sequences`) by their joint one-row rule. On a plan that gives the reference 2 batch
    ways and the critic 4, the reference's devices each hold 2 of the packing's 4 shards, and a critic split over
    context devices keeps every reader's rows as wide as the batch: the planner prices those shapes
    (`knobs.shared_packings`), not each call's own packing."""
    from jaxrlhf.planner import knobs
    from jaxrlhf.planner.cost import CostCache
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
    from jaxrlhf.planner.workload import Workload

    graph = build_algorithm(_config("algorithm.name=ppo", "algorithm.pack_sequences=true")).graph()
    blockwise = preset("tiny").replace(blockwise_attention_from=64, attention_block=16)
    models = {r: blockwise for r in graph.roles}
    wl = Workload(batch_size=64, prompt_len=16, gen_len=512, minibatches=4, gen_len_median=64, gen_len_sigma=1.0,
                  remat="none", packed=True)
    ref, critic = graph["ref.inference"], graph["critic.inference"]

    def plan(critic_layout):
        calls = {c: Placement("all", Layout(data=4)) for c in graph.names}
        calls.update({"ref.inference": Placement("all", Layout(data=2, tensor=2)),
                      "critic.inference": Placement("all", critic_layout)})
        return ExecutionPlan("t", 4, {"all": DeviceGroup("all", 0, 4)}, calls)

    rule = one_row_rule([blockwise], [1])
    assert knobs.shared_packings(plan(Layout(data=4)), graph, models, wl) == {"ref.inference": (4, rule)}
    # the critic's context split takes one row from the reference too (its own shards and rule: left out)
    assert knobs.shared_packings(plan(Layout(data=2, context=2)), graph, models, wl) == {"ref.inference": (2, None)}
    # the runtime's packing of each drawn batch over 4 shards, 2 of them on each of the reference's devices
    runtime = []
    for n in wl.response_lengths(64) + 16:
        out = pack_batch(np.arange(16 + 512)[None, :] < n[:, None], np.ones((64, 528), np.int32),
                         np.zeros((64, 528), np.int32), 512, np.arange(64)[None], shards=4, blockwise=rule)[0]
        runtime.append((*out["tokens"].shape, out["take"].shape[-1]))
    s, k, r, w, reads = (np.array([x[i] for x in runtime], np.float64) for i in (0, 2, 3, 4, 5))
    priced = wl.for_call(ref, packing=(4, rule)).packed_shape(ref, 2, blockwise, 1)
    per_device = s / 2 * k * r * w
    assert priced.micro_batches * priced.rows * priced.width == pytest.approx(per_device.mean())
    assert priced.micro_batches * priced.reads == pytest.approx((s / 2 * k * reads).mean())
    # what the search prices: the reference's knobs carry the packing, its cost and memory read it
    cache = CostCache(models, wl, get_profile("h100"))
    chosen, _ = knobs.choose(plan(Layout(data=4)), graph, models, wl, get_profile("h100"), cache)
    assert chosen["ref.inference"].packing == (4, rule) and chosen["critic.inference"].packing is None
    assert cache.for_call(ref, chosen["ref.inference"]).packing == (4, rule)
    assert cache.for_call(critic, chosen["critic.inference"]).packing is None


def _grpo_update(agg: str):
    """The batch, its unpacked inputs, GRPO settings aggregating by `agg` over 2 minibatches, and SGD."""
    batch = _batch()
    unpacked = {k: jnp.asarray(v) for k, v in batch.items()}
    unpacked.update(kl_coef=jnp.float32(0.05), rng_actor=jax.random.key(3))
    s = rollout.RLSettings(estimator="grpo", loss="grpo", loss_agg=agg, group_size=2, minibatches=2,
                           max_new_tokens=N, kl_in_reward=False, kl_in_loss=True, kl_estimator="k3")
    return batch, unpacked, s, optax.sgd(0.1)


def test_one_row_where_it_holds_fewer_tokens_than_rows_as_wide_as_the_batch():
    """Blockwise readers (rows from 16 tokens, blocks of 8): a long-tailed part goes in one row of whole blocks
    (4 to 7 times a power of two); sequences of one length fill rows as wide as the batch exactly, which one
    row rounded to its blocks would not, so they keep them."""
    from jaxrlhf.models.packing import packing_shape, row_blocks

    assert [row_blocks(n) for n in (3, 5, 9, 15, 33)] == [3, 5, 10, 16, 40]
    tailed = np.array([30, 3, 4, 5, 2, 3, 4, 3])  # one shard, one update: 54 tokens
    one = packing_shape(tailed, np.arange(8)[None], 1, 30, blockwise=(16, 8))
    assert (one.rows, one.width) == (1, 56) and packing_shape(tailed, np.arange(8)[None], 1, 30).rows == 2  # 60
    even = np.full(4, 30)  # 120 tokens: four rows of 30; one row would be 16 blocks, 128
    assert packing_shape(even, np.arange(4)[None], 1, 30, blockwise=(16, 8)) == \
        packing_shape(even, np.arange(4)[None], 1, 30)


def test_one_row_packing_attending_blockwise_equals_unpacked():
    """A model that attends rows of 16 tokens and more blockwise (blocks of 8): each shard's part of the
    packing is one row a whole number of blocks wide (`packing.one_row_rule`), and the log-probs and one
    GRPO update from it equal the padded batch's."""
    cfg = preset("tiny").replace(blockwise_attention_from=16, attention_block=8)
    actor_def, actor = nnx.split(build_model(cfg, seed=0))
    batch, unpacked, s, opt = _grpo_update("token-mean")
    train_fn = jax.jit(functools.partial(rollout.actor_train, actor_def, opt, s))
    logp_fn = jax.jit(functools.partial(rollout.policy_logprobs, actor_def, SamplingParams(), None))
    want_params, _, want = train_fn(actor, opt.init(actor), unpacked)
    want_logp = logp_fn(actor, unpacked)["ref_logp"]

    one_row = one_row_rule([cfg])
    assert one_row == (16, 8) and one_row_rule([cfg], [2]) is None  # a context split keeps wide rows
    updates = np.asarray(minibatch_indices(unpacked["rng_actor"], B, 2, 1))
    pack = functools.partial(pack_batch, batch["mask"], batch["tokens"], batch["positions"], N, shards=2,
                             blockwise=one_row)
    packed_actor, packed_inference = pack(updates)[0], pack(np.arange(B)[None])[0]
    for packing in (packed_actor, packed_inference):
        rows, width = packing["tokens"].shape[-2:]
        assert rows == 1 and width % 8 == 0 and cfg.attends_blockwise(width)
    args = {k: v for k, v in unpacked.items() if k not in ("tokens", "mask", "positions")}
    got_logp = logp_fn(actor, {**args, "packed_inference": packed_inference})["ref_logp"]
    np.testing.assert_allclose(np.asarray(got_logp), np.asarray(want_logp), rtol=1e-5, atol=1e-5)
    got_params, _, got = train_fn(actor, opt.init(actor), {**args, "packed_actor": packed_actor})
    _close(got_params, want_params, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(got["actor_stats"]["loss/policy"], want["actor_stats"]["loss/policy"], rtol=2e-4,
                               atol=1e-6)


@pytest.mark.parametrize("layout", ["d2f2t1p2", "d4f1t2"])
def test_one_row_packing_on_a_placed_call_equals_unpacked(layout):
    """The one-row packing's log-probs on 8 devices, 2 pipeline stages or tensor-parallel heads (blockwise
    attention a `shard_map` per device under the stages' `vmap`), equal the padded batch's on one."""
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement

    cfg = preset("tiny").replace(blockwise_attention_from=16, attention_block=8)
    actor_def, actor = nnx.split(build_model(cfg, seed=0))
    batch, unpacked, _, _ = _grpo_update("token-mean")
    fn = functools.partial(rollout.policy_logprobs, actor_def, SamplingParams(), None)
    want = jax.jit(fn)(actor, unpacked)["ref_logp"]
    packed = {k: v for k, v in batch.items() if k not in ("tokens", "mask", "positions")}
    packed["packed_inference"] = pack_batch(batch["mask"], batch["tokens"], batch["positions"], N, np.arange(B)[None],
                                            shards=4, blockwise=one_row_rule([cfg]))[0]
    assert packed["packed_inference"]["tokens"].shape[-2] == 1
    plan = ExecutionPlan("t", 8, {"all": DeviceGroup("all", 0, 8)}, {"ref.inference": Placement("all", Layout.parse(layout))})
    cache = CallCache(plan)
    placed = cache.placed("ref.inference")
    params = jax.device_put(actor, placed.param_shardings(actor))
    args = {k: jax.tree_util.tree_map(lambda x: jax.device_put(
        x, placed.batch_sharding(np.ndim(x)) if np.ndim(x) else placed.replicated()), v) for k, v in packed.items()}
    got = cache.function("ref.inference", fn, in_shardings=None, out_shardings=None)(params, args)["ref_logp"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_packed_calls_under_a_pipeline_equal_unpacked_ones(models):
    """A 2-stage placement (data 2 x fsdp 2 per stage, 8 devices) runs a packed update's micro-batches as
    the pipeline's (one forward, `update.packed_micro_batch(k=None)`): the same update and log-probs."""
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement

    (actor_def, actor), _, _ = models
    batch, unpacked, s, opt = _grpo_update("seq-mean-token-mean")
    train_fn = functools.partial(rollout.actor_train, actor_def, opt, s)
    want_params, _, want = jax.jit(train_fn)(actor, opt.init(actor), unpacked)
    want_logp = rollout.policy_logprobs(actor_def, SamplingParams(), None, actor, unpacked)["ref_logp"]

    updates = np.asarray(minibatch_indices(unpacked["rng_actor"], B, 2, 1))
    packed = {k: v for k, v in batch.items() if k not in ("tokens", "mask", "positions")}
    packed.update(kl_coef=np.float32(0.05),
                  packed_actor=pack_batch(batch["mask"], batch["tokens"], batch["positions"], N, updates, shards=4,
                                          budget=14)[0],
                  packed_inference=pack_batch(batch["mask"], batch["tokens"], batch["positions"], N,
                                              np.arange(B)[None], shards=4, budget=14)[0])
    layout = Layout(stage=2, data=2, fsdp=2)
    for call, fn in (("actor.train", train_fn),
                     ("ref.inference", functools.partial(rollout.policy_logprobs, actor_def, SamplingParams(), None))):
        plan = ExecutionPlan("t", 8, {"all": DeviceGroup("all", 0, 8)}, {call: Placement("all", layout)})
        placed = CallCache(plan).placed(call)
        assert placed.stages == 2
        params = jax.device_put(actor, placed.param_shardings(actor))
        args = {k: jax.tree_util.tree_map(lambda x: jax.device_put(
            x, placed.batch_sharding(np.ndim(x)) if np.ndim(x) else placed.replicated()), v) for k, v in packed.items()}
        jitted = CallCache(plan).function(call, fn, in_shardings=None, out_shardings=None)
        if call == "actor.train":
            args["rng_actor"] = jax.device_put(unpacked["rng_actor"], placed.replicated())
            state = jax.jit(opt.init, out_shardings=placed.opt_state_shardings(opt, params))(params)
            got_params, _, got = jitted(params, state, args)
            _close(got_params, want_params, rtol=1e-5, atol=2e-6)
            for key in ("loss/policy", "entropy", "clipfrac", "grad_norm", "kl/loss"):
                np.testing.assert_allclose(got["actor_stats"][key], want["actor_stats"][key], rtol=2e-4, atol=1e-6)
        else:
            np.testing.assert_allclose(np.asarray(jitted(params, args)["ref_logp"]), want_logp, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_packed_dpo_equals_unpacked(models, kind="ipo"):
    """The reference's summed log-probs and one IPO update (it reads both the sums and the response
    lengths: every packed quantity DPO's loss takes) from packed pairs, each pair kept in one of
    several budgeted micro-batches on two shards, equal the padded pair batch's."""
    from jaxrlhf.algorithms import dpo

    (actor_def, actor), _, _ = models
    rng = np.random.RandomState(3)
    b, length = 6, 12
    pairs = {}
    for side in ("chosen", "rejected"):
        real = rng.randint(5, length + 1, size=b)
        mask = np.arange(length)[None, :] >= (length - real)[:, None]  # left-padded
        loss_mask = mask & (np.arange(length)[None, :] >= length - rng.randint(1, 4, size=b)[:, None])
        pairs.update({f"{side}_tokens": np.where(mask, rng.randint(3, 300, size=(b, length)), 0).astype(np.int32),
                      f"{side}_mask": mask, f"{side}_loss_mask": loss_mask})
    shards = {"ref.inference": 2, "actor.train": 2}
    runtime = type("R", (), {"execution": type("E", (), {"token_budget": 30}),  # the plan's budget (b08ee03)
                             "one_row": lambda self, readers: None})()  # the tiny model attends densely
    packed = dpo.DPORuntime._pack_pairs(runtime, pairs["chosen_tokens"], pairs["chosen_mask"],
                                        pairs["rejected_tokens"], pairs["rejected_mask"], shards)
    assert packed["packed_pairs"]["slots"].shape[2] > 1  # several micro-batches
    unpacked = {k: jnp.asarray(v) for k, v in pairs.items()}
    ref = [dpo.ref_pair_logprobs(actor_def, None, actor, unpacked),
           dpo.packed_pair_logprobs(actor_def, actor, {**unpacked, "packed_pairs": packed["packed_pairs"]})]
    for name in ("ref_chosen_logp", "ref_rejected_logp"):
        np.testing.assert_allclose(ref[1][name], ref[0][name], rtol=1e-5, atol=1e-4)
    opt = optax.sgd(0.1)
    train = jax.jit(functools.partial(dpo.dpo_train, actor_def, opt, 0.1, 0.0, kind, None))
    inputs = {**unpacked, "ref_chosen_logp": ref[0]["ref_chosen_logp"] - 0.3,
              "ref_rejected_logp": ref[0]["ref_rejected_logp"] + 0.2, "rng_actor": jax.random.key(0)}
    (p_ref, _, o_ref), (p_got, _, o_got) = (
        train(actor, opt.init(actor), x) for x in (inputs, {**inputs, "packed_pairs": packed["packed_pairs"]}))
    _close(p_got, p_ref, rtol=1e-5, atol=1e-6)
    for key, value in o_ref["actor_stats"].items():
        np.testing.assert_allclose(o_got["actor_stats"][key], value, rtol=2e-4, atol=1e-6, err_msg=key)
