"""Context parallelism: ring attention over a sequence split along the mesh axis "context".

Under a placement whose layout has `context` = c > 1 the activation rules map the logical "length" axis
to the mesh axis "context", so every activation of a forward without a KV cache holds T / c of each
row's tokens: projections, norms, the MLP and the heads are per-token and need nothing more. Attention
is the one place tokens meet, and `ring_attention` computes it without ever gathering a sequence.

**Ring vs all-gathered keys/values.** Two ways to let a block of queries see every key:

- *all-gather K/V*: each device gathers the whole sequence's keys and values (one all-gather per layer,
  (c - 1) / c of the K/V bytes received per device) and runs plain attention of its T / c queries over
  all T keys. Simple, one collective, and cheaper at small degree (c = 2..4 on one host's fast links,
  or when K/V are small: GQA with few kv_heads), because one large collective is more efficient than
  c - 1 dependent steps. But every device then holds all T keys and values of the layer (and autodiff
  keeps them for the backward), the memory context parallelism exists to remove: at 128k tokens a
  Llama-70B layer's K/V alone are 0.5 GB per layer in bf16.
- *ring* (implemented here): device i keeps its own block of queries and passes its key/value block to
  device i + 1 (`lax.ppermute`) c - 1 times, so after c steps it has seen every block while holding only
  two (the one it computes with and the one arriving). It sends the same bytes as the all-gather, in
  c - 1 neighbour steps each of which overlaps with the previous block's attention on hardware that runs
  collectives beside compute (GPU, TPU), and no device ever holds more than 2 / c of a layer's K/V.
  Scores are combined with an online (flash-style) softmax: a running maximum and log-sum-exp per query,
  numerically stable for any number of blocks.

The backward is a second ring (`jax.custom_vjp`): it recomputes each block's scores from the saved
queries, keys, values, output and per-query log-sum-exp, and passes each key/value block around the
ring together with the gradients of that block's keys and values, which arrive back at their owner after
c steps. Autodiff of the forward loop would instead save every visited K/V block and score block, i.e.
all keys/values of the layer and a [T / c, T] score matrix per head.

**Causal load imbalance.** Blocks are contiguous: device i holds tokens [i T/c, (i+1) T/c). Under a
causal mask device 0's queries see only its own block and device c-1's see all c, so the work is
unbalanced (device c-1 does c blocks, device 0 one); blocks that are wholly masked are skipped
(`lax.cond`), which saves the idle devices' compute but not wall time, since every step waits for the
slowest device. Zig-zag ordering (device i holding chunks i and 2c-1-i of 2c) would balance it; it is
not implemented here (it needs the sequence permuted before the first layer and back after the last).

What the dense path of `transformer.Attention` computes, this reproduces: scores in float32 scaled by
1/sqrt(head_dim) (or `attention_scale`), soft-capped, masked by causal order of global slots, the key
padding mask, packed `segment_ids` (never across a segment), the sliding window of local layers (a
traced flag where local and global layers alternate in one scanned body), every query attending to
itself at least (a padding query's output is finite garbage), grouped-query heads (kv_heads < heads).
Only forwards without a KV cache take this path; prefill and decode keep dense attention (generation is
never context-parallel: `planner.plan.layout_misfit` refuses it).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import ModelConfig

_NO_WINDOW = 2**30  # the window of a global layer where the layer's kind is a traced flag


def _spec_entry(entry: Any) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _fit(entry: Any, size: int, mesh_shape) -> Any:
    """A spec entry that divides a dimension of `size`: the leading axes of `entry` that do."""
    names = list(_spec_entry(entry))
    while names and size % math.prod(mesh_shape[n] for n in names):
        names.pop()
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def _shard_specs(mesh, b: int, t: int, heads: int, kv_heads: int):
    """(batch, length, heads) spec entries of the ring's inputs under the current activation rules: the
    batch and head axes as the rules split them where they divide (replicated otherwise), heads and
    kv_heads over the same axes (a query head's kv head must be on its device)."""
    q_spec = ax.resolved((ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM)).spec
    kv_spec = ax.resolved((ax.BATCH, ax.LENGTH, ax.KV_HEADS, ax.HEAD_DIM)).spec
    q_spec, kv_spec = tuple(q_spec) + (None,) * 4, tuple(kv_spec) + (None,) * 4
    shape = mesh.shape
    batch = _fit(q_spec[0], b, shape)
    length = q_spec[1]
    heads, kv = _fit(q_spec[2], heads, shape), _fit(kv_spec[2], kv_heads, shape)
    if _spec_entry(heads) != _spec_entry(kv):
        heads = kv = None
    return batch, length, heads


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array,
    segment_ids: jax.Array | None,
    config: ModelConfig,
    local: bool | jax.Array,
) -> jax.Array:
    """Attention of `q` [B, T, heads, D] over `k`, `v` [B, T, kv_heads, D] (rotated, not cached), with
    the sequence split over the mesh axes the current activation rules give the "length" axis (see the
    module docstring); `key_valid` [B, T] the padding mask, `segment_ids` [B, T] packed sequences or
    None, `local` whether the layer attends through the sliding window (a Python bool or a traced flag).
    Returns [B, T, heads, D] in `v`'s dtype, laid out like `q`."""
    sharding = ax.resolved((ax.LENGTH,))
    mesh = sharding.mesh
    b, t, h, d = q.shape
    kvh = k.shape[2]
    batch, length, heads = _shard_specs(mesh, b, t, h, kvh)
    axis = _spec_entry(length)
    ways = math.prod(mesh.shape[n] for n in axis)
    if ways < 2:
        raise ValueError("ring_attention needs the length axis split over >= 2 devices (axes.length_ways())")
    if t % ways:
        ok = [n for n in range(ways, 0, -1) if t % n == 0]
        raise ValueError(
            f"context parallelism over {ways} devices (mesh {dict(mesh.shape)}) does not divide the sequence "
            f"length {t}: pad sequences to a multiple of {ways} (e.g. {-(-t // ways) * ways}) or use a layout "
            f"with context in {ok}")
    axis_name = axis[0] if len(axis) == 1 else axis
    window = None
    if config.sliding_window is not None and local is not False:
        window = config.sliding_window if local is True else jnp.where(local, config.sliding_window, _NO_WINDOW)
        window = jnp.asarray(window, jnp.int32)
    seq_spec = PartitionSpec(batch, length)
    qspec = PartitionSpec(batch, length, heads, None)
    args, specs = [q, k, v, key_valid.astype(bool)], [qspec, qspec, qspec, seq_spec]
    if segment_ids is not None:
        args.append(segment_ids.astype(jnp.int32))
        specs.append(seq_spec)
    if window is not None:
        args.append(window)
        specs.append(PartitionSpec())
    body = functools.partial(
        _ring_shard, axis_name=axis_name, ways=ways, config=config,
        has_segments=segment_ids is not None, has_window=window is not None)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=qspec, check_vma=False)
    return mapped(*args)


