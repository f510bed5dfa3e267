"""Blockwise attention (`models/blockwise.py`) against the model's dense attention: the whole model's logits
and gradients with long-row attention switched on at a toy size (GQA, a sliding window on alternating layers,
Gemma's score scale and soft-cap, q/k norms, padding on both sides, packed rows, a length no block divides),
and the one rule the runtime and the memory model share."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models.config import ModelConfig, preset
from jaxrlhf.models.transformer import build_model, positions_from_mask

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    sliding_window=5, sliding_window_pattern=2, attn_logit_softcap=20.0, query_pre_attn_scalar=16.0,
    qk_norm=True, max_position_embeddings=64, blockwise_attention_from=None,
)
B, T = 3, 37  # 37 tokens: blocks of 8 pad the last one


def _batch():
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 64, size=(B, T), dtype=np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :4] = False  # left padding
    mask[2, -9:] = False  # right padding
    segments = np.zeros((B, T), np.int32)
    segments[0, 11:] = 1  # packed: two sequences in row 0, the boundary inside a block
    segments[0, 24:] = 2  # and a third starting on a block edge
    positions = np.array(positions_from_mask(jnp.asarray(mask)))
    for s in np.unique(segments[0]):
        cols = segments[0] == s
        positions[0, cols] = np.arange(cols.sum())
    return tokens, positions, mask, segments


def _logits_and_grads(cfg: ModelConfig):
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    tokens, positions, mask, segments = _batch()

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask, segment_ids=segments)
        return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / 1000.0, logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]


@pytest.mark.parametrize("block", [8, 16])
def test_blockwise_model_matches_dense_logits_and_gradients(block):
    dense_logits, dense_grads = _logits_and_grads(CFG)
    cfg = CFG.replace(blockwise_attention_from=32, attention_block=block)
    assert cfg.attends_blockwise(T)
    logits, grads = _logits_and_grads(cfg)
    np.testing.assert_allclose(logits, dense_logits, rtol=1e-5, atol=1e-5)
    for g, want in zip(grads, dense_grads):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def test_the_rule_counts_long_rows_on_one_device_only():
    cfg = preset("tiny")
    start = cfg.blockwise_attention_from
    assert not cfg.attends_blockwise(start - 1)
    assert cfg.attends_blockwise(start)
    assert not cfg.attends_blockwise(start, context=2)  # the ring attends a context split
    assert not cfg.replace(blockwise_attention_from=None).attends_blockwise(10**6)
    assert not cfg.replace(blockwise_attention_from=4, attention_block=64).attends_blockwise(64)


@pytest.mark.parametrize("field,value", [("attention_block", 0), ("blockwise_attention_from", -1),
                                         ("attention_block", True)])
def test_bad_block_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"model.{field}="):
        CFG.replace(**{field: value})


def test_a_long_rows_train_call_keeps_no_score_matrix():
    """XLA's own count: the compiled gradient of a 4k-token forward holds far less than one [T, T] float32
    matrix per head when blockwise (it holds several when dense)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=4096, blockwise_attention_from=None)
    t = 4096
    tokens = jnp.zeros((1, t), jnp.int32)
    positions = jnp.arange(t)[None]
    mask = jnp.ones((1, t), bool)

    def temp_bytes(c):
        graphdef, params = nnx.split(build_model(c, seed=0))

        def loss(p):
            logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask)
            return jnp.mean(logits)

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    score_matrix = 4 * t * t * cfg.num_heads  # one float32 [T, T] per head
    assert temp_bytes(cfg) > 2 * score_matrix
    assert temp_bytes(cfg.replace(blockwise_attention_from=1024, attention_block=512)) < score_matrix / 4


def test_each_row_skips_its_own_block_pairs_on_each_data_shard(monkeypatch):
    """Two packed rows over a data-parallel mesh of 2: one long sequence (10 of 16 block pairs causal) and
    four block-long ones (4 pairs). Each device decides its own row's skips, so 14 row-block pairs run
    forward (one predicate over the whole batch would run the union's 10 pairs for both rows: 20), the
    loops visit no other pair, and the output and gradients are the one-device ones."""
    from jaxrlhf.models import axes as ax
    from jaxrlhf.models import blockwise
    from jaxrlhf.placement.layout import activation_resolver, make_mesh
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    cfg = CFG.replace(sliding_window=None, sliding_window_pattern=None, attn_logit_softcap=None,
                      query_pre_attn_scalar=None, blockwise_attention_from=16, attention_block=8)
    rng = np.random.default_rng(3)
    t = 32
    q = jnp.asarray(rng.normal(size=(2, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32) for _ in range(2))
    valid = jnp.ones((2, t), bool)
    segments = jnp.asarray(np.stack([np.ones(t), np.repeat(np.arange(1, 5), 8)]), jnp.int32)
    ran, visited = [], []
    attend = blockwise._attend

    def counted(st, qg, k_blk, v_blk, allowed, m, l, acc):
        jax.debug.callback(lambda: visited.append(1))
        jax.lax.cond(jnp.any(allowed), lambda: jax.debug.callback(lambda: ran.append(1)), lambda: None)
        return attend(st, qg, k_blk, v_blk, allowed, m, l, acc)

    monkeypatch.setattr(blockwise, "_attend", counted)
    mesh = make_mesh(DeviceGroup("g", 0, 2), Layout(data=2))

    def on_mesh(q, k, v):
        with ax.activation_sharding(activation_resolver(mesh)):
            return blockwise.blockwise_attention(q, k, v, valid, segments, cfg, False)

    def alone(q, k, v):
        return blockwise.blockwise_attention(q, k, v, valid, segments, cfg, False)

    out = jax.block_until_ready(jax.jit(on_mesh)(q, k, v))
    assert len(ran) == 10 + 4
    assert len(visited) == 10 + 4  # the loops visit only the pairs a sequence spans (`_reach`), not 16 a row
    assert out.sharding.spec[0] in ("data", ("data",), ("data", "fsdp"))  # each device its own row
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    got = jax.jit(lambda: (lambda o, f: (o, *f(cot)))(*jax.vjp(on_mesh, q, k, v)))()
    want = jax.jit(lambda: (lambda o, f: (o, *f(cot)))(*jax.vjp(alone, q, k, v)))()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want[0]), atol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
