"""Continuous-batching engine: same greedy tokens and log-probs as the static engine on mixed lengths,
shared-prefix groups, log-probs equal to a training forward, seeds reproducible across slot counts and
page-pool sizes (a pool too small preempts rows and recomputes them: same result)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import generation as gen
from jaxrlhf.models import slots as sz
from jaxrlhf.models.config import preset
from jaxrlhf.models.continuous import continuous_fn, generate_continuous, kv_cache_bytes, kv_column_bytes
from jaxrlhf.models.engines import GENERATION_ENGINES
from jaxrlhf.models.sampling import GREEDY, SamplingParams
from jaxrlhf.models.slots import pool_size
from jaxrlhf.models.transformer import build_model

PROMPTS = [[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75]]
G = 2
N = 12
LIMITS = [3, 9, 1, 12, 5, 7]  # per-row response caps: a batch of mixed lengths


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)


def _grouped(prompts, g):
    tokens, mask = gen.pad_prompts([p for p in prompts for _ in range(g)], 0)
    return jnp.asarray(tokens), jnp.asarray(mask)


def _static(model, tokens, mask, sampling=GREEDY, rng=0, **kw):
    graphdef, state = nnx.split(model)
    return gen.generate_tokens(graphdef, state, tokens, mask, jax.random.key(rng), max_new_tokens=N,
                               sampling=sampling, pad_id=0, **kw)


def _continuous(model, tokens, mask, sampling=GREEDY, rng=0, n=N, **kw):
    graphdef, state = nnx.split(model)
    return continuous_fn(graphdef, state, tokens, mask, jax.random.key(rng), max_new_tokens=n,
                         sampling=sampling, pad_id=0, **kw)


def _assert_same(a, b):
    for name in ("tokens", "prompt_mask", "response_tokens", "response_mask", "lengths", "ended_with_eos"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("slots", [1, 4])
def test_greedy_equals_static_engine_on_mixed_lengths(model, slots):
    """Rows of lengths 1..12 (per-row caps) through pools smaller than the batch, with shared prefixes."""
    tokens, mask = _grouped(PROMPTS, G)
    limits = jnp.asarray(LIMITS, jnp.int32)
    ref = _static(model, tokens, mask, eos_id=None, max_lengths=limits)
    assert ref.lengths.tolist() == LIMITS
    _assert_same(_continuous(model, tokens, mask, eos_id=None, group_size=G, slots=slots, max_lengths=limits), ref)


@pytest.mark.slow
def test_a_large_pool_steps_past_an_eighth_of_its_width_and_equals_the_static_engine(model):
    """A 128-row pool (widths down to 8 rows, `slots.step_widths`) with one long row among short ones: its tail
    runs 8 wide, past 1/8 of the pool, and the greedy tokens and log-probs equal the static engine's."""
    assert sz.step_widths(128)[-1] == 8
    tokens, mask = _grouped(PROMPTS[:2] * 8, 8)  # 128 rows: 16 prompts x 8 samples
    limits = jnp.asarray([N if r == 5 else 1 + r % 3 for r in range(128)], jnp.int32)
    ref = _static(model, tokens, mask, eos_id=None, max_lengths=limits)
    _assert_same(_continuous(model, tokens, mask, eos_id=None, group_size=8, max_lengths=limits), ref)


@pytest.mark.slow
def test_eos_ends_rows_like_the_static_engine(model):
    """EOS ids taken from the greedy output end rows at different steps; lengths, masks, EOS flags agree."""
    tokens, mask = _grouped(PROMPTS, 1)
    free = _static(model, tokens, mask, eos_id=None)
    eos = (int(free.response_tokens[0, 2]), int(free.response_tokens[2, 6]))
    ref = _static(model, tokens, mask, eos_id=eos)
    assert len(set(ref.lengths.tolist())) > 1 and bool(ref.ended_with_eos.any())
    _assert_same(_continuous(model, tokens, mask, eos_id=eos, slots=1), ref)


@pytest.mark.slow
def test_shared_prefix_equals_prefilling_every_row(model):
    """group_size=G prefills each prompt once; the result equals prefilling all G copies (group_size=1)."""
    tokens, mask = _grouped(PROMPTS, 4)
    sampling = SamplingParams(temperature=0.8, top_k=50)
    shared = _continuous(model, tokens, mask, sampling, rng=3, eos_id=None, group_size=4, slots=3)
    every = _continuous(model, tokens, mask, sampling, rng=3, eos_id=None, group_size=1, slots=12)
    _assert_same(shared, every)
    # the G samples of one prompt differ (per-row keys), and a seed reproduces them
    assert len({tuple(r) for r in np.asarray(shared.response_tokens[:4]).tolist()}) > 1
    _assert_same(_continuous(model, tokens, mask, sampling, rng=3, eos_id=None, group_size=4, slots=3), shared)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)])