def _ring_shard(q, k, v, valid, *rest, axis_name, ways: int, config: ModelConfig, has_segments: bool,
                has_window: bool):
    """One device's part: its query block against every key/value block around the ring."""
    rest = list(rest)
    segments = rest.pop(0) if has_segments else None
    window = rest.pop(0) if has_window else None
    statics = _Statics(axis_name, ways, config, has_segments, has_window)
    return _ring(statics, q, k, v, valid, segments, window)


class _Statics:
    """The ring's static parameters (hashable, so `custom_vjp` can take them as a non-differentiable
    argument)."""

    def __init__(self, axis_name, ways, config, has_segments, has_window):
        self.axis_name, self.ways, self.config = axis_name, ways, config
        self.has_segments, self.has_window = has_segments, has_window
        self._key = (axis_name, ways, config, has_segments, has_window)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Statics) and self._key == other._key


def _scale(s: jax.Array, config: ModelConfig) -> jax.Array:
    """Scores scaled exactly as the dense path does (a division where it divides: the same rounding)."""
    if config.query_pre_attn_scalar is None:
        return s / math.sqrt(config.dim_per_head)
    return s * config.attention_scale


def _block_mask(st: _Statics, src, valid_blk, seg_q, seg_blk, window):
    """[B, tq, tk] which keys of the block from device `src` each local query may attend to."""
    me = jax.lax.axis_index(st.axis_name)
    tq, tk = valid_blk.shape[1], valid_blk.shape[1]
    q_slot = (me * tq + jnp.arange(tq))[None, :, None]
    k_slot = (src * tk + jnp.arange(tk))[None, None, :]
    allowed = (k_slot <= q_slot) & valid_blk[:, None, :]
    if window is not None:
        allowed &= q_slot - k_slot < window
    if seg_q is not None:
        allowed &= seg_q[:, :, None] == seg_blk[:, None, :]
    return allowed | (k_slot == q_slot)


def _scores(st: _Statics, qg, k_blk):
    """Scaled, soft-capped float32 scores [B, kv_heads, groups, tq, tk] and the tanh of the cap (or None)."""
    s = _scale(jnp.einsum("btkgh,bskh->bkgts", qg, k_blk.astype(qg.dtype), preferred_element_type=jnp.float32),
               st.config)
    cap = st.config.attn_logit_softcap
    if cap is None:
        return s, None
    th = jnp.tanh(s / cap)
    return cap * th, th


def _shift(x, st: _Statics):
    """Pass to the next device of the ring (device i receives device i-1's block)."""
    return jax.lax.ppermute(x, st.axis_name, [(i, (i + 1) % st.ways) for i in range(st.ways)])


def _group(q, kv_heads: int):
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Statics, q, k, v, valid, segments, window):
    return _ring_fwd(st, q, k, v, valid, segments, window)[0]


