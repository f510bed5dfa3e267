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

The backward is a second ring (`jax.custom_vjp`): it recomputes each chunk pair's scores from the saved
queries, keys, values, output and per-query log-sum-exp, and passes each key/value block around the
ring together with the gradients of that block's keys and values, which arrive back at their owner after
c steps. Autodiff of the forward loop would instead save every visited K/V block and score block, i.e.
all keys/values of the layer and a [T / c, T] score matrix per head.

**Causal load imbalance, and zig-zag order.** With contiguous blocks (device i: tokens
[i T/c, (i+1) T/c)) a causal mask unbalances the ring: device 0's queries see only its own block, device
c-1's see all c, and since every step waits for the slowest device, skipping the wholly masked blocks
saves the idle devices' work but not time. So by default (`zigzag`, where 2c divides T) each device
first trades half its block so that it holds chunks i and 2c-1-i of 2c (two collective permutes of half
a block each for q, k, v and the masks, and two for the output after), and attends chunk pair by chunk
pair, skipping (`lax.cond`) the pairs wholly in the future: then every device computes 2 of the 4 chunk
pairs of every step (3 of its own block), and the ring's attention critical path is (2c + 1) / 4c of the
contiguous one's, about half. The trade costs, per layer and token, half of q, k, v and the output
((heads + kv_heads) head-widths against the ring's 2 (c - 1) kv_heads): linear in T / c where the
attention it halves grows with T^2 / c, so it pays for long sequences, the reason to split them at all.
The backward does the same (the trades are differentiated as permutes). Which slots a device's tokens
hold travels with each key/value block, so the masks are the same code in both orders. Keeping the whole
forward in zig-zag order (tokens permuted once at the embedding) would save the per-layer trades; it is
not done here.

What the dense path of `transformer.Attention` computes, this reproduces: scores in float32 scaled by
1/sqrt(head_dim) (or `attention_scale`), soft-capped, masked by causal order of global slots, the key
padding mask, packed `segment_ids` (never across a segment), the sliding window of local layers (a
traced flag where local and global layers alternate in one scanned body), every query attending to
itself at least (a padding query's output is finite garbage), grouped-query heads (kv_heads < heads).
Only forwards without a KV cache take this path; prefill and decode keep dense attention (generation is
never context-parallel: `planner.plan.layout_misfit` refuses it). Under pipeline stages the ring runs in
each stage's layers: a `shard_map` over the context axis under `models.pipeline.gpipe`'s `vmap` over the
stage axis.
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


def layer_window(config: ModelConfig, local: bool | jax.Array) -> jax.Array | None:
    """The sliding window of a layer (`local`: a Python bool or a traced flag) as an int32 scalar, or None
    where it attends globally; a traced global layer gets a window no sequence reaches."""
    if config.sliding_window is None or local is False:
        return None
    window = config.sliding_window if local is True else jnp.where(local, config.sliding_window, _NO_WINDOW)
    return jnp.asarray(window, jnp.int32)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_valid: jax.Array,
    segment_ids: jax.Array | None,
    config: ModelConfig,
    local: bool | jax.Array,
    zigzag: bool = True,
) -> jax.Array:
    """Attention of `q` [B, T, heads, D] over `k`, `v` [B, T, kv_heads, D] (rotated, not cached), with
    the sequence split over the mesh axes the current activation rules give the "length" axis (see the
    module docstring); `key_valid` [B, T] the padding mask, `segment_ids` [B, T] packed sequences or
    None, `local` whether the layer attends through the sliding window (a Python bool or a traced flag).
    `zigzag`: balance the causal work (module docstring) where 2 x the degree divides T.
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
    window = layer_window(config, local)
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
        has_segments=segment_ids is not None, has_window=window is not None,
        zigzag=zigzag and t % (2 * ways) == 0)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=qspec, check_vma=False)
    return mapped(*args)


def _ring_shard(q, k, v, valid, *rest, axis_name, ways: int, config: ModelConfig, has_segments: bool,
                has_window: bool, zigzag: bool):
    """One device's part: its query block against every key/value block around the ring; with `zigzag`
    the device's tokens are first exchanged for chunks i and 2c-1-i (and the output exchanged back)."""
    rest = list(rest)
    segments = rest.pop(0) if has_segments else None
    window = rest.pop(0) if has_window else None
    st = _Statics(axis_name, ways, config, 2 if zigzag else 1)
    me = jax.lax.axis_index(axis_name)
    n = q.shape[1]
    if not zigzag:
        slots = me * n + jnp.arange(n)
        return _ring(st, q, k, v, valid, segments, window, slots)
    half = n // 2
    slots = jnp.concatenate([me * half + jnp.arange(half), (2 * ways - 1 - me) * half + jnp.arange(half)])
    q, k, v, valid, segments = _to_zigzag((q, k, v, valid, segments), st)
    return _from_zigzag(_ring(st, q, k, v, valid, segments, window, slots), st)


def _to_zigzag(tree, st: "_Statics"):
    """Contiguous blocks (device i: chunks 2i and 2i+1 of 2c) -> zig-zag (device i: chunks i and 2c-1-i),
    along axis 1 of every array of `tree`: two collective permutes of half a block each. Chunk j goes to
    device j (j < c) or 2c-1-j; each permute carries one chunk of every device to distinct devices."""
    c = st.ways
    dest = lambda j: j if j < c else 2 * c - 1 - j  # noqa: E731
    me = jax.lax.axis_index(st.axis_name)
    even = me % 2 == 0  # device d's chunk d arrives with the first halves when d is even

    def move(x):
        h = x.shape[1] // 2
        first = jax.lax.ppermute(x[:, :h], st.axis_name, [(i, dest(2 * i)) for i in range(c)])
        second = jax.lax.ppermute(x[:, h:], st.axis_name, [(i, dest(2 * i + 1)) for i in range(c)])
        return jnp.concatenate([jnp.where(even, first, second), jnp.where(even, second, first)], axis=1)

    return jax.tree_util.tree_map(move, tree)


def _from_zigzag(x, st: "_Statics"):
    """The inverse of `_to_zigzag` (device d's chunk j goes home to device j // 2, half j % 2)."""
    c = st.ways
    me = jax.lax.axis_index(st.axis_name)
    even = me % 2 == 0
    h = x.shape[1] // 2
    low, high = x[:, :h], x[:, h:]  # chunks d and 2c-1-d: the even one is d's when d is even
    chunk_even = [d if d % 2 == 0 else 2 * c - 1 - d for d in range(c)]
    chunk_odd = [2 * c - 1 - d if d % 2 == 0 else d for d in range(c)]
    home_even = jax.lax.ppermute(jnp.where(even, low, high), st.axis_name,
                                 [(d, chunk_even[d] // 2) for d in range(c)])
    home_odd = jax.lax.ppermute(jnp.where(even, high, low), st.axis_name,
                                [(d, chunk_odd[d] // 2) for d in range(c)])
    return jnp.concatenate([home_even, home_odd], axis=1)


class _Statics:
    """The ring's static parameters (hashable, so `custom_vjp` can take them as a non-differentiable
    argument); `parts`: the chunks a device's block is made of (2 in zig-zag order), attended to
    chunk by chunk so that a chunk pair wholly masked is skipped."""

    def __init__(self, axis_name, ways, config, parts):
        self.axis_name, self.ways, self.config, self.parts = axis_name, ways, config, parts
        self._key = (axis_name, ways, config, parts)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Statics) and self._key == other._key


def _scale(s: jax.Array, config: ModelConfig) -> jax.Array:
    """Scores scaled exactly as the dense path does (a division where it divides: the same rounding)."""
    if config.query_pre_attn_scalar is None:
        return s / math.sqrt(config.dim_per_head)
    return s * config.attention_scale


def _mask(q_slot, k_slot, valid_k, seg_q, seg_k, window):
    """[B, 1, 1, tq, tk]: which keys (global slots `k_slot`) each query (`q_slot`) may attend to, as the
    dense path decides: causal order, the key padding mask, the window, the query's own segment, and
    always itself."""
    qs, ks = q_slot[None, :, None], k_slot[None, None, :]
    allowed = (ks <= qs) & valid_k[:, None, :]
    if window is not None:
        allowed &= qs - ks < window
    if seg_q is not None:
        allowed &= seg_q[:, :, None] == seg_k[:, None, :]
    return (allowed | (ks == qs))[:, None, None]


def _masked(s, allowed):
    """Scores `s` [B, kv_heads, groups, tq, tk] where `allowed` ([B, 1, 1, tq, tk]), -inf elsewhere.

    The mask depends on slots, padding and segments only: for autodiff's partial evaluation a known
    value, the same in every layer, so anything built from it alone (its broadcast over the heads, a
    constant filled to the scores' shape) would be computed once and kept for the backward, stacked
    over the ring's steps (~7 GiB per device at context 8, 16k tokens). Tied to the scores first (a
    NaN score, only, allows its row: its output is NaN either way), the mask is only ever broadcast in
    the step that uses it, and what is kept is the small [B, 1, 1, tq, tk] mask per chunk pair."""
    live = allowed | jnp.isnan(s[:1, :1, :1, :1, :1])
    return s + jnp.where(live, 0.0, -jnp.inf)


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


def _split(x, parts: int, axis: int = 1) -> list:
    """`x` in `parts` equal chunks along `axis` ([None] * parts for None)."""
    return [None] * parts if x is None else jnp.split(x, parts, axis=axis)


def _split_block(blk, parts: int) -> list:
    """A travelling block (keys, values, key mask, key segments, key slots) in chunks, each a list."""
    k, v, valid, segments, slots = blk
    return [_split(k, parts), _split(v, parts), _split(valid, parts), _split(segments, parts),
            _split(slots, parts, 0)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(st: _Statics, q, k, v, valid, segments, window, slots):
    return _ring_fwd(st, q, k, v, valid, segments, window, slots)[0]


def _attend(st: _Statics, qg, k_blk, v_blk, allowed, m, l, acc):
    """The online softmax's update with one key/value chunk: running maximum `m`, sum `l` and weighted
    values `acc` of every query; a chunk with no allowed key (the future, under the causal mask) changes
    nothing, and its work is skipped."""

    def update(m, l, acc):
        s, _ = _scores(st, qg, k_blk)
        s = _masked(s, allowed)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        # exp(-inf) = 0 where masked; a row with no key yet (m_new = -inf) subtracts 0, never -inf
        p = jnp.exp(s - jnp.where(m_new == -jnp.inf, 0.0, m_new)[..., None])
        # 0 where m was -inf (no key yet); 1 where the row still has none (a chunk in zig-zag order may allow
        # some rows' keys and not others', before those rows met their own slot): never exp(-inf + inf)
        alpha = jnp.exp(jnp.where(m_new == -jnp.inf, 0.0, m - m_new))
        l = alpha * l + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bskh->btkgh", p, v_blk.astype(jnp.float32))
        return m_new, l, acc * jnp.moveaxis(alpha, 3, 1)[..., None] + pv

    return jax.lax.cond(jnp.any(allowed), update, lambda m, l, acc: (m, l, acc), m, l, acc)


def _ring_fwd(st: _Statics, q, k, v, valid, segments, window, slots):
    b, tq, h, d = q.shape
    kvh, parts = k.shape[2], st.parts
    qs, q_slots, q_segs = _split(_group(q, kvh), parts), _split(slots, parts, 0), _split(segments, parts)

    def attend_block(stats, blk):
        ks, vs, valids, segs, slot_k = _split_block(blk, parts)
        out = []
        for i, (m, l, acc) in enumerate(stats):
            for j in range(parts):
                allowed = _mask(q_slots[i], slot_k[j], valids[j], q_segs[i], segs[j], window)
                m, l, acc = _attend(st, qs[i], ks[j], vs[j], allowed, m, l, acc)
            out.append((m, l, acc))
        return out

    def step(carry, _):
        stats, blk = carry
        return (attend_block(stats, blk), _shift(blk, st)), None

    stat_shape = (b, kvh, h // kvh, tq // parts)
    stats = [(jnp.full(stat_shape, -jnp.inf, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
              jnp.zeros(x.shape, jnp.float32)) for x in qs]
    # c blocks, passed on c - 1 times: the loop attends and passes, the last block is attended after it
    (stats, blk), _ = jax.lax.scan(step, (stats, (k, v, valid, segments, slots)), None, length=st.ways - 1)
    stats = attend_block(stats, blk)
    out = jnp.concatenate([acc / jnp.moveaxis(l, 3, 1)[..., None] for _, l, acc in stats], axis=1)
    out = out.reshape(b, tq, h, d).astype(v.dtype)
    # [B, kv_heads, groups, tq]; every query attends at least to itself: finite
    lse = jnp.concatenate([m + jnp.log(l) for m, l, _ in stats], axis=-1)
    return out, (q, k, v, valid, segments, window, slots, out, lse)


def _block_grads(st: _Statics, qg, dog, delta, lse, k_blk, v_blk, allowed, dq, dk, dv):
    """One query chunk's and one key/value chunk's share of the gradients (skipped when wholly masked)."""
    cap = st.config.attn_logit_softcap

    def grads(dq, dk, dv):
        s, th = _scores(st, qg, k_blk)
        p = jnp.exp(_masked(s, allowed) - lse[..., None])  # 0 where masked
        dv = dv + jnp.einsum("bkgts,btkgh->bskh", p, dog)
        dp = jnp.einsum("btkgh,bskh->bkgts", dog, v_blk.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        if cap is not None:
            ds = ds * (1.0 - th * th)
        ds = _scale(ds, st.config)
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, k_blk.astype(jnp.float32))
        dk = dk + jnp.einsum("bkgts,btkgh->bskh", ds, qg.astype(jnp.float32))
        return dq, dk, dv

    return jax.lax.cond(jnp.any(allowed), grads, lambda *a: a, dq, dk, dv)


def _ring_bwd(st: _Statics, res, dout):
    q, k, v, valid, segments, window, slots, out, lse = res
    b, tq, h, d = q.shape
    kvh, parts = k.shape[2], st.parts
    qg = _group(q, kvh)
    dog = _group(dout, kvh).astype(jnp.float32)
    # D_i = sum_h dO_i . O_i: the softmax backward's row term, [B, kv_heads, groups, tq]
    delta = jnp.moveaxis(jnp.sum(dog * _group(out, kvh).astype(jnp.float32), axis=-1), 1, 3)
    qs, dogs, q_slots, q_segs = _split(qg, parts), _split(dog, parts), _split(slots, parts, 0), _split(segments, parts)
    deltas, lses = _split(delta, parts, 3), _split(lse, parts, 3)

    def step(carry, _):
        dqs, blk, (dk_blk, dv_blk) = carry
        ks, vs, valids, segs, slot_k = _split_block(blk, parts)
        dks, dvs = _split(dk_blk, parts), _split(dv_blk, parts)
        for i in range(parts):
            for j in range(parts):
                allowed = _mask(q_slots[i], slot_k[j], valids[j], q_segs[i], segs[j], window)
                dqs[i], dks[j], dvs[j] = _block_grads(st, qs[i], dogs[i], deltas[i], lses[i], ks[j], vs[j],
                                                      allowed, dqs[i], dks[j], dvs[j])
        # the block and its gradients move on together; after c passes the gradients are home
        grads = (jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1))
        return (dqs, _shift(blk, st), _shift(grads, st)), None

    init = ([jnp.zeros(x.shape, jnp.float32) for x in qs], (k, v, valid, segments, slots),
            (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
    (dqs, _, (dk, dv)), _ = jax.lax.scan(step, init, None, length=st.ways)
    dq = jnp.concatenate(dqs, axis=1).reshape(b, tq, h, d).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
