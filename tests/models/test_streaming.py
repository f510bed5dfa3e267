"""Streaming engine: prompts admitted in waves, decoded in chunks of a few steps and taken as groups
finish give exactly `generate_continuous`'s tokens and log-probs per (uid, sample) (keys per uid and
sample; a page pool small enough to preempt); weights changed between chunks continue the rows in flight
on their KV cache and tag the new tokens with the new version (checked against a dense-cache decode
that switches models at the same token); admission and take bookkeeping; one program per shape."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import axes as ax
from jaxrlhf.models import generation as gen
from jaxrlhf.models import streaming as sm
from jaxrlhf.models.config import preset
from jaxrlhf.models.continuous import continuous_fn
from jaxrlhf.models.sampling import GREEDY, SamplingParams, sample
from jaxrlhf.models.transformer import build_model

# prompts by uid: up to 8 tokens, so the prompt bucket is 8 and pages hold 8 tokens (12 new tokens span 2)
PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64, 65], [1, 70, 71], [1, 80, 81, 82, 83]]
CAPS = [12, 5, 9, 12, 3]  # per prompt: a cap on each of its responses
G, N, BUCKET = 2, 12, 8
SAMPLED = SamplingParams(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)


def _spec(sampling, eos_id, ways=1):
    # 4 group slots of 2 rows, 3 decode slots, 3 response pages of 8 tokens (one 12-token response needs
    # 2): rows wait for a slot, and a row that crosses into its second page preempts the youngest. Over
    # 2 batch shards: 2 group slots, 2 decode slots and 2 pages each
    return sm.StreamSpec.make(groups=4, group_size=G, max_new_tokens=N, prompt_bucket=BUCKET, sampling=sampling,
                              eos_id=eos_id, pad_id=0, slots=3, kv_pages=3, batch_ways=ways)


def _sharded(ways):
    """The batch axis sharded over `ways` of the 8 simulated devices (nothing for 1)."""
    if ways == 1:
        return contextlib.nullcontext()
    from jaxrlhf.placement.layout import activation_resolver, make_mesh
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    return ax.activation_sharding(activation_resolver(make_mesh(DeviceGroup("g", 0, ways), Layout(data=ways))))


def _prompt_arrays(uids):
    tokens, mask = gen.pad_prompts([PROMPTS[u] if u >= 0 else [0] for u in uids], 0, min_bucket=BUCKET)
    return jnp.asarray(tokens), jnp.asarray(mask)


def _admit(graphdef, params, state, uids, rng, spec, version=0):
    tokens, mask = _prompt_arrays(uids)
    caps = jnp.asarray([CAPS[u] if u >= 0 else N for u in uids], jnp.int32)
    return sm.admit_fn(graphdef, params, state, tokens, mask, jnp.asarray(uids, jnp.int32), rng, spec=spec,
                       version=version, max_lengths=caps, tag=spec.batch_ways)


def _reference(model, rng, sampling, eos_id):
    """generate_continuous on every prompt at once, row uid * G + j = sample j of prompt uid."""
    tokens, mask = gen.pad_prompts([p for p in PROMPTS for _ in range(G)], 0, min_bucket=BUCKET)
    graphdef, state = nnx.split(model)
    return continuous_fn(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), rng, max_new_tokens=N,
                         sampling=sampling, eos_id=eos_id, pad_id=0, group_size=G, min_bucket=BUCKET,
                         max_lengths=jnp.repeat(jnp.asarray(CAPS, jnp.int32), G))


def _stream_in_waves(graphdef, params, spec, rng):
    """Prompts admitted 2 per call (the first wave into 2 of the 4 group slots), 3 decode steps per run,
    done groups taken after every run; returns the final state and every take."""
    state = sm.init(graphdef, params, spec=spec)
    queue = [3, 0, 4, 1, 2]
    state, accepted = _admit(graphdef, params, state, [queue.pop(0), queue.pop(0)], rng, spec)
    assert np.asarray(accepted).tolist() == [True, True]
    taken, calls, traces = [], 0, None
    while queue or sum(len(t.uids) for t in taken) < len(PROMPTS):
        steps = int(state.steps)
        state = sm.run_fn(graphdef, params, state, spec=spec, version=0, max_steps=3, until_done_groups=1,
                          tag=spec.batch_ways)  # a compile cache per sharding resolver
        assert 0 < int(state.steps) - steps <= 3
        calls += 1
        out, state = sm.take(state, spec=spec, tag=spec.batch_ways)
        taken.append(out)
        wave = [queue.pop(0) if queue else -1 for _ in range(2)]  # a blank (uid -1) keeps k = 2
        fits = sm.free_groups(state)
        state, accepted = _admit(graphdef, params, state, wave, rng, spec)
        accepted = np.asarray(accepted).tolist()
        assert accepted == [u >= 0 and k < fits for k, u in enumerate(wave)], (wave, fits, accepted)
        queue = [u for u, a in zip(wave, accepted) if u >= 0 and not a] + queue  # refused: admit later
        if traces is None:
            traces = {k: gen.trace_count(k) for k in ("stream_run", "stream_admit", "stream_release")}
        assert calls < 40
    assert {k: gen.trace_count(k) for k in traces} == traces  # every later call reused its program
    return state, taken


@pytest.mark.slow
@pytest.mark.parametrize("ways", [1, 2])
def test_waves_and_chunks_equal_generating_all_prompts_at_once(model, ways):
    """Admitted in waves (2 of 4 group slots first, in a shuffled uid order, blanks padding the admit
    call), decoded 3 steps per call, taken as groups finish: every (uid, j) row equals the one-call
    engine's, with caps, EOS ends and preemption; each group is taken once; one program per shape. Also
    with the batch sharded 2 ways (each shard its own group slots, decode slots and pages)."""
    rng = jax.random.key(7)
    free = _reference(model, rng, SAMPLED, None)
    eos = int(np.asarray(free.response_tokens)[0, 2])  # a token sampled early in some row: ends rows by EOS
    ref = _reference(model, rng, SAMPLED, eos)
    assert bool(np.asarray(ref.ended_with_eos).any()) and not bool(np.asarray(ref.ended_with_eos).all())
    graphdef, params = nnx.split(model)
    with _sharded(ways):
        state, taken = _stream_in_waves(graphdef, params, _spec(SAMPLED, eos, ways), rng)
    uids = np.concatenate([t.uids for t in taken])
    assert sorted(uids.tolist()) == list(range(len(PROMPTS)))  # every group taken exactly once
    # the pool ran full and rows were preempted (the slots want up to twice the pages) and recomputed
    assert int(state.kv_pages_used) == (3 if ways == 1 else 4)
    assert int(state.rows["preempted"].sum()) > 0
    assert len(state.pool[0].sharding.device_set) == ways  # the pool's shard axis lives on `ways` devices
    for t in taken:
        for k, u in enumerate(t.uids):
            got, want = slice(k * G, (k + 1) * G), slice(u * G, (u + 1) * G)
            for name in ("response_tokens", "response_mask", "lengths", "ended_with_eos", "prompt_tokens"):
                np.testing.assert_array_equal(getattr(t.output, name)[got], np.asarray(getattr(ref, name))[want],
                                              err_msg=f"{name} uid {u}")
            np.testing.assert_allclose(t.output.logprobs[got], np.asarray(ref.logprobs)[want], atol=1e-5)
            mask = t.output.response_mask[got]
            assert (t.versions[got][mask] == 0).all() and (t.versions[got][~mask] == -1).all()
    lengths = np.concatenate([t.output.lengths for t in taken])
    assert lengths.min() < lengths.max() <= N


@pytest.mark.slow
def test_a_streams_steps_read_by_its_oldest_row_and_give_the_same_rows(model, monkeypatch, spans_read):
    """With narrow spans of response columns in use (`slots.read_columns`, one page as the narrowest; a 20-token
    cap: spans 8, 16, 20) each stream step reads the span that holds its oldest active row's tokens: rows admitted
    in waves and decoded in chunks still equal the one-call engine's, and the narrow spans run."""
    import sys

    from jaxrlhf.models import slots as sz

    here = sys.modules[__name__]
    monkeypatch.setattr(sz, "MIN_READ", BUCKET)
    monkeypatch.setattr(here, "N", 20)  # a shape no other test traces: the engines are built with these spans
    monkeypatch.setattr(here, "CAPS", [20, 5, 9, 12, 3])
    assert sz.read_columns(20, BUCKET) == (20, 16, 8)
    reads = spans_read
    rng = jax.random.key(7)
    ref = _reference(model, rng, SAMPLED, None)
    graphdef, params = nnx.split(model)
    reads.clear()
    _, taken = _stream_in_waves(graphdef, params, _spec(SAMPLED, None), rng)
    assert {8, 16} <= set(reads)
    for t in taken:
        for k, u in enumerate(t.uids):
            got, want = slice(k * G, (k + 1) * G), slice(u * G, (u + 1) * G)
            for name in ("response_tokens", "response_mask", "lengths"):
                np.testing.assert_array_equal(getattr(t.output, name)[got], np.asarray(getattr(ref, name))[want],
                                              err_msg=f"{name} uid {u}")
            np.testing.assert_allclose(t.output.logprobs[got], np.asarray(ref.logprobs)[want], atol=1e-5)


