"""Continuous-batching generation with shared-prefix prefill (`generation.engine: continuous`).

Why: RL responses vary wildly in length. The static engine (`generation.py`) decodes every row until the
longest one ends, keeps a cache of batch x (prompt + max_new_tokens), and prefills a GRPO group's prompt
once per sample. This engine does the same work per row, and only that:

- Shared prefix. Rows come in groups of `group_size` adjacent rows holding the same prompt (the G samples
  of GRPO/RLOO, laid out by `repeat_rows`). Each distinct prompt is prefilled once, into a prefix cache
  [layers, prompts, kv_heads, P, head_dim] and its last logits; no row ever runs the prompt through the model.
- A pool of `slots` rows, fewer than the batch, decodes one token per step in a `lax.while_loop`. A row
  that ends (EOS or its length limit) frees its slot; at the next step the next waiting row enters it: its
  prompt's keys/values are copied from the prefix cache and its first token is sampled from the prompt's
  prefill logits. One program per shape: entering is data, never a recompile.
- Each slot holds P + N cache columns and its own length (`KVCache.index` per row). A row sits in its
  slot exactly as in the static engine's cache (prompt left-padded in [0, P), response from P, same rotary
  positions), so its arithmetic is the static engine's: greedy tokens agree.
- Sampling keys are per row and token, `fold_in(fold_in(rng, row), i)`: a row's sample does not depend on
  its slot, its step or the slot count, so a seed reproduces across plans. The static engine draws one key
  per token for the whole batch, so sampled tokens differ between engines (the distribution does not).
- Log-probs are those of the processed distribution (`sampling.sample`), as in the static engine.

Memory: prefix cache (B / G) x P plus slot cache slots x (P + N), against B x (P + N) for the static
engine (`kv_cache_bytes`). Results come back in the original row order as a `GenerationOutput`.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.generation import (
    GenerationOutput, _prefill, bucket_length, check_max_positions, eos_tuple, note_trace,
)
from jaxrlhf.models.sampling import SamplingParams, sample
from jaxrlhf.models.slots import pool_size
from jaxrlhf.models.transformer import KVCache, split_layers


def kv_cache_bytes(
    config: ModelConfig, rows: int, prompt_bucket: int, max_new_tokens: int, *, engine: str,
    group_size: int = 1, slots: int | None = None,
) -> int:
    """Bytes of keys/values each engine allocates for one generate call (what `peak_kv_bytes` reports):
    static = rows x (P + N) columns; continuous = prompts x P (prefix) + slots x (P + N)."""
    def cache(batch: int, columns: int) -> int:
        shapes = jax.eval_shape(lambda: KVCache.init(config, batch, columns))
        return int(shapes.k.size * shapes.k.dtype.itemsize + shapes.v.size * shapes.v.dtype.itemsize)

    if engine == "static":
        return cache(rows, prompt_bucket + max_new_tokens)
    return cache(rows // group_size, prompt_bucket) + cache(
        pool_size(rows, slots), prompt_bucket + max_new_tokens)


def _sample_rows(
    keys: PRNGKeyArray, logits: Float[Array, "slots vocab"], sampling: SamplingParams
) -> tuple[Int[Array, "slots"], Float[Array, "slots"]]:
    """One token per slot, each from its own key (a row's draw never depends on the other slots)."""
    def one(key, row_logits):
        token, logp = sample(key, row_logits[None], sampling)
        return token[0], logp[0]

    return jax.vmap(one)(keys, logits)


def generate_continuous(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_tokens: Int[Array, "batch length"],
    prompt_mask: Bool[Array, "batch length"],
    rng: PRNGKeyArray,
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_id: int | Sequence[int] | None,
    pad_id: int,
    group_size: int = 1,
    slots: int | None = None,
    max_lengths: Int[Array, "batch"] | None = None,
    min_bucket: int = 16,
) -> GenerationOutput:
    """Generate for `batch` rows with a pool of `slots` rows (see the module docstring), as one pure
    function (the form a placed call compiles). Rows g*G .. g*G + G-1 must hold the same prompt
    (G = `group_size`); only the first of each group is read. `max_lengths`: a row's own cap on its
    response length (optional). Same outputs and conventions as `generation.generate_tokens`."""
    note_trace("continuous")
    model = nnx.merge(graphdef, state)
    cfg = model.config
    rows, width = prompt_tokens.shape
    n = max_new_tokens
    check_max_positions(cfg.max_position_embeddings, width, n)
    if group_size < 1 or rows % group_size:
        raise ValueError(f"a batch of {rows} rows is not made of groups of group_size={group_size} rows")
    bucket = bucket_length(width, min_bucket)
    ways = ax.batch_ways()
    # Each distinct prompt once: its left-aligned tokens, its last logits and its keys/values. A sharded
    # batch axis must divide evenly, so the prompts are padded with repeats to a multiple of its shards.
    groups = rows // group_size
    picked = (jnp.arange(-(-groups // ways) * ways) % groups) * group_size
    group_tokens, group_mask, prefix_logits, prefix = _prefill(
        graphdef, state, prompt_tokens[picked], prompt_mask[picked], bucket=bucket, max_new_tokens=0, pad_id=pad_id)
    group_tokens, group_mask = group_tokens[:groups], group_mask[:groups]
    group_len = group_mask.sum(axis=1).astype(jnp.int32)  # rotary position of each prompt's first response token
    s = pool_size(rows, slots, ways)
    eos = jnp.asarray(eos_tuple(eos_id) or (-1,), jnp.int32)
    limits = jnp.full((rows,), n, jnp.int32) if max_lengths is None else jnp.clip(max_lengths, 1, n).astype(jnp.int32)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(rows))
    layers = split_layers(model)  # once, outside the token loop (see Transformer.__call__)

    def record(outs, ended, row, i, token, logp, write):
        """Store each writing slot's token i of its row; the slots whose row ended leave their slot."""
        target = jnp.where(write, row, rows)  # rows is out of range: dropped
        tokens, logps, valid = outs
        outs = (tokens.at[target, i].set(token, mode="drop"), logps.at[target, i].set(logp, mode="drop"),
                valid.at[target, i].set(True, mode="drop"))
        is_eos = jnp.isin(token, eos)
        ends = write & (is_eos | (i + 1 >= limits[jnp.clip(row, 0, rows - 1)]))
        ended = ended.at[jnp.where(ends, row, rows)].set(is_eos, mode="drop")
        return outs, ended, ends

    def refill(carry):
        """Move waiting rows, in row order, into free slots: prompt keys/values copied, first token sampled."""
        cache, slot_row, slot_i, slot_tok, slot_pos, next_row, outs, ended = carry
        free = slot_row < 0
        new_row = next_row + jnp.cumsum(free) - 1
        enter = free & (new_row < rows)
        row = jnp.where(enter, new_row, slot_row)
        group = jnp.clip(row, 0, rows - 1) // group_size

        def copy(slot, kv):
            def put(kv):
                src = tuple(jax.lax.dynamic_slice_in_dim(p, group[slot], 1, axis=1) for p in (prefix.k, prefix.v))
                return tuple(jax.lax.dynamic_update_slice(c, x, (0, slot, 0, 0, 0)) for c, x in zip(kv, src))

            return jax.lax.cond(enter[slot], put, lambda kv: kv, kv)

        k, v = jax.lax.fori_loop(0, s, copy, (cache.k, cache.v))
        entered_valid = jnp.pad(group_mask[group], ((0, 0), (0, n)))
        cache = KVCache(k=k, v=v, valid=jnp.where(enter[:, None], entered_valid, cache.valid),
                        index=jnp.where(enter, bucket, cache.index))
        keys = jax.vmap(lambda r: jax.random.fold_in(row_keys[r], 0))(jnp.clip(row, 0, rows - 1))
        token, logp = _sample_rows(keys, prefix_logits[group], sampling)
        outs, ended, ends = record(outs, ended, row, 0, token, logp, enter)
        slot_row = jnp.where(enter & ~ends, row, jnp.where(enter, -1, slot_row))
        return (cache, slot_row, jnp.where(enter, 1, slot_i), jnp.where(enter, token, slot_tok),
                jnp.where(enter, group_len[group], slot_pos), jnp.minimum(next_row + free.sum(), rows), outs, ended)

    def cond(carry):
        _, slot_row, *_, next_row, _, _ = carry
        return (next_row < rows) | jnp.any(slot_row >= 0)

    def body(carry):
        slot_row, next_row = carry[1], carry[5]
        carry = jax.lax.cond((next_row < rows) & jnp.any(slot_row < 0), refill, lambda c: c, carry)
        cache, slot_row, slot_i, slot_tok, slot_pos, next_row, outs, ended = carry
        active = slot_row >= 0
        logits, new_cache = model(slot_tok[:, None], slot_pos[:, None], active[:, None], cache, layers_split=layers)
        cache = new_cache.replace(index=jnp.where(active, new_cache.index, cache.index))  # idle slots stay in range
        keys = jax.vmap(lambda r, i: jax.random.fold_in(row_keys[r], i))(jnp.clip(slot_row, 0, rows - 1), slot_i)
        token, logp = _sample_rows(keys, logits[:, 0], sampling)
        outs, ended, ends = record(outs, ended, slot_row, slot_i, token, logp, active)
        step = active.astype(jnp.int32)
        return (cache, jnp.where(ends, -1, slot_row), slot_i + step, token, slot_pos + step, next_row, outs, ended)

    cache = KVCache.init(cfg, s, bucket + n)
    cache = cache.replace(index=jnp.full((s,), bucket, jnp.int32))
    outs = (jnp.full((rows, n), pad_id, jnp.int32), jnp.zeros((rows, n), jnp.float32), jnp.zeros((rows, n), bool))
    idle = jnp.full((s,), -1, jnp.int32)
    carry = (cache, idle, jnp.zeros((s,), jnp.int32), jnp.full((s,), pad_id, jnp.int32), jnp.zeros((s,), jnp.int32),
             jnp.int32(0), outs, jnp.zeros((rows,), bool))
    *_, (out_tokens, out_logp, out_valid), ended = jax.lax.while_loop(cond, body, carry)
    prompt_rows = jnp.repeat(group_tokens, group_size, axis=0)
    prompt_rows_mask = jnp.repeat(group_mask, group_size, axis=0)
    return GenerationOutput(
        tokens=jnp.concatenate([prompt_rows, out_tokens], axis=1),
        prompt_tokens=prompt_rows,
        prompt_mask=prompt_rows_mask,
        response_tokens=out_tokens,
        response_mask=out_valid,
        logprobs=out_logp,
        lengths=out_valid.sum(axis=1).astype(jnp.int32),
        ended_with_eos=ended,
    )


continuous_fn = jax.jit(
    generate_continuous, static_argnums=0,
    static_argnames=("max_new_tokens", "sampling", "eos_id", "pad_id", "group_size", "slots", "min_bucket"),
)