def _attend(st: _Statics, qg, k_blk, v_blk, allowed, m, l, acc):
    """The online softmax's update with one key/value block: running maximum `m`, sum `l` and weighted
    values `acc` of every query; a block with no allowed key (the future, under the causal mask) changes
    nothing, and its work is skipped."""

    def update(m, l, acc):
        s, _ = _scores(st, qg, k_blk)
        m_new = jnp.maximum(m, jnp.max(jnp.where(allowed, s, -jnp.inf), axis=-1))
        p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)  # 0 where m was -inf (no block yet)
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bskh->btkgh", p, v_blk.astype(jnp.float32))
        return m_new, l, acc * jnp.moveaxis(alpha, 3, 1)[..., None] + pv

    return jax.lax.cond(jnp.any(allowed), update, lambda m, l, acc: (m, l, acc), m, l, acc)


def _ring_fwd(st: _Statics, q, k, v, valid, segments, window):
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    qg = _group(q, kvh)
    me = jax.lax.axis_index(st.axis_name)
    stat_shape = (b, kvh, h // kvh, tq)

    def allowed_of(j, valid_blk, seg_blk):
        return _block_mask(st, (me - j) % st.ways, valid_blk, segments, seg_blk, window)[:, None, None]

    def step(carry, j):
        m, l, acc, k_blk, v_blk, valid_blk, seg_blk = carry
        m, l, acc = _attend(st, qg, k_blk, v_blk, allowed_of(j, valid_blk, seg_blk), m, l, acc)
        k_blk, v_blk, valid_blk, seg_blk = _shift((k_blk, v_blk, valid_blk, seg_blk), st)
        return (m, l, acc, k_blk, v_blk, valid_blk, seg_blk), None

    init = (jnp.full(stat_shape, -jnp.inf, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
            jnp.zeros(qg.shape, jnp.float32), k, v, valid, segments)
    # c blocks, passed on c - 1 times: the loop attends and passes, the last block is attended after it
    (m, l, acc, k_blk, v_blk, valid_blk, seg_blk), _ = jax.lax.scan(step, init, jnp.arange(st.ways - 1))
    m, l, acc = _attend(st, qg, k_blk, v_blk, allowed_of(st.ways - 1, valid_blk, seg_blk), m, l, acc)
    out = (acc / jnp.moveaxis(l, 3, 1)[..., None]).reshape(b, tq, h, d).astype(v.dtype)
    lse = m + jnp.log(l)  # [B, kv_heads, groups, tq]; every query attends at least to itself: finite
    return out, (q, k, v, valid, segments, window, out, lse)


def _ring_bwd(st: _Statics, res, dout):
    q, k, v, valid, segments, window, out, lse = res
    b, tq, h, d = q.shape
    kvh = k.shape[2]
    qg = _group(q, kvh)
    dog = _group(dout, kvh).astype(jnp.float32)
    # D_i = sum_h dO_i . O_i: the softmax backward's row term, [B, kv_heads, groups, tq]
    delta = jnp.moveaxis(jnp.sum(dog * _group(out, kvh).astype(jnp.float32), axis=-1), 1, 3)
    me = jax.lax.axis_index(st.axis_name)
    cap = st.config.attn_logit_softcap

    def step(carry, j):
        dq, k_blk, v_blk, valid_blk, seg_blk, dk_blk, dv_blk = carry
        src = (me - j) % st.ways
        allowed = _block_mask(st, src, valid_blk, segments, seg_blk, window)[:, None, None]

        def grads(dq, dk_blk, dv_blk):
            s, th = _scores(st, qg, k_blk)
            p = jnp.where(allowed, jnp.exp(s - lse[..., None]), 0.0)
            dv_blk = dv_blk + jnp.einsum("bkgts,btkgh->bskh", p, dog)
            dp = jnp.einsum("btkgh,bskh->bkgts", dog, v_blk.astype(jnp.float32))
            ds = p * (dp - delta[..., None])
            if cap is not None:
                ds = ds * (1.0 - th * th)
            ds = _scale(ds, st.config)
            dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, k_blk.astype(jnp.float32))
            dk_blk = dk_blk + jnp.einsum("bkgts,btkgh->bskh", ds, qg.astype(jnp.float32))
            return dq, dk_blk, dv_blk

        dq, dk_blk, dv_blk = jax.lax.cond(jnp.any(allowed), grads, lambda *a: a, dq, dk_blk, dv_blk)
        # the block and its gradients move on together; after c passes the gradients are home
        k_blk, v_blk, valid_blk, seg_blk, dk_blk, dv_blk = _shift(
            (k_blk, v_blk, valid_blk, seg_blk, dk_blk, dv_blk), st)
        return (dq, k_blk, v_blk, valid_blk, seg_blk, dk_blk, dv_blk), None

    init = (jnp.zeros(qg.shape, jnp.float32), k, v, valid, segments,
            jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dq, *_, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(st.ways))
    dq = dq.reshape(b, tq, h, d).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
