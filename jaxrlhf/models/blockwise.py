"""Blockwise (flash-style) attention for long forwards on one device's whole sequence.

Dense attention (`transformer.Attention`) materialises every row's float32 [T, T] score matrix per head, and
its backward keeps them: at 32k tokens that is 4 GiB per head and row, more than any accelerator holds for a
7B model's 28 heads. Where a forward has no KV cache (the train, log-prob and value calls) and no context
split (ring attention, `models.context`, covers that), a row of at least `ModelConfig.blockwise_attention_from`
tokens instead attends in blocks of `ModelConfig.attention_block` queries and keys: a scan over query blocks,
each looping over the key blocks its queries can see with the online softmax of `context._attend` (running
maximum, sum and weighted values), so a device holds one [block, block] score matrix per head.
Rows go one at a time (`lax.map`), each device its own (`shard_map` over the batch and head axes), and the
loops visit only the block pairs one of the row's sequences spans (`_reach`: none in the future, none of two
packed sequences; a pair they visit whose mask allows nothing is skipped by `_attend`'s `lax.cond`), so a row
of packed sequences computes its own sequences' blocks, which the cost model prices
(`planner.cost.forward_shape`). Over the whole batch, as GSPMD would reduce that predicate, a pair would run
wherever any row of any shard allowed it.

The backward (`jax.custom_vjp`) keeps only q, k, v, the output and each query's log-sum-exp, and recomputes
each block pair's scores (`context._block_grads`): one more q.k^T product per pair than a dense backward,
which the cost model counts (`planner.cost`). It scans the key blocks, each scanning the query blocks,
accumulating that key block's gradients and adding each query block's share into the queries' gradient.

Masks, scaling, soft-capping, grouped-query heads, the sliding window and packed segments are the dense
path's (`context._mask`, `_scores`); slots count from 0, as in every forward without a cache. A sequence
that is not a multiple of the block is padded with keys no query may see and queries that are dropped.
`ModelConfig.attends_blockwise` is the one rule the runtime and the memory model (`planner.memory`) read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.context import _attend, _block_grads, _group, _mask, _shard_specs, _Statics, layer_window


def blockwise_attention(
    q: Float[Array, "batch length heads head_dim"],
    k: Float[Array, "batch length kv_heads head_dim"],
    v: Float[Array, "batch length kv_heads head_dim"],
    key_valid: Bool[Array, "batch length"],
    segment_ids: Int[Array, "batch length"] | None,
    config: ModelConfig,
    local: bool | jax.Array,
) -> Float[Array, "batch length heads head_dim"]:
    """Attention of `q` over `k`, `v` (rotated, not cached) a block at a time (see the module docstring);
    `local`: whether the layer attends through the sliding window (a Python bool or a traced flag).
    Returns [B, T, heads, D] in `v`'s dtype."""
    t = q.shape[1]
    block = config.attention_block
    padded = -(-t // block) * block
    window = layer_window(config, local)
    valid = key_valid.astype(bool)
    segments = None if segment_ids is None else segment_ids.astype(jnp.int32)
    if padded != t:  # padded keys are invalid (no query sees them); padded queries are dropped below
        pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, valid = pad(q), pad(k), pad(v), pad(valid)
        segments = None if segments is None else pad(segments)
    st = _Statics(None, 1, config, 1)
    rows = functools.partial(_each_row, st, block, has_segments=segments is not None, has_window=window is not None)
    args = [q, k, v, valid] + [x for x in (segments, window) if x is not None]
    sharding = ax.resolved((ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.size == 1:
        return rows(*args)[:, :t]
    # each device its own rows: a block pair's skip (`_attend`'s `lax.cond`) then asks one row, not the
    # whole batch, which GSPMD would reduce over every shard's rows
    batch, _, heads = _shard_specs(mesh, q.shape[0], padded, q.shape[2], k.shape[2])
    qspec, seq = PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None)
    specs = [qspec, qspec, qspec, seq] + ([seq] if segments is not None else []) + \
        ([PartitionSpec()] if window is not None else [])
    mapped = jax.shard_map(rows, mesh=mesh, in_specs=tuple(specs), out_specs=qspec, check_vma=False)
    return mapped(*args)[:, :t]


def _each_row(st: _Statics, block: int, q, k, v, valid, *rest, has_segments: bool, has_window: bool):
    """`_blocks` one row at a time (`lax.map`): a block pair is skipped where this row's mask allows none
    of it, so a packed row computes about its own sequences' blocks whatever the other rows hold."""
    rest = list(rest)
    segments = rest.pop(0) if has_segments else None
    window = rest.pop(0) if has_window else None

    def one(xs):
        q_row, k_row, v_row, valid_row, seg_row = (None if x is None else x[None] for x in xs)
        return _blocks(st, block, q_row, k_row, v_row, valid_row, seg_row, window)[0]

    return jax.lax.map(one, (q, k, v, valid, segments))


def _tied_mask(x, q_slot, k_slot, valid_k, q_seg, k_seg, window):
    """`context._mask` of a block pair, built from query slots and segments tied to a value `x` of the block
    it serves (a NaN there, only, shifts them: the output is NaN either way). Built from slots, padding and
    segments alone, a mask is the same in every layer, and autodiff's partial evaluation of the layers' scan
    would hoist every block pair's mask out of it and keep them all: a T x T array of each kind (13 bytes a
    query-key pair, measured; 1.4 with only the finished mask tied)."""
    nan = jnp.isnan(x.reshape(-1)[0]).astype(jnp.int32)
    q_seg = None if q_seg is None else q_seg + nan
    return _mask(q_slot + nan, k_slot, valid_k, q_seg, k_seg, window)


def _blocks_of(x, block: int, axis: int = 1):
    """`x` with `axis` split into [n, block], the block index first: a scan's xs."""
    n = x.shape[axis] // block
    x = x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblock(x, axis: int = 1):
    """The inverse of `_blocks_of`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocks(st: _Statics, block: int, q, k, v, valid, segments, window):
    return _blocks_fwd(st, block, q, k, v, valid, segments, window)[0]


def _key_blocks(block, k, v, valid, segments):
    """The keys' per-block inputs: keys, values, key mask, key segments (or None) and key slots."""
    n = k.shape[1] // block
    slots = jnp.arange(n * block).reshape(n, block)
    segs = None if segments is None else _blocks_of(segments, block)
    return _blocks_of(k, block), _blocks_of(v, block), _blocks_of(valid, block), segs, slots


def _reach(segments, valid, n: int, block: int):
    """For one row's `n` blocks: the first key block each query block can see and the last query block that
    can see each key block. The row's sequences are runs of one segment id (`models.packing`): a query sees
    the valid keys of its run up to itself, and itself (a padding query, which may have no valid key before
    it: the tail of a packed row), so its first visible key is its run's first valid one, or itself; a valid
    key is seen up to its run's end, a padding key by itself only. Without segments, every earlier block and
    every later one. A block pair outside these bounds has no query and key of one sequence, so the loops
    never visit it: a packed row costs its own sequences' blocks, not the row's n x n, in loop steps as in
    work."""
    if segments is None:
        return jnp.zeros(n, jnp.int32), jnp.full(n, n - 1, jnp.int32)
    seg, real = segments[0], valid[0].astype(bool)  # one row (`_each_row`)
    t = seg.shape[0]
    slot = jnp.arange(t, dtype=jnp.int32)
    change = seg[1:] != seg[:-1]
    run_start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.array([True]), change]), slot, 0))
    run_end = jax.lax.cummin(jnp.where(jnp.concatenate([change, jnp.array([True])]), slot, t - 1), reverse=True)
    next_valid = jax.lax.cummin(jnp.where(real, slot, t), reverse=True)  # the first valid slot at or after each
    first_seen = jnp.minimum(next_valid[run_start], slot)  # a query's first visible key
    last_seeing = jnp.where(real, run_end, slot)  # a key's last query
    return first_seen.reshape(n, block).min(axis=1) // block, last_seeing.reshape(n, block).max(axis=1) // block


