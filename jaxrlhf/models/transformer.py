"""Decoder-only LLaMA-family transformer in Flax NNX, with a KV cache.

Other families (Qwen2/3, Mistral, Gemma 2/3) are Llama with switches that `ModelConfig` holds as fields
(q/k norms, norm offset, embedding scale, post-norms, GeGLU, soft-caps, alternating local and global
layers with their own rope base; docs/models.md): the forward reads the switches, never family names.

One attention code path serves training (no cache), prefill and decode:
queries sit at cache slots [index, index + T) and may attend to any earlier
slot that holds a real token. Left padding therefore changes nothing for the
unpadded tokens, as long as `positions` count only real tokens
(`positions_from_mask`).

Parameters carry `logical_axes` metadata (see `axes.py`); projections are
stored with separate head axes ([embed, heads, head_dim]) so tensor
parallelism can shard heads without reshapes.

The decoder layers are one module whose parameters are stacked along a
leading "layers" axis, run by `jax.lax.scan`: beyond `config.UNROLL_MAX_LAYERS`
(per platform) the compiled program holds one layer body whatever the depth, so
compile time does not grow with `num_layers`; shallower models unroll the scan
(faster to run; `ModelConfig.unroll_layers`). Pipeline parallelism splits that
axis into stages: under a placement with stage > 1 the layers run as a GPipe
schedule (`pipeline.py`).
The KV cache is stacked the same way and carried through the scan, so each
layer writes only its new slots in place. A paged cache (`PagedKVCache`, the
continuous engine's) is read through each row's block table instead and left
unchanged by the forward, which returns the new keys/values for `write_pages`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import axes as ax
from jaxrlhf.models import blockwise, context, lora, moe, pipeline
from jaxrlhf.models.config import ModelConfig

_NEG_INF = -1e30  # finite, so fully masked rows (padding) never produce NaN


def _param(rngs: nnx.Rngs, init: Callable, shape: tuple[int, ...], names: ax.LogicalAxes, dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=names)


_normal = jax.nn.initializers.normal(stddev=0.02)
_zeros = jax.nn.initializers.zeros
KV = tuple[jax.Array, jax.Array]  # the stacked cache keys and values, [layers, batch, slots, kv_heads, head_dim]


@struct.dataclass
class KVCache:
    """Keys/values of every layer for `max_len` slots, which slots hold real tokens, and the next slot:
    one `index` for every row (prefill, the static decode loop) or one per row ([batch]: the continuous
    engine's slots, each at its own length). `k`/`v` are stacked over layers, or a tuple of one array per
    layer (`per_layer`, read by forwards with `layers_split`)."""

    # kv_heads before slots: the layout attention's batched matmuls read without a transposed copy
    k: Float[Array, "layers batch kv_heads slots head_dim"] | tuple[Float[Array, "batch kv_heads slots head_dim"], ...]
    v: Float[Array, "layers batch kv_heads slots head_dim"] | tuple[Float[Array, "batch kv_heads slots head_dim"], ...]
    valid: Bool[Array, "batch slots"]
    index: Int[Array, ""] | Int[Array, " batch"]

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or config.jnp_dtype
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.dim_per_head)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch, max_len), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def repeat_rows(self, n: int) -> "KVCache":
        """Each row's cache `n` times over, copies adjacent (a prompt prefilled once for its n samples)."""
        if isinstance(self.k, tuple):
            raise ValueError("repeat_rows takes a stacked cache (before per_layer)")
        return self.replace(k=jnp.repeat(self.k, n, axis=1), v=jnp.repeat(self.v, n, axis=1),
                            valid=jnp.repeat(self.valid, n, axis=0),
                            index=self.index if jnp.ndim(self.index) == 0 else jnp.repeat(self.index, n))

    def per_layer(self) -> "KVCache":
        """The same cache with one array per layer, for a decode loop: a layer then reads its keys and
        values in place, where a stacked cache copies the layer's slice out at every token (XLA:CPU does;
        a GRPO generate call of 128 rows took 0.79 s with the stacked cache, 0.65 s with one per layer)."""
        if isinstance(self.k, tuple):
            return self
        return self.replace(k=tuple(self.k), v=tuple(self.v))


@struct.dataclass
class PagedKVCache:
    """A paged cache (the continuous engine's): keys/values live in pages of a pool shared by the rows
    of each batch shard, and a row's block table lists the pages that hold its columns in order
    (prompt pages, which rows of a group share, then response pages). A table entry past the pool
    (>= pages) is unassigned: reads of it are masked by `valid`, writes to it are dropped.

    Rows are grouped by shard: row b = shard * rows_per_shard + j reads only its shard's pool, so a
    batch-sharded call never reads another device's pages. A forward reads the pool and leaves it
    unchanged: it returns the new tokens' keys/values in `new_k` / `new_v`, and `write_pages` stores
    them (the engine writes once per step, outside the branch that picked the step's width)."""

    k: Float[Array, "layers shards pages kv_heads page head_dim"]
    v: Float[Array, "layers shards pages kv_heads page head_dim"]
    valid: Bool[Array, "batch slots"]  # slots = the columns a row attends over (prompt + response)
    index: Int[Array, " batch"]  # each row's next column
    table: Int[Array, "shards rows_per_shard table"]  # page ids of each row's columns, page by page
    new_k: Float[Array, "layers batch length kv_heads head_dim"] | None = None
    new_v: Float[Array, "layers batch length kv_heads head_dim"] | None = None

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def positions_from_mask(mask: Bool[Array, "batch length"]) -> Int[Array, "batch length"]:
    """Rotary positions that count real tokens only (0 for leading padding)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def rope_inv_frequencies(config: ModelConfig, local: bool = False) -> Float[Array, " half_head_dim"]:
    """Inverse rotary frequencies, with Llama-3 style or linear scaling when configured; `local`: those of
    the sliding-window layers (base `local_rope_theta`, never scaled)."""
    dim = config.dim_per_head
    theta = config.local_rope_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if config.rope_linear_factor is not None and not local:
        return inv / config.rope_linear_factor
    s = config.rope_scaling
    if s is None or local:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_mid, mid, scaled)


RopeTables = tuple[jax.Array, jax.Array]  # (cos, sin), each float32 [batch, length, 1, head_dim / 2]
# The global layers' tables and the local (sliding-window) layers' own, or None where they rotate alike.
Ropes = tuple[RopeTables, RopeTables | None]


def rope_tables(
    positions: Int[Array, "batch length"], inv_freq: Float[Array, " half_head_dim"], num_positions: int
) -> RopeTables:
    """The cosines and sines of every token's rotation angles, for positions below `num_positions`.

    Every layer rotates its queries and keys by the same angles. Written as `cos(positions * inv_freq)`,
    XLA:CPU fuses the sine and cosine into every rotation and its gradient and evaluates them once per
    element of the rotated [tokens, heads, head_dim] array, in every layer (~10 % of a 23.6M-parameter
    train call's thread time). A forward over several tokens therefore computes them once, for positions
    0..num_positions-1, and looks every token up: a gather is what XLA fuses into the rotations. Positions
    past the table (never a real token's) read its last entry. A decode step (one token per row) computes
    its few angles directly."""
    if positions.shape[1] == 1:
        angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, 1, D/2]
        return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    angles = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq  # [num_positions, D/2]
    return tuple(jnp.take(table, positions, axis=0, mode="clip")[:, :, None, :]
                 for table in (jnp.cos(angles), jnp.sin(angles)))


def apply_rope(
    x: Float[Array, "batch length heads head_dim"], rope: RopeTables
) -> Float[Array, "batch length heads head_dim"]:
    """Rotate pairs (i, i + head_dim/2), the HF "rotate_half" convention; `rope` from `rope_tables`."""
    cos, sin = rope
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _float32_product(product: Callable, a: jax.Array, b: jax.Array) -> jax.Array:
    return product(a, b, preferred_element_type=jnp.float32)


def _float32_product_fwd(product, a, b):
    return _float32_product(product, a, b), (a, b)


def _float32_product_bwd(product, residuals, g):
    a, b = residuals
    _, backward = jax.vjp(product, a, b)  # the product in the inputs' dtype, float32 accumulation
    return backward(g.astype(a.dtype))


_float32_product.defvjp(_float32_product_fwd, _float32_product_bwd)


def float32_product(product: Callable, a: jax.Array, b: jax.Array) -> jax.Array:
    """`product(a, b)` (a matmul or einsum of two same-dtype operands) with a float32 result, whose backward
    runs in the operands' dtype. Plain autodiff of a product with a float32 result hands its transpose a
    float32 cotangent, so a bfloat16 model's two backward matmuls run in float32 (TF32 on a GPU): for the
    vocabulary projection, 14 % of a 1.2B model's GPU train call. Here the cotangent is rounded to the
    operands' dtype first, as every other activation gradient of a bfloat16 model is; float32 operands
    take the plain path (no rounding anywhere)."""
    if a.dtype == jnp.float32:
        return product(a, b, preferred_element_type=jnp.float32)
    return _float32_product(product, a, b)


def dense(x: Float[Array, "batch length in"], w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """`x` contracted with the leading dim of `w` ([in, *out]), computed as one 2-D matmul over all tokens.

    The same math as `jnp.einsum("bti,i...->bt...")`, but written with the tokens flattened: XLA:CPU computes
    the weight gradient of a matmul with two token dims (batch, length) through a transposed copy of the
    output gradient, which made a training step ~1.4x slower; a 2-D matmul's gradient is one plain matmul.
    The reshapes are free (row-major), and sharding follows (batch is the major dim of the flattened tokens).
    """
    b, t, d = x.shape
    out_shape = w.shape[1:]
    x2, w2 = x.reshape(b * t, d), w.reshape(d, -1)
    if preferred_element_type == jnp.float32:
        y = float32_product(jnp.matmul, x2, w2)
    else:
        y = jnp.matmul(x2, w2, preferred_element_type=preferred_element_type)
    return y.reshape(b, t, *out_shape)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (the hidden size, or `head_dim` for the per-head q/k norms), scaled by
    `config.norm_offset + weight`; the weight starts where that scale is 1."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, axis: str = ax.EMBED):
        self.eps = config.rms_norm_eps
        self.offset = config.norm_offset
        size = config.dim_per_head if axis == ax.HEAD_DIM else config.hidden_size
        init = jax.nn.initializers.constant(1.0 - self.offset)
        self.weight = _param(rngs, init, (size,), (axis,), config.jnp_param_dtype)

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        scale = self.weight.value.astype(jnp.float32)
        if self.offset:
            scale = self.offset + scale
        return (scale * xf).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (Gemma's soft-capping of attention scores and logits); `x` when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _is_local(config: ModelConfig, layer: Int[Array, ""] | int) -> bool | jax.Array:
    """Whether `layer` attends through the sliding window: a Python bool when every layer does the same
    (the program then holds one kind of attention) or the layer index is a Python int (a decode loop over
    split layers), else looked up from `config.local_layers` (a scanned or pipelined layer)."""
    kinds = set(config.local_layers)
    if len(kinds) == 1:
        return kinds.pop()
    if isinstance(layer, int):
        return config.local_layers[layer]
    return jnp.asarray(config.local_layers)[layer]


def _layer_rope(ropes: Ropes, local: bool | jax.Array) -> RopeTables:
    """The rotation tables of a local (sliding-window) or global layer."""
    rope, local_rope = ropes
    if local_rope is None or local is False:
        return rope
    if local is True:
        return local_rope
    return tuple(jnp.where(local, lt, gt) for gt, lt in zip(rope, local_rope))


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.dim_per_head
        pd = config.jnp_param_dtype
        self.q = _param(rngs, _normal, (d, h, hd), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), pd)
        self.k = _param(rngs, _normal, (d, kv, hd), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), pd)
        self.v = _param(rngs, _normal, (d, kv, hd), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM), pd)
        self.o = _param(rngs, _normal, (h, hd, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), pd)
        if config.attention_bias:
            self.q_bias = _param(rngs, _zeros, (h, hd), (ax.HEADS, ax.HEAD_DIM), pd)
            self.k_bias = _param(rngs, _zeros, (kv, hd), (ax.KV_HEADS, ax.HEAD_DIM), pd)
            self.v_bias = _param(rngs, _zeros, (kv, hd), (ax.KV_HEADS, ax.HEAD_DIM), pd)
        if config.qk_norm:
            self.q_norm = RMSNorm(config, rngs=rngs, axis=ax.HEAD_DIM)
            self.k_norm = RMSNorm(config, rngs=rngs, axis=ax.HEAD_DIM)
        for name, adapter in lora.adapters(config.lora, "attn", {
            name: (getattr(self, name).value.shape, getattr(self, name).get_metadata()["logical_axes"],
                   2 if name == "o" else 1) for name in ("q", "k", "v", "o")}, rngs).items():
            setattr(self, name, adapter)

    def _project(self, x, name: str):
        dt = self.config.jnp_dtype
        y = dense(x, getattr(self, name).value.astype(dt))
        if self.config.attention_bias:
            y = y + getattr(self, name + "_bias").value.astype(dt)
        return _adapted(self, name, x, y, dt)

    def __call__(
        self,
        x: Float[Array, "batch length embed"],
        ropes: Ropes,
        key_valid: Bool[Array, "batch slots"],
        kv: KV | None,
        layer: Int[Array, ""],
        offset: jax.Array | int,
        segment_ids: Int[Array, "batch length"] | None = None,
        pages: Int[Array, "shards rows_per_shard table"] | None = None,
    ) -> tuple[Float[Array, "batch length embed"], KV | None]:
        """`kv` is the whole stacked cache: only this layer's new slots are written (in place in a loop).
        `pages`: the block tables of a paged cache (`PagedKVCache`); `kv` is then its page pool."""
        cfg = self.config
        local = _is_local(cfg, layer)
        rope = _layer_rope(ropes, local)
        q, k = self._project(x, "q"), self._project(x, "k")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = self._project(x, "v")
        q = ax.constrain(q, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
        b, t = x.shape[:2]
        if kv is None and ax.length_ways() > 1:  # the sequence split over devices: ring attention
            return self._output(context.ring_attention(q, k, v, key_valid, segment_ids, cfg, local), b, t), None
        if kv is None and cfg.attends_blockwise(t):  # long rows: one block of scores at a time
            return self._output(blockwise.blockwise_attention(q, k, v, key_valid, segment_ids, cfg, local), b, t), None
        if kv is not None and pages is not None:  # paged: gather the rows' columns, the new tokens in place
            pool_k, pool_v, new_k, new_v = kv
            kv = (pool_k, pool_v, *(jax.lax.dynamic_update_index_in_dim(c, x.astype(c.dtype), layer, 0)
                                    for c, x in zip((new_k, new_v), (k, v))))
            k, v = (_read_pages(c, layer, pages, key_valid.shape[1], offset, x.astype(c.dtype))
                    for c, x in zip((pool_k, pool_v), (k, v)))
        elif kv is not None and isinstance(kv[0], tuple):  # one array per layer (`KVCache.per_layer`)
            written = [_write_slots(c[layer][None], new, 0, offset)[0] for c, new in zip(kv, (k, v))]
            kv = tuple(c[:layer] + (w,) + c[layer + 1:] for c, w in zip(kv, written))
            k, v = written
        elif kv is not None:  # write the new keys/values into their slots, then read back all of this layer's
            kv = tuple(_write_slots(c, new, layer, offset) for c, new in zip(kv, (k, v)))
            k, v = (jax.lax.dynamic_index_in_dim(c, layer, axis=0, keepdims=False) for c in kv)
        else:  # [B, S, kv_heads, D] -> [B, kv_heads, S, D], as the cache holds them
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
        s = k.shape[2]
        groups = cfg.num_heads // cfg.num_kv_heads
        qg = q.reshape(b, t, cfg.num_kv_heads, groups, cfg.dim_per_head)
        if t == 1:  # decode: batched matrix-vector products (see `_decode_scores`)
            scores = _decode_scores(qg, k.astype(q.dtype))
        else:
            scores = float32_product(functools.partial(jnp.einsum, "btkgh,bksh->bkgts"), qg, k.astype(q.dtype))
        if cfg.query_pre_attn_scalar is None:  # a division, as before the switch: the same rounding
            scores = scores / math.sqrt(cfg.dim_per_head)
        else:
            scores = scores * cfg.attention_scale
        scores = softcap(scores, cfg.attn_logit_softcap)
        q_slot = jnp.reshape(offset, (-1, 1, 1)) + jnp.arange(t)[None, :, None]  # [1 or B, T, 1]
        k_slot = jnp.arange(s)[None, None, :]
        allowed = (k_slot <= q_slot) & key_valid[:, None, :]  # [B, T, S]
        if local is True:
            allowed &= q_slot - k_slot < cfg.sliding_window
        elif local is not False:  # this layer's kind is a traced lookup (local and global layers alternate)
            allowed &= (q_slot - k_slot < cfg.sliding_window) | ~local
        if segment_ids is not None:  # packed rows: attend only within one's own sequence
            allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
        allowed |= k_slot == q_slot  # a padding query attends to itself: finite garbage, never NaN
        scores = jnp.where(allowed[:, None, None], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        if t == 1:
            out = jnp.einsum("bkgs,bksh->bkgh", probs[:, :, :, 0], v)[:, None]
        else:
            out = jnp.einsum("bkgts,bksh->btkgh", probs, v)
        return self._output(out, b, t), kv

    def _output(self, out: Float[Array, "batch length *heads head_dim"], b: int, t: int):
        """The output projection of the attended values (heads and head_dim flattened)."""
        cfg = self.config
        o = self.o.value.astype(cfg.jnp_dtype)
        out = out.reshape(b, t, -1).astype(cfg.jnp_dtype)
        return _adapted(self, "o", out, dense(out, o.reshape(-1, o.shape[-1])), cfg.jnp_dtype)


def _decode_scores(
    qg: Float[Array, "batch 1 kv_heads groups head_dim"], k: Float[Array, "batch kv_heads slots head_dim"]
) -> Float[Array, "batch kv_heads groups 1 slots"]:
    """Attention scores of one query per row, as batched matrix-vector products without the length-1
    query axis: with that axis in the contraction XLA:CPU lays the dot out through transposed copies, which
    made decode attention ~7x slower (3.5 vs 0.5 ms a layer at 128 rows x 48 slots) and over half a
    decode step; the values' contraction gets the same treatment (`Attention.__call__`)."""
    return jnp.einsum("bkgh,bksh->bkgs", qg[:, 0], k, preferred_element_type=jnp.float32)[:, :, :, None]


def _write_slots(
    cache: Float[Array, "layers batch kv_heads slots head_dim"],
    new: Float[Array, "batch length kv_heads head_dim"],
    layer: Int[Array, ""],
    offset: Int[Array, ""] | Int[Array, " batch"],
) -> Float[Array, "layers batch kv_heads slots head_dim"]:
    """Write one layer's new keys (or values) at slots [offset, offset + T): one slice when every row
    shares the offset, a scatter when each row has its own (the continuous engine's slots)."""
    if jnp.ndim(offset) == 0:
        return jax.lax.dynamic_update_slice(cache, new.swapaxes(1, 2)[None].astype(cache.dtype),
                                            (layer, 0, 0, offset, 0))
    b, t = new.shape[:2]
    cols = offset[:, None] + jnp.arange(t)[None, :]  # [B, T]
    return cache.at[layer, jnp.arange(b)[:, None], :, cols, :].set(new.astype(cache.dtype))


def write_pages(
    pool: Float[Array, "layers shards pages kv_heads page head_dim"],
    new: Float[Array, "layers batch length kv_heads head_dim"],
    offset: Int[Array, " batch"],
    pages: Int[Array, "shards rows table"],
) -> Float[Array, "layers shards pages kv_heads page head_dim"]:
    """Store every layer's new keys (or values) at each row's columns [offset, offset + T) in its pages
    (`PagedKVCache.new_k`); a row whose page is unassigned (id past the pool: an idle row) is dropped."""
    shards, per_shard, _ = pages.shape
    t, ps = new.shape[2], pool.shape[4]
    columns = jnp.reshape(offset, (-1, 1)) + jnp.arange(t)[None, :]  # [B, T]
    ids = jnp.take_along_axis(pages.reshape(shards * per_shard, -1), columns // ps, axis=1, mode="clip")
    shard = jnp.broadcast_to(jnp.arange(shards).repeat(per_shard)[:, None], columns.shape)
    # advanced indices (shard, page, offset) on dims 1, 2, 4 around the kv_heads slice: the update is
    # laid out [B, T, layers, kv_heads, head_dim]
    return pool.at[:, shard, ids, :, columns % ps].set(
        jnp.moveaxis(new, 0, 2).astype(pool.dtype), mode="drop")


def _read_pages(
    pool: Float[Array, "layers shards pages kv_heads page head_dim"],
    layer: Int[Array, ""],
    pages: Int[Array, "shards rows table"],
    columns: int,
    offset: Int[Array, " batch"],
    new: Float[Array, "batch length kv_heads head_dim"],
) -> Float[Array, "batch kv_heads slots head_dim"]:
    """One layer's keys (or values) of each row's first `columns` columns in the dense cache's layout:
    its pages gathered in order, with the new tokens (`new`, not yet in the pool) at [offset, offset + T).
    Unassigned pages read a clipped page: masked by the caller."""
    shards, per_shard, width = pages.shape
    shard = jnp.broadcast_to(jnp.arange(shards)[:, None, None], pages.shape)
    x = pool[layer].at[shard, pages].get(mode="clip")  # [shards, rows, table, kv_heads, page, head_dim]
    kvh, page, hd = pool.shape[3], pool.shape[4], pool.shape[5]
    x = jnp.moveaxis(x, 3, 2).reshape(shards * per_shard, kvh, width * page, hd)[:, :, :columns]
    rows = jnp.arange(x.shape[0])
    start = jnp.broadcast_to(jnp.reshape(offset, (-1,)), rows.shape)
    # one scatter of the new columns (not a select over every column, nor one scatter per column: an
    # extend's 257 columns unrolled took XLA:CPU 50 s to compile); the advanced indices (rows, columns) lead
    # the update's layout: [B, T, kv_heads, head_dim], `new`'s own
    columns = start[:, None] + jnp.arange(new.shape[1])[None, :]
    return x.at[rows[:, None], :, columns, :].set(new.astype(x.dtype), mode="drop")


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.dtype = config.jnp_dtype
        self.activation = config.mlp_activation
        d, f, pd = config.hidden_size, config.intermediate_size, config.jnp_param_dtype
        self.gate = _param(rngs, _normal, (d, f), (ax.EMBED, ax.MLP), pd)
        self.up = _param(rngs, _normal, (d, f), (ax.EMBED, ax.MLP), pd)
        self.down = _param(rngs, _normal, (f, d), (ax.MLP, ax.EMBED), pd)
        for name, adapter in lora.adapters(config.lora, "mlp", {
            name: (getattr(self, name).value.shape, getattr(self, name).get_metadata()["logical_axes"], 1)
            for name in ("gate", "up", "down")}, rngs).items():
            setattr(self, name, adapter)

    def __call__(self, x: Float[Array, "batch length embed"]) -> Float[Array, "batch length embed"]:
        dt = self.dtype
        g = _adapted(self, "gate", x, dense(x, self.gate.value.astype(dt)), dt)
        u = _adapted(self, "up", x, dense(x, self.up.value.astype(dt)), dt)
        h = ax.constrain(_ACTIVATIONS[self.activation](g) * u, (ax.BATCH, ax.LENGTH, ax.MLP))
        return _adapted(self, "down", h, dense(h, self.down.value.astype(dt)), dt)


def _adapted(module: nnx.Module, name: str, x: jax.Array, y: jax.Array, dtype) -> jax.Array:
    """`y` (= x @ W) plus the projection's LoRA update when `module` has an adapter for it."""
    adapter = getattr(module, name + lora.SUFFIX, None)
    return y if adapter is None else y + adapter(x, dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: `input_norm` before attention, `post_attn_norm` before the MLP (HF Llama's
    `post_attention_layernorm`); with `post_norms` also `attn_out_norm` / `mlp_out_norm` on each branch's
    output before its residual add (Gemma's `post_attention_layernorm` / `post_feedforward_layernorm`).
    With `num_experts` the MLP is a mixture of experts (`moe.SparseMLP`). Returns (x, kv, router logits):
    the router logits [batch, length, experts] of a sparse MLP, None for a dense one."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.post_attn_norm = RMSNorm(config, rngs=rngs)
        self.sparse = config.num_experts > 0
        self.mlp = moe.SparseMLP(config, rngs=rngs) if self.sparse else MLP(config, rngs=rngs)
        self.post_norms = config.post_norms
        if config.post_norms:
            self.attn_out_norm = RMSNorm(config, rngs=rngs)
            self.mlp_out_norm = RMSNorm(config, rngs=rngs)

    def __call__(self, x, ropes, key_valid, kv, layer, offset, segment_ids=None, pages=None):
        h, kv = self.attn(self.input_norm(x), ropes, key_valid, kv, layer, offset, segment_ids, pages)
        if self.post_norms:
            h = self.attn_out_norm(h)
        x = x + h
        h = self.post_attn_norm(x)
        h = self.mlp(h, layer) if self.sparse else self.mlp(h)  # the layer's index: its replayed routing
        h, router_logits = h if self.sparse else (h, None)
        if self.post_norms:
            h = self.mlp_out_norm(h)
        x = x + h
        return ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED)), kv, router_logits


REMAT_POLICIES = ("none", "full", "dots")
_CHECKPOINT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projection / MLP matmul outputs
}


def remat_policy(remat: str | bool) -> str:
    """Normalise a remat setting; the booleans of older configs read as "full" / "none"."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat {remat!r} is not one of {REMAT_POLICIES} (or a boolean)")
    return remat


def stacked_layers(config: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """`num_layers` decoder layers as one module, each parameter with a leading "layers" axis."""

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS, "logical_axes": ax.LAYERS})
    def create(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, rngs=rngs)

    return create(rngs)


class Transformer(nnx.Module):
    """The trunk: embeddings, decoder layers (stacked, scanned), final norm. Returns hidden states.

    `remat` ("none", "full", "dots") rematerialises the scanned layer body in
    forwards without a cache (training); prefill and decode never remat.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat: str | bool = "none"):
        self.config = config
        self.remat = remat_policy(remat)
        self.embed = _param(
            rngs, _normal, (config.vocab_size, config.hidden_size), (ax.VOCAB, ax.EMBED), config.jnp_param_dtype
        )
        self.layers = stacked_layers(config, rngs)
        self.final_norm = RMSNorm(config, rngs=rngs)

    def __call__(
        self,
        tokens: Int[Array, "batch length"],
        positions: Int[Array, "batch length"],
        mask: Bool[Array, "batch length"],
        cache: KVCache | PagedKVCache | None = None,
        segment_ids: Int[Array, "batch length"] | None = None,
        layers_split: Sequence[nnx.State] | None = None,
    ) -> tuple[Float[Array, "batch length embed"], KVCache | PagedKVCache | None]:
        """Hidden states; `segment_ids` (packed rows, no cache) keeps attention inside each sequence.

        `layers_split` (from `split_layers`) runs the layers one by one from weights already split
        out of the stack, instead of scanning the stack: a decode loop splits them once, before its
        first token, where a scan would copy every layer's weights out of the stack at every token
        (XLA:CPU does, and does not hoist the copies out of the token loop)."""
        cfg = self.config
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed sequences) cannot be combined with a KV cache")
        length = tokens.shape[1]
        ways = ax.length_ways() if cache is None else 1
        if ways > 1 and length % (2 * ways):
            # context parallelism: a batch's length (its trimmed width) need not divide over the context
            # devices; padding columns (masked: no real token attends to them) make it a multiple of 2c,
            # which also lets the ring run in its balanced zig-zag order; the outputs are cut back
            pad = ((0, 0), (0, -length % (2 * ways)))
            tokens, positions, mask = jnp.pad(tokens, pad), jnp.pad(positions, pad), jnp.pad(mask, pad)
            segment_ids = None if segment_ids is None else jnp.pad(segment_ids, pad)
        x = jnp.take(self.embed.value, tokens, axis=0)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
        x = x.astype(cfg.jnp_dtype)
        x = ax.constrain(x, (ax.BATCH, ax.LENGTH, ax.EMBED))
        mask = mask.astype(bool)
        if cache is None:
            key_valid, offset, kv = mask, 0, None
        else:
            key_valid = _write_valid(cache.valid, mask, cache.index)
            offset, kv = cache.index, (cache.k, cache.v)
        pages = cache.table if isinstance(cache, PagedKVCache) else None
        # a position < its slot; local layers rotate by their own base where the config gives one
        rope = rope_tables(positions, rope_inv_frequencies(cfg), key_valid.shape[1])
        local_rope = None
        if cfg.local_rope_theta is not None and any(cfg.local_layers):
            local_rope = rope_tables(positions, rope_inv_frequencies(cfg, local=True), key_valid.shape[1])
        ropes = (rope, local_rope)
        if cache is not None and isinstance(cache.k, tuple) and layers_split is None:
            raise ValueError("a per-layer KV cache (KVCache.per_layer) is read by a forward with layers_split")
        if pages is not None:  # the pool is read only; the new tokens' keys/values are collected per layer
            new = jnp.zeros((cfg.num_layers, *tokens.shape, cfg.num_kv_heads, cfg.dim_per_head), cache.k.dtype)
            kv = (*kv, new, new)
        graphdef, layer_states = nnx.split(self.layers)
        remat = self.remat != "none" and cache is None

        if pipeline.is_pipelined():
            if cache is not None:
                raise ValueError("generation (a KV-cache forward) is never pipelined; use a layout with stage=1")

            def layer(indexed_state, x, rows):
                layer_state, index = indexed_state
                rope_rows, valid, seg = rows
                return nnx.merge(graphdef, layer_state)(x, rope_rows, valid, None, index, 0, seg)[0]

            if remat:
                layer = jax.checkpoint(layer, policy=_CHECKPOINT_POLICIES[self.remat], prevent_cse=False)
            indexed = (layer_states, jnp.arange(cfg.num_layers))  # each layer's index travels with its weights
            x = pipeline.gpipe(layer, indexed, x, (ropes, key_valid, segment_ids),
                               stages=pipeline.current_stages(), microbatches=pipeline.current_microbatches())
        elif layers_split is not None:
            if len(layers_split) != cfg.num_layers:
                raise ValueError(f"layers_split holds {len(layers_split)} layers; the model has {cfg.num_layers}")
            routers = []
            for i, layer_state in enumerate(layers_split):
                x, kv, router_logits = nnx.merge(graphdef, layer_state)(
                    x, ropes, key_valid, kv, i, offset, segment_ids, pages)
                routers.append(router_logits)
            if cfg.num_experts:
                moe.record(routers)  # stacked only where recorded
        else:

            def step(carry, xs):
                x, kv = carry
                layer_state, layer = xs
                x, kv, router_logits = nnx.merge(graphdef, layer_state)(
                    x, ropes, key_valid, kv, layer, offset, segment_ids, pages
                )
                return (x, kv), router_logits  # None for dense layers

            if remat:
                step = jax.checkpoint(step, policy=_CHECKPOINT_POLICIES[self.remat], prevent_cse=False)
            (x, kv), routers = jax.lax.scan(step, (x, kv), (layer_states, jnp.arange(cfg.num_layers)),
                                            unroll=cfg.unrolls_layers)
            if cfg.num_experts:  # every layer's router logits, for `moe.forward_with_router_logits`
                moe.record(routers)
        x = self.final_norm(x)[:, :length]
        if cache is not None:
            new_kv = dict(new_k=kv[2], new_v=kv[3]) if pages is not None else {}
            cache = cache.replace(k=kv[0], v=kv[1], valid=key_valid, index=cache.index + tokens.shape[1], **new_kv)
        return x, cache


def _write_valid(
    valid: Bool[Array, "batch slots"], mask: Bool[Array, "batch length"], index: Int[Array, ""] | Int[Array, " batch"]
) -> Bool[Array, "batch slots"]:
    """Mark the new tokens' slots in the cache's validity mask (shared or per-row index, as `_write_slots`)."""
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice_in_dim(valid, mask, index, axis=1)
    b, t = mask.shape
    return valid.at[jnp.arange(b)[:, None], index[:, None] + jnp.arange(t)[None, :]].set(mask)


def split_layers(model: nnx.Module) -> list[nnx.State]:
    """Each decoder layer's weights sliced out of the stack once (for `layers_split`); works on any model
    with a `Transformer` trunk (`model.model`) or on the trunk itself."""
    trunk = model if isinstance(model, Transformer) else model.model
    _, stacked = nnx.split(trunk.layers)
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], stacked) for i in range(trunk.config.num_layers)]


