"""Logits parity with transformers (float32) for checkpoints transformers itself wrote."""

import numpy as np
import pytest

from jaxrlhf.models.config import RopeScaling
from jaxrlhf.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from jaxrlhf.testing.models import (
    jax_logits,
    left_padded_batch,
    load_transformers_model,
    max_relative_error,
    save_tiny_hf_checkpoint,
    torch_logits,
)

TOL = 1e-4
LENGTH = 40  # longer than tiny-mistral's sliding window (16), so the window is exercised


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: save_tiny_hf_checkpoint(root, arch, seed=1) for arch in ("llama", "qwen2", "mistral")}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers_left_padded(checkpoints, arch):
    model, config = load_hf_checkpoint(checkpoints[arch])
    hf = load_transformers_model(checkpoints[arch])
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5, 17))
    ours, ref = jax_logits(model, tokens, mask), torch_logits(hf, tokens, mask)
    assert max_relative_error(ours, ref, mask) <= TOL
    # row 1 is left-padded: its logits equal those of the same tokens unpadded (in row 0, same shape)
    again = jax_logits(model, np.stack([tokens[1, 5:].tolist() + [7] * 5, tokens[1], tokens[2]]), mask)
    np.testing.assert_allclose(again[0, :-5], ours[1, 5:], atol=TOL * np.abs(ref).max())


def test_qwen2_features_are_exercised(checkpoints):
    model, config = load_hf_checkpoint(checkpoints["qwen2"])
    assert config.attention_bias and config.tie_word_embeddings and not hasattr(model, "lm_head")
    assert np.abs(np.asarray(model.model.layers.attn.q_bias[...][0])).max() > 0


@pytest.mark.slow
def test_mistral_sliding_window_is_exercised(checkpoints):
    """Without the window our logits would differ from transformers': the test sequence is long enough."""
    path = checkpoints["mistral"]
    windowed, config = load_hf_checkpoint(path)
    assert config.sliding_window == 16 < LENGTH
    full, _ = load_hf_checkpoint(path, config_overrides={"sliding_window": None})
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0,))
    ref = torch_logits(load_transformers_model(path), tokens, mask)
    assert max_relative_error(jax_logits(windowed, tokens, mask), ref, mask) <= TOL
    assert max_relative_error(jax_logits(full, tokens, mask), ref, mask) > 100 * TOL


@pytest.mark.slow
def test_llama3_rope_scaling_matches_transformers(tmp_path):
    # original_max_position_embeddings=64 puts the 8 rotary wavelengths of head_dim 16 in all three
    # regimes (kept, interpolated, divided by factor)
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    path = save_tiny_hf_checkpoint(tmp_path, "llama", seed=2, rope_scaling=scaling, rope_theta=500000.0)
    model, config = load_hf_checkpoint(path)
    assert config.rope_scaling == scaling and config.rope_theta == 500000.0
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 7))
    ref = torch_logits(load_transformers_model(path), tokens, mask)
    assert max_relative_error(jax_logits(model, tokens, mask), ref, mask) <= TOL
    unscaled, _ = load_hf_checkpoint(path, config_overrides={"rope_scaling": None})
    assert max_relative_error(jax_logits(unscaled, tokens, mask), ref, mask) > 10 * TOL
    # our config.json (legacy rope_scaling + rope_parameters) gives transformers the same rope
    save_hf_checkpoint(model, config, tmp_path / "export")
    exported = torch_logits(load_transformers_model(tmp_path / "export"), tokens, mask)
    assert max_relative_error(exported, ref, mask) <= TOL


def test_explicit_head_dim_and_tied_llama(tmp_path):
    """head_dim != hidden_size / num_heads (Gemma-style widths) and a tied Llama."""
    path = save_tiny_hf_checkpoint(tmp_path, "llama", seed=3, head_dim=32, tie_word_embeddings=True)
    model, config = load_hf_checkpoint(path)
    assert config.dim_per_head == 32 and config.tie_word_embeddings
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5, 17))
    ref = torch_logits(load_transformers_model(path), tokens, mask)
    assert max_relative_error(jax_logits(model, tokens, mask), ref, mask) <= TOL