def _dense_decode(model_a, model_b, prompt, versions):
    """Greedy decode of one prompt with a dense KV cache: token i is sampled from the logits of the model
    of its `versions[i]` (token 0 from model A's prefill), and the forward feeding token i-1 (which writes
    its keys/values) runs that model too: the continuation a partial rollout computes, independently."""
    ga, sa = nnx.split(model_a)
    _, sb = nnx.split(model_b)
    tokens, mask = gen.pad_prompts([prompt], 0, min_bucket=BUCKET)
    _, p_mask, logits, cache = gen.prefill_fn(ga, sa, jnp.asarray(tokens), jnp.asarray(mask), bucket=BUCKET,
                                                  max_new_tokens=N, pad_id=0)

    @jax.jit
    def step(params, token, position, cache):
        out, cache = nnx.merge(ga, params)(token[None, None], position[None, None], jnp.ones((1, 1), bool), cache)
        return out[:, 0], cache

    out, logps = [], []
    position = int(p_mask.sum())
    for i, v in enumerate(versions):
        if i:
            logits, cache = step(sa if v == 0 else sb, jnp.int32(out[-1]), jnp.int32(position + i - 1), cache)
        token, logp = sample(jax.random.key(0), logits, GREEDY)
        out.append(int(token[0]))
        logps.append(float(logp[0]))
    return out, logps


