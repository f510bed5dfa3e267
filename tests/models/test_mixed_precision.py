"""A bfloat16 model's float32 products (the vocabulary projection's logits, attention scores): float32
results forward, a backward in bfloat16 (`transformer.float32_product`), and the gradients of the
float32 model within bfloat16 rounding."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model, positions_from_mask


def _loss(dtype: str):
    cfg = preset("tiny", num_layers=2, dtype=dtype, param_dtype="float32")
    graphdef, state = nnx.split(build_model(cfg, seed=3))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    mask = jnp.ones((2, 9), bool).at[1, :3].set(False)

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)
        assert logits.dtype == jnp.float32
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    return loss, state


def test_a_bfloat16_backward_runs_no_float32_matmul():
    """Every matmul of the gradient program takes bfloat16 operands: plain autodiff of the float32
    logits and scores hands their transposes a float32 cotangent (8 float32 matmuls in this model,
    TF32 on a GPU: 14 % of a 1.2B model's train call)."""
    loss, state = _loss("bfloat16")
    text = jax.jit(jax.grad(loss)).lower(state).as_text()
    operands = re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^)]*)\)", text)
    assert len(operands) >= 3 * 2 * 2  # forward and two backward products of 2 layers' projections
    widened = [o for o in operands if "xf32>" in o]
    assert not widened, widened


def test_bfloat16_gradients_match_the_float32_model():
    loss32, state = _loss("float32")
    loss16, _ = _loss("bfloat16")
    value32, grads32 = jax.jit(jax.value_and_grad(loss32))(state)
    value16, grads16 = jax.jit(jax.value_and_grad(loss16))(state)
    assert abs(float(value16) - float(value32)) < 1e-2 * abs(float(value32))
    for path, g32 in jax.tree_util.tree_leaves_with_path(grads32):
        g16 = np.asarray(dict(jax.tree_util.tree_leaves_with_path(grads16))[path])
        g32 = np.asarray(g32)
        error = np.linalg.norm(g16 - g32) / max(np.linalg.norm(g32), 1e-12)
        assert error < 0.05, (jax.tree_util.keystr(path), error)