def test_logprobs_equal_training_forward_recomputation(model, sampling):
    tokens, mask = _grouped(PROMPTS, G)
    out = _continuous(model, tokens, mask, sampling, rng=1, eos_id=None, group_size=G, slots=2,
                      max_lengths=jnp.asarray(LIMITS, jnp.int32))
    recomputed = gen.recompute_logprobs(model, out, sampling)
    np.testing.assert_allclose(np.asarray(recomputed), np.asarray(out.logprobs), atol=2e-5)
    assert out.lengths.tolist() == LIMITS


@pytest.mark.slow
def test_compiles_once_per_shape(model):
    """New prompts, limits and keys of the same shapes reuse the program: entering a slot is data."""
    tokens, mask = _grouped(PROMPTS, G)
    _continuous(model, tokens, mask, eos_id=None, group_size=G, slots=2, max_lengths=jnp.asarray(LIMITS))
    before = gen.trace_count("continuous")
    other = jnp.where(mask, (tokens * 7) % 300, 0)
    _continuous(model, other, mask, rng=5, eos_id=None, group_size=G, slots=2, max_lengths=jnp.asarray(LIMITS[::-1]))
    assert gen.trace_count("continuous") == before


def test_a_batch_that_is_not_whole_groups_is_an_error(model):
    tokens, mask = _grouped(PROMPTS, 1)
    with pytest.raises(ValueError, match="group_size=2"):
        _continuous(model, tokens, mask, eos_id=None, group_size=2)


@pytest.mark.slow
def test_a_pool_too_small_preempts_and_recomputes_to_the_same_result(model):
    """40 new tokens span 3 pages of 16; a pool of 3 response pages holds one such row while 4 slots want
    pages: younger rows are preempted mid-response and restart later. Greedy equals the static engine and
    a sampled run equals the same seed with a pool that never preempts (keys are per row and token)."""
    n = 40
    tokens, mask = _grouped(PROMPTS, G)
    limits = jnp.asarray([40, 33, 17, 40, 2, 25], jnp.int32)
    graphdef, state = nnx.split(model)
    ref = gen.generate_tokens(graphdef, state, tokens, mask, jax.random.key(0), max_new_tokens=n, sampling=GREEDY,
                              eos_id=None, pad_id=0, max_lengths=limits)
    tight = _continuous(model, tokens, mask, n=n, eos_id=None, group_size=G, slots=4, kv_pages=3, max_lengths=limits)
    _assert_same(tight, ref)
    assert int(tight.kv_pages_used) == 3
    sampling = SamplingParams(temperature=0.9, top_k=40)
    roomy = _continuous(model, tokens, mask, sampling, rng=2, n=n, eos_id=None, group_size=G, max_lengths=limits)
    _assert_same(_continuous(model, tokens, mask, sampling, rng=2, n=n, eos_id=None, group_size=G, slots=4,
                             kv_pages=3, max_lengths=limits), roomy)
    # the default pool holds every slot's full response (6 x 3 pages); what is used follows the generated
    # tokens. A row of L tokens stores keys/values of its first L - 1 (the last is sampled, never fed): at
    # the step that feeds token 16, the rows of 40, 33, 40 and 25 tokens hold 2 pages each (the rows of
    # 17 and 2 have ended), the most at any step
    assert int(roomy.kv_pages_used) == 8


def test_a_pool_smaller_than_one_response_is_an_error(model):
    tokens, mask = _grouped(PROMPTS, 1)
    with pytest.raises(ValueError, match="generation.kv_pages=2 .* at least 3"):
        _continuous(model, tokens, mask, n=40, eos_id=None, kv_pages=2)