def _at(blocks, i):
    """Block `i` of each per-block input (None stays None)."""
    return tuple(None if x is None else jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False) for x in blocks)


def _blocks_fwd(st: _Statics, block: int, q, k, v, valid, segments, window):
    b, t, h, d = q.shape
    kvh = k.shape[2]
    n = t // block
    qg = _group(q, kvh)  # [B, T, kv_heads, groups, D]
    keys = _key_blocks(block, k, v, valid, segments)
    q_segs = None if segments is None else _blocks_of(segments, block)
    first, _ = _reach(segments, valid, n, block)

    def query_block(_, xs):
        i, q_blk, q_slot, q_seg = xs
        shape = (b, kvh, h // kvh, block)

        def key_block(j, stats):
            k_blk, v_blk, valid_blk, seg_blk, k_slot = _at(keys, j)
            allowed = _tied_mask(q_blk, q_slot, k_slot, valid_blk, q_seg, seg_blk, window)
            return _attend(st, q_blk, k_blk, v_blk, allowed, *stats)

        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(q_blk.shape, jnp.float32))
        m, l, acc = jax.lax.fori_loop(first[i], i + 1, key_block, init)  # no key block after the queries'
        # every query attends at least to itself: l > 0 and the log-sum-exp finite
        return None, (acc / jnp.moveaxis(l, 3, 1)[..., None], m + jnp.log(l))

    _, (outs, lses) = jax.lax.scan(query_block, None, (jnp.arange(n), _blocks_of(qg, block), keys[4], q_segs))
    out = _unblock(outs).reshape(b, t, h, d).astype(v.dtype)
    lse = _unblock(lses, axis=3)  # [B, kv_heads, groups, T]
    return out, (q, k, v, valid, segments, window, out, lse)


