"""Continuous-batching generation with shared-prefix prefill and a paged KV cache
(`generation.engine: continuous`).

Why: RL responses vary wildly in length. The static engine (`generation.py`) decodes every row until the
longest one ends, keeps a cache of batch x (prompt + max_new_tokens), and prefills a GRPO group's prompt
once per sample. This engine does the work each row needs, and keeps the cache its tokens need:

- Shared prefix. Rows come in groups of `group_size` adjacent rows holding the same prompt (the G samples
  of GRPO/RLOO, laid out by `repeat_rows`). Each distinct prompt is prefilled once; its keys/values become
  read-only pages of the pool that every row of its group lists in its block table (never copied).
- Paged cache. Keys/values live in pages of `slots.PAGE_SIZE` tokens; a row's block table lists its prompt's
  pages, then its own response pages, taken from a free list when its length crosses a page boundary and
  returned when it ends. The pool holds `kv_pages` response pages (`slots.response_pages`); when it runs
  short, the youngest rows (highest row ids) are preempted: their pages are freed and they restart from
  their prompt later. Sampling keys are per row and token, so a restarted row draws the same tokens: the
  result does not depend on the pool size. The oldest row always fits (a pool holds one full response), so
  the loop ends.
- Slots and widths. A pool of `slots` rows (default the whole batch) decodes in one `lax.while_loop`; a row
  that ends frees its slot and the next waiting row enters it (its first token is sampled from its
  prompt's prefill logits). Active slots are moved to the front and each step runs the narrowest of a few
  static widths (`slots.step_widths`) that holds them: a long tail's last rows cost a narrow step, not a
  full batch. Entering, paging and widths are data: one program per shape.
- Same arithmetic per row. A row's columns are its left-padded prompt bucket then its response, at the
  same rotary positions as in the static cache, so greedy tokens agree with the static engine.
- Sampling keys are per row and token, `fold_in(fold_in(rng, row), i)`: a row's sample does not depend on
  its slot, its step, the slot count, the pool or the plan. The static engine draws one key per token for
  the whole batch, so sampled tokens differ between engines (the distribution does not).
- Sharded batch: each shard of the batch axis runs its own rows, slots and pages (the pool has a shard
  axis), so a row never reads another device's pages.

Results come back in the original row order as a `GenerationOutput`, with `kv_pages_used`: the most
response pages in use at any step (all shards).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxrlhf.models import axes as ax
from jaxrlhf.models import slots as sz
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.generation import (
    GenerationOutput, _prefill, bucket_length, check_max_positions, eos_tuple, note_trace,
)
from jaxrlhf.models.sampling import SamplingParams, sample
from jaxrlhf.models.transformer import PagedKVCache, split_layers, write_pages

def kv_column_bytes(config: ModelConfig) -> int:
    """Bytes of keys and values of one token over all layers (one cache column)."""
    return 2 * config.num_layers * config.num_kv_heads * config.dim_per_head * jnp.dtype(config.jnp_dtype).itemsize


def kv_cache_bytes(
    config: ModelConfig, rows: int, prompt_bucket: int, max_new_tokens: int, *, engine: str,
    group_size: int = 1, slots: int | None = None, kv_pages: int | None = None, batch_ways: int = 1,
) -> int:
    """Peak bytes of keys/values each engine allocates for one generate call (what `peak_kv_bytes`
    reports): static = rows x (P + N) columns plus the prefill's one row per group they are copied from;
    continuous = the page pool (prefix pages + `kv_pages` response pages) plus the prefill's dense prefix
    it is built from (`slots.kv_columns`)."""
    if engine == "static":
        g = sz.shard_group(rows, group_size, batch_ways)
        prefilled = rows // g if g > 1 else 0
        return (rows + prefilled) * (prompt_bucket + max_new_tokens) * kv_column_bytes(config)
    prefix, pool = sz.kv_columns(prompt_bucket, max_new_tokens, rows, group_size, slots, kv_pages, batch_ways)
    return batch_ways * (prefix + pool) * kv_column_bytes(config)


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
    kv_pages: int | None = None,
    max_lengths: Int[Array, "batch"] | None = None,
    min_bucket: int = 16,
) -> GenerationOutput:
    """Generate for `batch` rows with a pool of `slots` rows and `kv_pages` response pages (see the
    module docstring), as one pure function (the form a placed call compiles). Rows g*G .. g*G + G-1
    must hold the same prompt (G = `group_size`); only the first of each group is read. `max_lengths`:
    a row's own cap on its response length (optional). Same outputs and conventions as
    `generation.generate_tokens`, plus `kv_pages_used`."""
    note_trace("continuous")
    model = nnx.merge(graphdef, state)
    cfg = model.config
    rows, width = prompt_tokens.shape
    n = max_new_tokens
    check_max_positions(cfg.max_position_embeddings, width, n)
    sz.check_groups(rows, group_size)
    bucket = bucket_length(width, min_bucket)
    ways = ax.batch_ways()
    g = sz.shard_group(rows, group_size, ways)  # rows sharing a prompt inside a shard
    per_shard = rows // ways
    prompts = per_shard // g  # distinct prompts per shard
    s = sz.pool_size(rows, slots, ways) // ways  # slots per shard
    ps = sz.page_size(bucket)
    prompt_pages, row_pages = sz.pages_per_row(bucket, n)
    width_t = prompt_pages + row_pages  # block table entries per row
    resp_pages = sz.response_pages(bucket, n, rows, slots, kv_pages, ways)
    base = prompts * prompt_pages  # a shard's response pages follow its prompt pages
    unassigned = base + resp_pages  # a page id past the pool
    cols = bucket + n
    widths = sz.step_widths(s)
    layers_n, kvh, hd = cfg.num_layers, cfg.num_kv_heads, cfg.dim_per_head

    # Each distinct prompt once: its left-aligned tokens, its last logits and its keys/values as pages.
    picked = jnp.arange(rows // g) * g
    group_tokens, group_mask, prefix_logits, prefix = _prefill(
        graphdef, state, prompt_tokens[picked], prompt_mask[picked], bucket=bucket, max_new_tokens=0, pad_id=pad_id)

    def to_pages(x):  # [layers, shards * prompts, kv_heads, P, hd] -> [layers, shards, pages, kv_heads, ps, hd]
        x = x.reshape(layers_n, ways, prompts, kvh, prompt_pages, ps, hd).transpose(0, 1, 2, 4, 3, 5, 6)
        x = x.reshape(layers_n, ways, base, kvh, ps, hd)
        x = jnp.concatenate([x, jnp.zeros((layers_n, ways, resp_pages, kvh, ps, hd), x.dtype)], axis=2)
        return ax.constrain(x, (None, ax.BATCH, None, None, None, None))

    pool = (to_pages(prefix.k), to_pages(prefix.v))
    shard_view = lambda x: x.reshape(ways, -1, *x.shape[1:])  # noqa: E731  [shards * k, ...] -> [shards, k, ...]
    g_mask, g_logits = shard_view(group_mask), shard_view(prefix_logits)
    g_len = shard_view(group_mask.sum(axis=1).astype(jnp.int32))  # rotary position of the first response token
    eos = jnp.asarray(eos_tuple(eos_id) or (-1,), jnp.int32)
    limits = jnp.full((rows,), n, jnp.int32) if max_lengths is None else jnp.clip(max_lengths, 1, n).astype(jnp.int32)
    limits = shard_view(limits)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(rows))
    shard_ids = jnp.arange(ways)
    layers = split_layers(model)  # once, outside the token loop (see Transformer.__call__)

    def keys_of(shard, row, i):
        return jax.vmap(lambda r, t: jax.random.fold_in(row_keys[r], t))(
            shard * per_shard + jnp.clip(row, 0, per_shard - 1), i)

    # ---- per-shard bookkeeping (vmapped over shards); `st` is one shard's dict of slot and row state

    def release(st, mask):
        """Return the response pages of the `mask` slots to the free list and clear their tables."""
        ids = jnp.where(mask[:, None], st["table"][:, prompt_pages:] - base, resp_pages)
        return dict(st, free=st["free"].at[ids].set(True, mode="drop"),
                    table=jnp.where(mask[:, None], unassigned, st["table"]))

    def record(st, lim, row, i, token, logp, write):
        """Store each writing slot's token i of its row; slots whose row ended free their slot and pages."""
        target = jnp.where(write, row, per_shard)  # out of range: dropped
        is_eos = jnp.isin(token, eos)
        ends = write & (is_eos | (i + 1 >= lim[jnp.clip(row, 0, per_shard - 1)]))
        done = jnp.where(ends, row, per_shard)
        st = dict(st, tokens=st["tokens"].at[target, i].set(token, mode="drop"),
                  logp=st["logp"].at[target, i].set(logp, mode="drop"),
                  out_valid=st["out_valid"].at[target, i].set(True, mode="drop"),
                  ended=st["ended"].at[done].set(is_eos, mode="drop"),
                  status=st["status"].at[done].set(2, mode="drop"))
        st = release(st, ends)
        return dict(st, row=jnp.where(ends, -1, row)), ends

    def refill(st, shard, mask, logits, glen, lim):
        """Waiting rows, lowest ids first, enter free slots: their table lists their prompt's pages and
        their first token is sampled from the prompt's prefill logits."""
        free = st["row"] < 0
        first = jnp.nonzero(st["status"] == 0, size=s, fill_value=per_shard)[0]
        new = jnp.where(free, first[jnp.clip(jnp.cumsum(free) - 1, 0, s - 1)], per_shard)
        enter = new < per_shard
        row = jnp.where(enter, new, st["row"])
        group = jnp.clip(row, 0, per_shard - 1) // g
        prompt_table = jnp.concatenate([group[:, None] * prompt_pages + jnp.arange(prompt_pages),
                                        jnp.full((s, row_pages), unassigned, jnp.int32)], axis=1)
        st = dict(st, status=st["status"].at[jnp.where(enter, new, per_shard)].set(1, mode="drop"),
                  table=jnp.where(enter[:, None], prompt_table, st["table"]),
                  valid=jnp.where(enter[:, None], jnp.pad(mask[group], ((0, 0), (0, n))), st["valid"]))
        token, logp = _sample_rows(keys_of(shard, row, jnp.zeros_like(row)), logits[group], sampling)
        st, ends = record(st, lim, row, 0, token, logp, enter)
        st["row"] = jnp.where(enter & ~ends, row, st["row"])
        for k, v in (("i", 1), ("tok", token), ("pos", glen[group])):
            st[k] = jnp.where(enter, v, st[k])
        return st

    def allocate(st):
        """A page for each slot whose next token starts one; when the pool is short, the youngest rows
        (highest ids) are preempted (pages freed, outputs cleared, back to waiting) so that the rows before
        them fit."""
        active, i = st["row"] >= 0, st["i"]
        req = active & ((i - 1) % ps == 0)
        need = jnp.where(active, -(-(i - 1) // ps) + req, 0)
        order = jnp.argsort(jnp.where(active, st["row"], per_shard))
        keep = jnp.zeros((s,), bool).at[order].set(jnp.cumsum(need[order]) <= resp_pages)
        preempt = active & ~keep
        back = jnp.where(preempt, st["row"], per_shard)
        st = release(st, preempt)
        st = dict(st, status=st["status"].at[back].set(0, mode="drop"),
                  out_valid=st["out_valid"].at[back].set(False, mode="drop"),
                  tokens=st["tokens"].at[back].set(pad_id, mode="drop"),
                  logp=st["logp"].at[back].set(0.0, mode="drop"), row=jnp.where(preempt, -1, st["row"]))
        grant = req & keep
        avail = jnp.nonzero(st["free"], size=s, fill_value=resp_pages)[0]
        page = jnp.where(grant, avail[jnp.clip(jnp.cumsum(grant) - 1, 0, s - 1)], resp_pages)
        column = jnp.where(grant, prompt_pages + (i - 1) // ps, width_t)
        return dict(st, free=st["free"].at[page].set(False, mode="drop"),
                    table=st["table"].at[jnp.arange(s), column].set(base + page, mode="drop"))

    def compact(st):
        """Active slots first (stable): a step runs the narrowest width that holds them."""
        order = jnp.argsort(st["row"] < 0, stable=True)
        return dict(st, **{k: st[k][order] for k in ("row", "i", "tok", "pos", "table", "valid")})

    def advance(st, lim, token, logp):
        active = st["row"] >= 0
        st, _ = record(st, lim, st["row"], st["i"], token, logp, active)
        step = active.astype(jnp.int32)
        return dict(st, i=st["i"] + step, tok=jnp.where(active, token, st["tok"]), pos=st["pos"] + step)

    # ---- the decode step at a static width: the model runs the first `w` slots of every shard

    def decode(w, pool, st):
        row, i, tok, pos, table, valid = (st[k][:, :w] for k in ("row", "i", "tok", "pos", "table", "valid"))
        flat = lambda x: x.reshape(ways * w, *x.shape[2:])  # noqa: E731
        active = row >= 0
        cache = PagedKVCache(k=pool[0], v=pool[1], valid=flat(valid), index=flat(bucket + i - 1), table=table)
        logits, cache = model(flat(tok)[:, None], flat(pos)[:, None], flat(active)[:, None], cache,
                              layers_split=layers)
        keys = keys_of(jnp.repeat(shard_ids, w), flat(row), flat(i))
        token, logp = _sample_rows(keys, logits[:, 0], sampling)
        widen = lambda x, fill: jnp.full((ways, s), fill, x.dtype).at[:, :w].set(x.reshape(ways, w))  # noqa: E731
        valid = st["valid"].at[:, :w].set(cache.valid.reshape(ways, w, cols))
        new = jnp.zeros((2, layers_n, ways, s, kvh, hd), cache.new_k.dtype).at[:, :, :, :w].set(
            jnp.stack([cache.new_k, cache.new_v])[:, :, :, 0].reshape(2, layers_n, ways, w, kvh, hd))
        return new, valid, widen(token, pad_id), widen(logp, 0.0)

    branches = [lambda pool, st, w=w: decode(w, pool, st) for w in widths]
    shards = jax.vmap  # the bookkeeping runs per batch shard

    def cond(carry):
        return jnp.any(carry[1]["status"] != 2)

    def body(carry):
        pool, st, peak = carry
        can_enter = jnp.any(st["row"] < 0) & jnp.any(st["status"] == 0)
        st = jax.lax.cond(can_enter, lambda st: shards(refill)(st, shard_ids, g_mask, g_logits, g_len, limits),
                          lambda st: st, st)
        # a page is granted (and the pool can run short) only when some row's next token starts a page,
        # and a step needs compacting only when an idle slot sits before an active one: skip both else
        starts = jnp.any((st["row"] >= 0) & ((st["i"] - 1) % ps == 0))
        st = jax.lax.cond(starts, shards(allocate), lambda st: st, st)
        peak = jnp.maximum(peak, resp_pages * ways - st["free"].sum())
        active = st["row"] >= 0
        st = jax.lax.cond(jnp.any(~active[:, :-1] & active[:, 1:]), shards(compact), lambda st: st, st)
        busy = (st["row"] >= 0).sum(axis=1).max()
        branch = (jnp.asarray(widths) >= busy).sum() - 1
        new, st["valid"], token, logp = jax.lax.switch(branch, branches, pool, st)
        index = (bucket + st["i"] - 1).reshape(-1)  # idle slots' tables are unassigned: their writes drop
        pool = tuple(write_pages(p, x.reshape(layers_n, ways * s, 1, kvh, hd), index, st["table"])
                     for p, x in zip(pool, new))
        st = shards(advance)(st, limits, token, logp)
        return pool, st, peak

    st = {
        "row": jnp.full((ways, s), -1, jnp.int32), "i": jnp.ones((ways, s), jnp.int32),
        "tok": jnp.full((ways, s), pad_id, jnp.int32), "pos": jnp.zeros((ways, s), jnp.int32),
        "table": jnp.full((ways, s, width_t), unassigned, jnp.int32), "valid": jnp.zeros((ways, s, cols), bool),
        "free": jnp.ones((ways, resp_pages), bool), "status": jnp.zeros((ways, per_shard), jnp.int32),
        "tokens": jnp.full((ways, per_shard, n), pad_id, jnp.int32),
        "logp": jnp.zeros((ways, per_shard, n), jnp.float32),
        "out_valid": jnp.zeros((ways, per_shard, n), bool), "ended": jnp.zeros((ways, per_shard), bool),
    }
    _, st, peak = jax.lax.while_loop(cond, body, (pool, st, jnp.int32(0)))
    out_tokens, out_logp, out_valid = (st[k].reshape(rows, n) for k in ("tokens", "logp", "out_valid"))
    prompt_rows = jnp.repeat(group_tokens, g, axis=0)
    return GenerationOutput(
        tokens=jnp.concatenate([prompt_rows, out_tokens], axis=1),
        prompt_tokens=prompt_rows,
        prompt_mask=jnp.repeat(group_mask, g, axis=0),
        response_tokens=out_tokens,
        response_mask=out_valid,
        logprobs=out_logp,
        lengths=out_valid.sum(axis=1).astype(jnp.int32),
        ended_with_eos=st["ended"].reshape(rows),
        kv_pages_used=peak,
    )


continuous_fn = jax.jit(
    generate_continuous, static_argnums=0,
    static_argnames=("max_new_tokens", "sampling", "eos_id", "pad_id", "group_size", "slots", "kv_pages",
                     "min_bucket"),
)