def test_pool_size_and_cache_bytes():
    assert pool_size(64, None) == 64 and pool_size(64, 5, batch_ways=4) == 8 and pool_size(6, 10) == 6
    assert sz.page_size(256) == 16 and sz.page_size(8) == 8 and sz.pages_per_row(256, 500) == (16, 32)
    assert sz.shard_group(64, 8, 8) == 8 and sz.shard_group(16, 4, 8) == 2
    assert sz.step_widths(64) == (64, 32, 16, 8) and sz.step_widths(3) == (3, 2, 1)
    # a large pool's long tail: halves on down to 8 rows, at most 1/128 of the pool
    assert sz.step_widths(1024) == (1024, 512, 256, 128, 64, 32, 16, 8)
    assert sz.step_widths(8192)[-1] == 64 and sz.step_widths(100) == (100, 50, 25, 13)
    cfg = preset("tiny")
    per_column = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * np.dtype(cfg.dtype).itemsize
    assert kv_column_bytes(cfg) == per_column
    # hand count: static 64 rows x (256 + 512), plus the 8 prompts' rows they are copied from when G = 8;
    # continuous: the prefill's 8 prompts x 256, and the pool of those 8 x 16 prompt pages + 64 slots x 32
    # response pages (default) or 512 pages, of 16 tokens
    assert kv_cache_bytes(cfg, 64, 256, 512, engine="static") == 64 * 768 * per_column
    assert kv_cache_bytes(cfg, 64, 256, 512, engine="static", group_size=8) == (64 + 8) * 768 * per_column
    assert kv_cache_bytes(cfg, 64, 256, 512, engine="continuous", group_size=8) == (
        8 * 256 + 8 * 256 + 64 * 32 * 16) * per_column
    assert kv_cache_bytes(cfg, 64, 256, 512, engine="continuous", group_size=8, kv_pages=512, batch_ways=4) == (
        8 * 256 + 8 * 256 + 512 * 16) * per_column


def test_engine_registry_matches_the_config_schema():
    import typing

    from jaxrlhf.config_schema import GenerationConfig

    hints = typing.get_type_hints(GenerationConfig)
    assert set(typing.get_args(hints["engine"])) == set(GENERATION_ENGINES)


@pytest.mark.slow
def test_a_sharded_batch_pads_the_prompts_and_rounds_the_slots(model):
    """Under an 8-way batch sharding, 4 distinct prompts are padded to 8 and 3 slots become 8: same result."""
    from jaxrlhf.models import axes as ax
    from jaxrlhf.placement.layout import activation_resolver, make_mesh
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    tokens, mask = _grouped([*PROMPTS, [1, 90, 91]], 4)
    limits = jnp.asarray(LIMITS + LIMITS[:4] + LIMITS, jnp.int32)
    ref = _continuous(model, tokens, mask, eos_id=None, group_size=4, slots=3, max_lengths=limits)
    graphdef, state = nnx.split(model)

    @jax.jit
    def sharded(state, tokens, mask, limits):
        return generate_continuous(graphdef, state, tokens, mask, jax.random.key(0), max_new_tokens=N,
                                   sampling=GREEDY, eos_id=None, pad_id=0, group_size=4, slots=3, max_lengths=limits)

    with ax.activation_sharding(activation_resolver(make_mesh(DeviceGroup("g", 0, 8), Layout(data=8)))):
        assert ax.batch_ways() == 8
        out = sharded(state, tokens, mask, limits)
    _assert_same(out, ref)


@pytest.mark.slow
def test_steps_read_only_the_columns_their_rows_filled(model, monkeypatch, spans_read):
    """Under a cap of several reads (`slots.read_columns`, here with one page as the narrowest), each step reads
    the narrowest span of response columns that holds every active row's tokens: the same greedy tokens as the
    static engine (which reads the whole cache), with refills and preemption, and the narrow reads do run."""
    monkeypatch.setattr(sz, "MIN_READ", sz.PAGE_SIZE)
    n = 44  # a shape no other test traces: the engine is built with these reads
    assert sz.read_columns(n, sz.PAGE_SIZE) == (44, 32, 16)
    reads = spans_read
    tokens, mask = _grouped(PROMPTS, G)
    limits = jnp.asarray([44, 30, 17, 44, 2, 25], jnp.int32)
    graphdef, state = nnx.split(model)
    ref = gen.generate_tokens(graphdef, state, tokens, mask, jax.random.key(0), max_new_tokens=n, sampling=GREEDY,
                              eos_id=None, pad_id=0, max_lengths=limits)
    _assert_same(_continuous(model, tokens, mask, n=n, eos_id=None, group_size=G, max_lengths=limits), ref)
    # every row starts at once: steps 1-16 read 16 columns, 17-32 read 32, the rest 44
    assert reads[:16] == [16] * 16 and reads[16:32] == [32] * 16 and set(reads[32:]) == {44}
    reads.clear()
    _assert_same(_continuous(model, tokens, mask, n=n, eos_id=None, group_size=G, slots=4, kv_pages=3,
                             max_lengths=limits), ref)
    assert set(reads) == {16, 32, 44}  # refills and restarts after preemption read from the narrowest again