def _blocks_bwd(st: _Statics, block: int, res, dout):
    q, k, v, valid, segments, window, out, lse = res
    b, t, h, d = q.shape
    kvh = k.shape[2]
    n = t // block
    qg = _group(q, kvh)
    dog = _group(dout, kvh).astype(jnp.float32)
    # D_i = sum_h dO_i . O_i: the softmax backward's row term, [B, kv_heads, groups, T]
    delta = jnp.moveaxis(jnp.sum(dog * _group(out, kvh).astype(jnp.float32), axis=-1), 1, 3)
    queries = (_blocks_of(qg, block), _blocks_of(dog, block), _blocks_of(delta, block, 3),
               _blocks_of(lse, block, 3), jnp.arange(t).reshape(-1, block),
               None if segments is None else _blocks_of(segments, block))
    _, last = _reach(segments, valid, n, block)

    def key_block(dq, ys):
        j, (k_blk, v_blk, valid_blk, seg_blk, k_slot) = ys

        def query_block(i, carry):
            dq, dk, dv = carry
            q_blk, do_blk, delta_blk, lse_blk, q_slot, q_seg = _at(queries, i)
            allowed = _tied_mask(do_blk, q_slot, k_slot, valid_blk, q_seg, seg_blk, window)
            dq_blk = jax.lax.dynamic_index_in_dim(dq, i, 0, keepdims=False)
            dq_blk, dk, dv = _block_grads(st, q_blk, do_blk, delta_blk, lse_blk, k_blk, v_blk, allowed,
                                          dq_blk, dk, dv)
            return jax.lax.dynamic_update_index_in_dim(dq, dq_blk, i, 0), dk, dv

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(j, last[j] + 1, query_block, (dq, zeros, zeros))  # no query before the keys
        return dq, (dk, dv)

    dq0 = jnp.zeros((n, b, block, *qg.shape[2:]), jnp.float32)
    dq, (dks, dvs) = jax.lax.scan(key_block, dq0, (jnp.arange(n), _key_blocks(block, k, v, valid, segments)))
    dq = _unblock(dq).reshape(b, t, h, d).astype(q.dtype)
    return dq, _unblock(dks).astype(k.dtype), _unblock(dvs).astype(v.dtype), None, None, None


_blocks.defvjp(_blocks_fwd, _blocks_bwd)
