"""Rule rewards, their combination, and score shaping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf.algorithms.rewards import sequence_ended_with_eos, shape_scores
from jaxrlhf.rewards.rules import REWARD_FUNCTIONS, CombinedReward, get_reward, parse_number


def _call(name, response, answer=None, **params):
    return get_reward(name)(prompt="Q", response=response, answer=answer, **params)


def test_exact_match():
    assert _call("exact_match", "reasoning...\n#### 42", "42") == 1.0
    assert _call("exact_match", "  olleh ", "olleh") == 1.0
    assert _call("exact_match", "steps #### 42", "Janet has ... #### 42") == 1.0
    assert _call("exact_match", "#### 41", "42") == 0.0
    assert _call("exact_match", "Olleh", "olleh") == 0.0  # case matters (string tasks)
    with pytest.raises(ValueError, match="needs a reference answer"):
        _call("exact_match", "42")


def test_numeric_match_gsm8k_style():
    assert parse_number("$1,234.50 total") == 1234.5 and parse_number("none") is None
    assert _call("numeric_match", "so she pays #### 1,234", "... #### 1234") == 1.0
    assert _call("numeric_match", "#### 42.0", "42") == 1.0
    assert _call("numeric_match", "#### -3", "3") == 0.0
    assert _call("numeric_match", "the answer is 7, not 42", "42") == 0.0  # strict: needs ####
    assert _call("numeric_match", "the answer is 7, not 42", "42", strict=False) == 1.0
    assert _call("numeric_match", "#### twelve", "12") == 0.0


def test_format_and_length_penalty():
    assert _call("format", "think... #### 42") == 1.0
    assert _call("format", "42") == 0.0
    assert _call("format", "#### 42 and more text") == 0.0
    assert _call("length_penalty", "x" * 5, max_chars=10) == 0.0
    assert _call("length_penalty", "x" * 15, max_chars=10) == -0.5
    assert _call("length_penalty", "x" * 40, max_chars=10) == -1.0


def test_combined_reward():
    combo = CombinedReward([("exact_match", 1.0), ("format", 0.1)])
    assert combo(prompt="Q", response="#### 42", answer="42") == pytest.approx(1.1)
    assert combo(prompt="Q", response="42", answer="42") == pytest.approx(1.0)
    assert combo(prompt="Q", response="#### 7", answer="42") == pytest.approx(0.1)
    assert combo.components(prompt="Q", response="#### 7", answer="42") == {"exact_match": 0.0, "format": 1.0}
    scores = combo.batch(["Q", "Q"], ["#### 42", "#### 7"], ["42", "42"])
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, [1.1, 0.1], rtol=1e-6)
    with_params = CombinedReward([("numeric_match", 1.0), ("length_penalty", 0.5, {"max_chars": 4})])
    # numeric 1.0 + 0.5 * -(7 - 4) / 4
    assert with_params(prompt="Q", response="#### 42", answer="42") == pytest.approx(1.0 - 0.375)
    with pytest.raises(ValueError, match="batch lengths differ"):
        combo.batch(["Q"], ["a", "b"], ["x"])


def test_registry_rejects_unknown_names():
    with pytest.raises(ValueError, match=r"unknown reward function 'exact_mach'\. Did you mean 'exact_match'\?") as err:
        CombinedReward([("exact_mach", 1.0)])
    for name in ("exact_match", "numeric_match", "format", "length_penalty"):
        assert name in str(err.value) and name in REWARD_FUNCTIONS


def test_shape_scores_bias_scale_clip_and_eos_gating():
    scores = jnp.array([30.0, -30.0, 5.0, 5.0])
    eos = jnp.array([True, True, True, False])
    # (s - 1) * 2 = [58, -62, 8, 8] -> clip ±20 -> [20, -20, 8, 8] -> truncated row gets 0
    shaped = jax.jit(lambda s, e: shape_scores(s, e, bias=1.0, scale=2.0))(scores, eos)
    np.testing.assert_allclose(shaped, [20.0, -20.0, 8.0, 0.0])
    np.testing.assert_allclose(shape_scores(scores, eos, bias=1.0, scale=2.0, no_eos_score=-1.0)[3], -1.0)
    np.testing.assert_allclose(shape_scores(scores, eos, bias=1.0, scale=2.0, eos_only=False), [20, -20, 8, 8])
    np.testing.assert_allclose(shape_scores(scores, bias=1.0, scale=2.0, clip=None, eos_only=False), [58, -62, 8, 8])
    with pytest.raises(ValueError, match="needs ended_with_eos"):
        shape_scores(scores)


def test_sequence_ended_with_eos():
    eos_id = 2
    tokens = jnp.array([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0], [2, 5, 0, 0], [2, 2, 2, 2]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(sequence_ended_with_eos(tokens, mask, eos_id), [True, False, True, False, False])