def read_positions(
    h: Float[Array, "rows length embed"], at: Int[Array, "shards slots *n"]
) -> Float[Array, "shards_slots *n embed"]:
    """The hidden states at flat positions `at` (row * length + column), each shard reading its own
    block of rows: `h`'s rows are `shards` consecutive blocks (a packed batch, split over the data axes
    block by block), and `at[j]` indexes block j only, so the gather stays on the shard's devices.
    Returns [shards * slots, *n, embed]."""
    shards, d = at.shape[0], h.shape[-1]
    blocks = h.reshape(shards, -1, d)
    flat = at.reshape(shards, -1)
    out = jnp.take_along_axis(blocks, flat[..., None], axis=1)
    return out.reshape(shards * at.shape[1], *at.shape[2:], d)


class CausalLM(nnx.Module):
    """Actor / reference model: trunk + LM head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat: str | bool = "none"):
        self.config = config
        self.model = Transformer(config, rngs=rngs, remat=remat)
        if not config.tie_word_embeddings:
            self.lm_head = _param(
                rngs, _normal, (config.hidden_size, config.vocab_size), (ax.EMBED, ax.VOCAB),
                config.jnp_param_dtype,
            )

    def __call__(
        self,
        tokens: Int[Array, "batch length"],
        positions: Int[Array, "batch length"],
        mask: Bool[Array, "batch length"],
        cache: KVCache | PagedKVCache | None = None,
        segment_ids: Int[Array, "batch length"] | None = None,
        logits_from: int = 0,
        layers_split: Sequence[nnx.State] | None = None,
        read_at: Int[Array, "shards slots n"] | None = None,
    ) -> tuple[Float[Array, "batch out vocab"], KVCache | PagedKVCache | None]:
        """Logits of positions `logits_from`.. (static; -1 = the last only): the full-vocabulary
        logits are the largest activation, so callers that need a suffix never build the rest.
        `read_at` (packed rows): logits at those positions only, [shards * slots, n, vocab]
        (`read_positions`). `layers_split`: see `Transformer.__call__`."""
        h, cache = self.hidden(tokens, positions, mask, cache, segment_ids, logits_from, layers_split, read_at)
        return self.head(h), cache

    def hidden(
        self,
        tokens: Int[Array, "batch length"],
        positions: Int[Array, "batch length"],
        mask: Bool[Array, "batch length"],
        cache: KVCache | PagedKVCache | None = None,
        segment_ids: Int[Array, "batch length"] | None = None,
        logits_from: int = 0,
        layers_split: Sequence[nnx.State] | None = None,
        read_at: Int[Array, "shards slots n"] | None = None,
    ) -> tuple[Float[Array, "batch out embed"], KVCache | PagedKVCache | None]:
        """The final hidden states at the positions `__call__` gives logits for: what `head` turns into
        logits, for callers that apply the head a chunk at a time (`logit_chunks`)."""
        h, cache = self.model(tokens, positions, mask, cache, segment_ids, layers_split)
        return (h[:, logits_from:] if read_at is None else read_positions(h, read_at)), cache

    def head(self, h: Float[Array, "batch length embed"]) -> Float[Array, "batch length vocab"]:
        """Float32 logits of hidden states (the LM head, or the tied embedding, then the final softcap)."""
        dt = self.config.jnp_dtype
        if self.config.tie_word_embeddings:
            w = self.model.embed.value.astype(dt).T
        else:
            w = self.lm_head.value.astype(dt)
        logits = softcap(dense(h, w, preferred_element_type=jnp.float32), self.config.final_logit_softcap)
        return ax.constrain(logits, (ax.BATCH, ax.LENGTH, ax.VOCAB))


class ValueModel(nnx.Module):
    """Critic: trunk + per-token scalar value head (float32 output)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat: str | bool = "none"):
        self.config = config
        self.model = Transformer(config, rngs=rngs, remat=remat)
        self.value_head = _param(rngs, _zeros, (config.hidden_size,), (ax.EMBED,), config.jnp_param_dtype)
        self.value_bias = nnx.Param(jnp.zeros((), config.jnp_param_dtype), logical_axes=())

    def __call__(
        self,
        tokens: Int[Array, "batch length"],
        positions: Int[Array, "batch length"],
        mask: Bool[Array, "batch length"],
        segment_ids: Int[Array, "batch length"] | None = None,
        read_at: Int[Array, "shards slots n"] | None = None,
    ) -> Float[Array, "batch length"]:
        """Values of every position, or with `read_at` (packed rows) of those positions only,
        [shards * slots, n] (`read_positions`)."""
        h, _ = self.model(tokens, positions, mask, segment_ids=segment_ids)
        if read_at is not None:
            h = read_positions(h, read_at)
        v = jnp.einsum("b...d,d->b...", h.astype(jnp.float32), self.value_head.value.astype(jnp.float32))
        return v + self.value_bias.value.astype(jnp.float32)