@pytest.mark.slow
def test_weights_changed_between_chunks_continue_rows_on_their_cache(model):
    """Greedy: 3 prompts run 4 steps on model A (version 0), then to the end on model B (version 1): each
    row's tokens before the change are A's greedy continuation, those after it B's given that prefix on
    the kept KV cache (a dense decode that switches models at the same token); versions say which."""
    model_b = build_model(preset("tiny"), seed=1)
    spec = _spec(GREEDY, None)
    graphdef, params = nnx.split(model)
    _, params_b = nnx.split(model_b)
    rng = jax.random.key(0)
    state = sm.init(graphdef, params, spec=spec)
    state, _ = _admit(graphdef, params, state, [0, 2], rng, spec)
    state, _ = _admit(graphdef, params, state, [3, -1], rng, spec)
    state = sm.run_fn(graphdef, params, state, spec=spec, version=0, max_steps=4, until_done_groups=3)
    early, state = sm.take(state, spec=spec)
    traces = gen.trace_count("stream_run")
    state = sm.run_fn(graphdef, params_b, state, spec=spec, version=1, max_steps=100, until_done_groups=3)
    assert gen.trace_count("stream_run") == traces  # new weights, version and step budget: same program
    late, state = sm.take(state, spec=spec)
    assert sm.free_groups(state) == 4
    a_only = gen.generate_tokens(graphdef, params, *_prompt_arrays(list(range(len(PROMPTS)))), rng,
                                 max_new_tokens=N, sampling=GREEDY, eos_id=None, pad_id=0, min_bucket=BUCKET,
                                 max_lengths=jnp.asarray(CAPS, jnp.int32))
    changed = 0
    for t in (early, late):
        for k, u in enumerate(t.uids):
            for j in range(G):
                r = k * G + j
                length = int(t.output.lengths[r])
                versions = t.versions[r, :length].tolist()
                assert length == CAPS[u] and sorted(versions) == versions and -1 not in versions
                tokens, logps = _dense_decode(model, model_b, PROMPTS[u], versions)
                np.testing.assert_array_equal(t.output.response_tokens[r, :length], tokens, err_msg=f"uid {u}")
                np.testing.assert_allclose(t.output.logprobs[r, :length], logps, atol=1e-5)
                before = versions.count(0)
                np.testing.assert_array_equal(tokens[:before], np.asarray(a_only.response_tokens)[u, :before])
                changed += before < length
    assert changed > 0 and late.versions.max() == 1 and early.uids.tolist() == []


@pytest.mark.slow
def test_a_full_pool_refuses_admission_and_take_frees_only_done_groups(model):
    spec = _spec(GREEDY, None)
    graphdef, params = nnx.split(model)
    rng = jax.random.key(0)
    state = sm.init(graphdef, params, spec=spec)
    state, a = _admit(graphdef, params, state, [0, 1], rng, spec)
    state, b = _admit(graphdef, params, state, [2, 3], rng, spec)
    state, c = _admit(graphdef, params, state, [4, -1], rng, spec)
    assert np.asarray(a).tolist() == [True, True] == np.asarray(b).tolist()
    assert np.asarray(c).tolist() == [False, False] and sm.free_groups(state) == 0  # full: 4 is refused
    nothing, state = sm.take(state, spec=spec)  # none done yet
    assert nothing.uids.tolist() == [] and nothing.output.response_tokens.shape == (0, N)
    state = sm.run_fn(graphdef, params, state, spec=spec, version=0, max_steps=100, until_done_groups=1)
    assert int((state.status == sm.GROUP_DONE).sum()) >= 1
    out, state = sm.take(state, spec=spec)
    assert len(out.uids) >= 1 and set(out.uids.tolist()) <= {0, 1, 2, 3}
    assert sm.free_groups(state) == len(out.uids)
    state, c = _admit(graphdef, params, state, [4, -1], rng, spec)
    assert np.asarray(c).tolist() == [True, False]


def test_a_wide_prompt_or_uneven_shards_is_an_error(model):
    spec = _spec(GREEDY, None)
    graphdef, params = nnx.split(model)
    state = sm.init(graphdef, params, spec=spec)
    tokens, mask = gen.pad_prompts([list(range(1, 12))], 0, min_bucket=BUCKET)
    with pytest.raises(ValueError, match="prompt_bucket 8"):
        sm.admit(graphdef, params, state, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray([0]),
                 jax.random.key(0), spec=spec)
    with pytest.raises(ValueError, match="4 group slots do not split into batch_ways=3"):
        sm.init(graphdef, params, spec=_spec(GREEDY, None, ways=3))
