"""KV-cache generation: cached decode vs full forwards, HF parity, log-prob consistency, padding, EOS, buckets."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import generation as gen
from jaxrlhf.models.config import preset
from jaxrlhf.models.sampling import GREEDY, SamplingParams, entropy, process_logits, token_logprobs
from jaxrlhf.models.transformer import build_model, positions_from_mask

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50], [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76]]
NO_EOS = -1  # generate(..., eos_id=-1) never stops early


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def greedy_out(model):
    return gen.generate(model, PROMPTS, 12, GREEDY, eos_id=NO_EOS)


@functools.partial(jax.jit, static_argnums=0)
def _next_token(graphdef, state, tokens, length):
    """argmax after `tokens[:, :length]`: a full causal forward, no cache; the right padding is never attended."""
    model = nnx.merge(graphdef, state)
    mask = jnp.arange(tokens.shape[1])[None] < length
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    return jnp.argmax(logits[0, length - 1])


def _full_forward_argmax(model, prompt: list[int], n: int) -> list[int]:
    """Reference decoding: no cache, no left padding, one full forward per new token."""
    graphdef, state = nnx.split(model)
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, : len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        tokens[0, t] = int(_next_token(graphdef, state, jnp.asarray(tokens), t))
    return tokens[0, len(prompt) : len(prompt) + n].tolist()


@pytest.mark.slow
def test_greedy_cached_decode_equals_full_forward_argmax(model, greedy_out):
    for row, prompt in enumerate(PROMPTS):
        assert greedy_out.response_tokens[row].tolist() == _full_forward_argmax(model, prompt, 12)
    assert bool(greedy_out.response_mask.all())
    assert greedy_out.lengths.tolist() == [12, 12, 12]
    assert not bool(greedy_out.ended_with_eos.any())


@pytest.mark.slow
def test_output_layout(greedy_out):
    out = greedy_out
    p = out.prompt_length
    assert p == 32  # longest prompt (18) bucketed to a power of two
    assert out.tokens.shape == (3, p + 12)
    np.testing.assert_array_equal(out.tokens[:, p:], out.response_tokens)
    for row, prompt in enumerate(PROMPTS):  # left padded: the prompt ends right before the response
        assert out.tokens[row, p - len(prompt):p].tolist() == prompt
        assert int(out.prompt_mask[row].sum()) == len(prompt)
        assert not bool(out.prompt_mask[row, : p - len(prompt)].any())


@pytest.mark.slow
def test_left_padding_does_not_change_unpadded_results(model, greedy_out):
    for row, prompt in enumerate(PROMPTS):
        alone = gen.generate(model, [prompt], 12, GREEDY, eos_id=NO_EOS)
        assert alone.response_tokens[0].tolist() == greedy_out.response_tokens[row].tolist()
        np.testing.assert_allclose(alone.logprobs[0], greedy_out.logprobs[row], atol=1e-5)


def test_right_padded_array_input_is_left_aligned(model, greedy_out):
    width = max(len(p) for p in PROMPTS)
    tokens = np.zeros((len(PROMPTS), width), np.int32)
    mask = np.zeros((len(PROMPTS), width), bool)
    for row, p in enumerate(PROMPTS):
        tokens[row, : len(p)] = p
        mask[row, : len(p)] = True
    out = gen.generate(model, tokens, 12, GREEDY, eos_id=NO_EOS, prompt_mask=mask)
    np.testing.assert_array_equal(out.response_tokens, greedy_out.response_tokens)
    np.testing.assert_array_equal(out.prompt_tokens, greedy_out.prompt_tokens)


SETTINGS = [
    SamplingParams(temperature=1.3, top_k=8),
    SamplingParams(top_p=0.6),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
    SamplingParams(temperature=0.5, top_k=5, greedy=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SETTINGS, ids=str)
def test_logprobs_equal_training_forward_recomputation(model, sampling):
    out = gen.generate(model, PROMPTS, 10, sampling, rng=7, eos_id=NO_EOS)
    lp = out.logprobs
    assert bool(jnp.isfinite(lp).all())  # every sampled token lies inside the kept set
    recomputed = gen.recompute_logprobs(model, out, sampling)
    np.testing.assert_allclose(recomputed, lp, atol=1e-5, rtol=0)


def test_group_prompt_is_prefilled_once_with_the_same_results(model):
    """group_size=G prefills each group's prompt once and copies its cache to the G rows: the same
    sampled tokens and log-probs as prefilling every row, and groups that do not tile the batch are an error."""
    graphdef, state = nnx.split(model)
    tokens, mask = gen.pad_prompts([p for p in PROMPTS[:2] for _ in range(4)], 0)  # 2 prompts x G = 4
    sampling = SamplingParams(temperature=1.0)

    def run(group_size):
        return jax.jit(lambda s: gen.generate_tokens(
            graphdef, s, tokens, mask, jax.random.key(5), max_new_tokens=8, sampling=sampling, eos_id=NO_EOS,
            pad_id=0, group_size=group_size))(state)

    once, every = run(4), run(1)
    np.testing.assert_array_equal(once.tokens, every.tokens)
    np.testing.assert_allclose(once.logprobs, every.logprobs, atol=1e-6, rtol=0)
    assert not np.array_equal(np.asarray(once.response_tokens[0]), np.asarray(once.response_tokens[1]))  # G samples
    with pytest.raises(ValueError, match="not made of groups of group_size=3"):
        run(3)


def test_sampling_uses_the_rng(model):
    a = gen.generate(model, PROMPTS, 10, SETTINGS[1], rng=1, eos_id=NO_EOS)
    b = gen.generate(model, PROMPTS, 10, SETTINGS[1], rng=1, eos_id=NO_EOS)
    c = gen.generate(model, PROMPTS, 10, SETTINGS[1], rng=2, eos_id=NO_EOS)
    np.testing.assert_array_equal(a.response_tokens, b.response_tokens)
    assert not np.array_equal(np.asarray(a.response_tokens), np.asarray(c.response_tokens))


@pytest.mark.slow
def test_eos_stops_the_row_and_masks_the_rest(model, greedy_out):
    # Use the token that row 0 emits at step 4 as EOS: row 0 must stop right there.
    eos = int(greedy_out.response_tokens[0, 4])
    out = gen.generate(model, PROMPTS, 12, GREEDY, eos_id=eos, pad_id=0)
    ref = np.asarray(greedy_out.response_tokens)
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(ref[row] == eos)
        n = int(hits[0]) + 1 if hits.size else 12
        assert int(out.lengths[row]) == n
        assert bool(out.ended_with_eos[row]) == bool(hits.size)
        assert out.response_tokens[row, :n].tolist() == ref[row, :n].tolist()
        assert out.response_tokens[row, n:].tolist() == [0] * (12 - n)
        assert out.response_mask[row].tolist() == [True] * n + [False] * (12 - n)
        assert out.logprobs[row, n:].tolist() == [0.0] * (12 - n)
        np.testing.assert_allclose(out.logprobs[row, :n], greedy_out.logprobs[row, :n], atol=1e-5)
    assert int(out.lengths[0]) <= 5


def test_all_rows_stopped_exits_early(model, greedy_out):
    eos = int(greedy_out.response_tokens[1, 0])  # row 1 stops after one token
    out = gen.generate(model, [PROMPTS[1]], 12, GREEDY, eos_id=eos)
    assert out.lengths.tolist() == [1]
    assert out.response_tokens[0, 1:].tolist() == [0] * 11


@pytest.mark.slow
def test_any_of_several_eos_ids_stops_the_row(model, greedy_out):
    """Llama 3.1 lists three EOS ids: a row ends on whichever comes first, here the second id."""
    ref = np.asarray(greedy_out.response_tokens)
    second = int(ref[0, 4])
    unused = next(t for t in range(3, 384) if t not in ref)  # the primary EOS never comes
    n = int(np.flatnonzero(ref[0] == second)[0]) + 1
    out = gen.generate(model, PROMPTS, 12, GREEDY, eos_id=(unused, second))
    assert int(out.lengths[0]) == n <= 5 and bool(out.ended_with_eos[0])
    assert out.response_tokens[0, :n].tolist() == ref[0, :n].tolist()
    # The same from the model's own config: eos_token_id plus extra_eos_token_ids.
    config = preset("tiny").replace(eos_token_id=unused, extra_eos_token_ids=(second,))
    assert config.eos_token_ids == (unused, second)
    same_weights = build_model(config, seed=0)
    by_config = gen.generate(same_weights, PROMPTS, 12, GREEDY)
    np.testing.assert_array_equal(by_config.response_tokens, out.response_tokens)
    np.testing.assert_array_equal(by_config.ended_with_eos, out.ended_with_eos)
    generator, state = gen.Generator.for_model(same_weights)
    assert generator.eos_ids == (unused, second)
    # Reward shaping's own test of "ended with EOS" agrees, for every EOS id.
    from jaxrlhf.algorithms.rewards import sequence_ended_with_eos

    ended = sequence_ended_with_eos(out.response_tokens, out.response_mask, (unused, second))
    np.testing.assert_array_equal(ended, out.ended_with_eos)
    assert not bool(sequence_ended_with_eos(out.response_tokens, out.response_mask, unused)[0])


def test_eos_tuple():
    assert gen.eos_tuple(None) == gen.eos_tuple(-1) == gen.eos_tuple([]) == ()
    assert gen.eos_tuple(5) == gen.eos_tuple(np.int32(5)) == (5,)
    assert gen.eos_tuple([7, 5, 7, -1]) == (7, 5)


@pytest.mark.slow
def test_generating_past_max_positions_is_an_error():
    """Positions count real tokens only: a 20-token prompt (bucket 32) + 20 new fits 40 positions, + 21 does not."""
    model = build_model(preset("tiny").replace(max_position_embeddings=40), seed=0)
    prompt = [[1] + list(range(10, 29))]
    out = gen.generate(model, prompt, 20, GREEDY, eos_id=NO_EOS)
    assert out.prompt_length == 32 and out.lengths.tolist() == [20]
    with pytest.raises(gen.GenerationError, match=r"20 tokens \+ max_new_tokens 21 = 41 exceeds .* 40"):
        gen.generate(model, prompt, 21, GREEDY, eos_id=NO_EOS)
    # A device array: its width bounds the prompt (no host copy); generate_tokens (the rollout's call) the same.
    tokens, mask = gen.pad_prompts(prompt, 0, min_bucket=24)
    with pytest.raises(gen.GenerationError, match="24 tokens"):
        gen.generate(model, jnp.asarray(tokens), 20, GREEDY, prompt_mask=jnp.asarray(mask), eos_id=NO_EOS)
    graphdef, state = nnx.split(model)
    with pytest.raises(gen.GenerationError, match="max_position_embeddings 40"):
        jax.jit(lambda s, t, m: gen.generate_tokens(
            graphdef, s, t, m, jax.random.key(0), max_new_tokens=20, sampling=GREEDY, eos_id=None, pad_id=0,
        ))(state, tokens, mask)


@pytest.mark.slow
def test_bucket_padding_bounds_recompiles():
    model = build_model(preset("tiny"), seed=3)
    generator, state = gen.Generator.for_model(model)
    before = {k: gen.trace_count(k) for k in ("prefill", "decode")}
    batch = 5  # a batch size no other test uses, so the first call must compile
    for length in (2, 9, 16, 17, 32):
        prompts = [[1] + [10 + i] * (length - 1) for i in range(batch)]
        generator(state, prompts, max_new_tokens=3, sampling=GREEDY)
    # Two buckets (16, 32): one compile each for prefill and decode.
    assert gen.trace_count("prefill") - before["prefill"] == 2
    assert gen.trace_count("decode") - before["decode"] == 2
    # New weights with the same structure reuse the compiled programs.
    _, other_state = nnx.split(build_model(preset("tiny"), seed=4))
    generator(state=other_state, prompt_tokens=[[1, 2, 3]] * batch, max_new_tokens=3, sampling=GREEDY)
    assert gen.trace_count("prefill") - before["prefill"] == 2
    assert gen.trace_count("decode") - before["decode"] == 2


def test_bucket_length():
    assert [gen.bucket_length(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]
    assert gen.bucket_length(3, minimum=4) == 4
    assert gen.bucket_length(13, 12) == 24  # the minimum doubled, whatever it is


def test_process_logits_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = lambda sp: np.isfinite(np.asarray(process_logits(logits, sp)))[0].tolist()  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False, False]
    assert kept(SamplingParams(top_p=0.5)) == [True, False, False, False, False]
    assert kept(SamplingParams(top_p=0.8)) == [True, True, True, False, False]
    assert kept(SamplingParams(top_p=0.86)) == [True, True, True, True, False]  # 0.5+0.2+0.15 < 0.86
    assert kept(SamplingParams(top_k=2, top_p=0.99)) == [True, True, False, False, False]
    lp = process_logits(logits, SamplingParams(top_k=2))
    np.testing.assert_allclose(jnp.exp(lp[0, :2]), [0.5 / 0.7, 0.2 / 0.7], rtol=1e-6)
    # Temperature is applied before the filters: T=0.5 sharpens to [.77, .12, .07, ...], so top_p=0.8 keeps two.
    assert kept(SamplingParams(temperature=0.5, top_p=0.8)) == [True, True, False, False, False]


def test_process_logits_matches_hf_warpers():
    torch = pytest.importorskip("torch")
    lp_mod = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    for sp in [SamplingParams(temperature=0.7, top_k=10, top_p=0.8), SamplingParams(top_p=0.3), SamplingParams(top_k=3)]:
        warpers = [lp_mod.TemperatureLogitsWarper(sp.temperature)]
        if sp.top_k:
            warpers.append(lp_mod.TopKLogitsWarper(sp.top_k))
        if sp.top_p < 1:
            warpers.append(lp_mod.TopPLogitsWarper(sp.top_p))
        scores = torch.tensor(logits)
        for w in warpers:
            scores = w(None, scores)
        ref = torch.log_softmax(scores, -1).numpy()
        ours = np.asarray(process_logits(jnp.asarray(logits), sp))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
        np.testing.assert_allclose(ours[np.isfinite(ours)], ref[np.isfinite(ref)], atol=1e-5)


@pytest.mark.slow
def test_entropy_and_gradients_are_finite_with_filters():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 30))
    tokens = jnp.argmax(logits, -1)
    sp = SamplingParams(temperature=0.9, top_k=5, top_p=0.8)

    def loss(x):
        return -token_logprobs(x, tokens, sp).sum() - entropy(x, sp).sum()

    g = jax.jit(jax.grad(loss))(logits)
    assert bool(jnp.isfinite(g).all())
    filtered, full = jax.jit(lambda x: (entropy(x, sp), entropy(x, SamplingParams())))(logits)
    assert bool((filtered < full).all()) and bool((filtered >= 0).all())


def test_sampling_params_validation():
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    from jaxrlhf.testing.models import save_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {arch: save_tiny_hf_checkpoint(root, arch, seed=1) for arch in ("llama", "qwen2", "mistral")}


@pytest.mark.slow
def test_eos_list_stops_like_transformers_generate(tmp_path):
    """A config.json eos_token_id list survives export/import, and generation stops on its second id
    exactly where transformers' generate (reading generation_config.json) stops."""
    import torch
    import transformers

    from jaxrlhf.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
    from jaxrlhf.testing.models import random_model, tiny_config

    prompt, n = PROMPTS[0], 12
    free = random_model(tiny_config("llama"), seed=5)
    ref = gen.generate(free, [prompt], n, GREEDY, eos_id=NO_EOS).response_tokens[0].tolist()
    second = ref[3]
    unused = next(t for t in range(3, 384) if t not in ref)
    config = tiny_config("llama", eos_token_id=unused, extra_eos_token_ids=(second,))
    path = save_hf_checkpoint(random_model(config, seed=5), config, tmp_path / "ckpt")
    model, loaded = load_hf_checkpoint(path)
    assert loaded.eos_token_ids == (unused, second)
    ours = gen.generate(model, [prompt], n, GREEDY)
    length = int(ours.lengths[0])
    assert length == ref.index(second) + 1 and bool(ours.ended_with_eos[0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert list(hf.generation_config.eos_token_id) == [unused, second]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    assert ours.response_tokens[0, :length].tolist() == theirs[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_equals_transformers_generate(hf_checkpoints, arch):
    import torch
    import transformers

    from jaxrlhf.models.hf_io import load_hf_checkpoint

    path = hf_checkpoints[arch]
    model, config = load_hf_checkpoint(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = 16  # with the 18-token prompt this also crosses mistral's 16-token sliding window
    ours = gen.generate(model, PROMPTS, n, GREEDY, eos_id=config.eos_token_id, pad_id=config.pad_token_id)
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
            )[0, len(prompt):].tolist()
        length = int(ours.lengths[row])
        assert ours.response_tokens[row, :length].tolist() == ref