def last_token_index(mask: Bool[Array, "batch length"]) -> Int[Array, " batch"]:
    """Index of the last real (non-pad) token of each row."""
    t = mask.shape[-1]
    idx = jnp.where(mask.astype(bool), jnp.arange(t)[None, :], -1)
    return jnp.maximum(idx.max(axis=-1), 0)


class RewardModel(nnx.Module):
    """Reward model: trunk + scalar score read at the last non-pad token."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat: str | bool = "none"):
        self.config = config
        self.model = Transformer(config, rngs=rngs, remat=remat)
        # No bias, as HF's sequence-classification head: a pairwise loss cannot see a constant shift, so a
        # bias would only drift with optimizer noise (use `rewards.bias` to centre scores).
        self.score_head = _param(rngs, _normal, (config.hidden_size,), (ax.EMBED,), config.jnp_param_dtype)

    def __call__(
        self,
        tokens: Int[Array, "batch length"],
        positions: Int[Array, "batch length"],
        mask: Bool[Array, "batch length"],
        segment_ids: Int[Array, "batch length"] | None = None,
        read_at: Int[Array, "shards slots"] | None = None,
    ) -> Float[Array, " batch"]:
        """Each row's score at its last real token, or with `read_at` (packed rows: each sequence's last
        token) one per position given, [shards * slots] (`read_positions`)."""
        h, _ = self.model(tokens, positions, mask, segment_ids=segment_ids)
        if read_at is not None:
            last = read_positions(h, read_at)
        else:
            last = jnp.take_along_axis(h, last_token_index(mask)[:, None, None], axis=1)[:, 0]
        return last.astype(jnp.float32) @ self.score_head.value.astype(jnp.float32)


HEADS: dict[str, type[nnx.Module]] = {"lm": CausalLM, "value": ValueModel, "reward": RewardModel}


def build_model(
    config: ModelConfig, head: str = "lm", *, seed: int = 0, remat: str | bool = "none"
) -> nnx.Module:
    """Random-initialised model with the given head ("lm", "value" or "reward"); remat as in `Transformer`."""
    if head not in HEADS:
        raise ValueError(f"unknown model head {head!r}; choose one of {sorted(HEADS)}")
    # adapters draw from their own stream, so the base weights are those of the same seed without LoRA
    return HEADS[head](config, rngs=nnx.Rngs(params=seed, lora=seed), remat=remat)
