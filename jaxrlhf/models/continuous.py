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
  full batch. Likewise each step reads the narrowest of a few static spans of response columns
  (`slots.read_columns`: the cap and its halves) that holds every active row's tokens so far: under a long
  cap, the early steps attend over the columns filled, not the cap's. Entering, paging, widths and reads are
  data: one program per shape.
- Same arithmetic per row. A row's columns are its left-padded prompt bucket then its response, at the
  same rotary positions as in the static cache, so greedy tokens agree with the static engine.
- Sampling keys are per row and token, `fold_in(fold_in(rng, row), i)`: a row's sample does not depend on
  its slot, its step, the slot count, the pool or the plan. The static engine draws one key per token for
  the whole batch, so sampled tokens differ between engines (the distribution does not).
- Sharded batch: each shard of the batch axis runs its own rows, slots and pages (the pool has a shard
  axis), so a row never reads another device's pages.

Results come back in the original row order as a `GenerationOutput`, with `kv_pages_used`: the most
response pages in use at any step (all shards). The decode machinery is `PagedEngine`, which the
streaming engine (`streaming.py`) runs in chunks over a state that persists between calls.
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
    GenerationOutput,
    _prefill,
    bucket_length,
    check_max_positions,
    eos_tuple,
    expert_dtype,
    note_trace,
    prefill_routed,
    routed_experts,
)
from jaxrlhf.models.moe import forward_with_router_logits
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
) -> tuple[Int[Array, " slots"], Float[Array, " slots"]]:
    """One token per slot, each from its own key (a row's draw never depends on the other slots)."""
    def one(key, row_logits):
        token, logp = sample(key, row_logits[None], sampling)
        return token[0], logp[0]

    return jax.vmap(one)(keys, logits)


def prompt_pages_of(x: Float[Array, "layers batch kv_heads bucket head_dim"], page: int
                    ) -> Float[Array, "layers batch pages kv_heads page head_dim"]:
    """A dense prefill's keys (or values) cut into the pool's pages, each prompt's pages in order."""
    layers_n, batch, kvh, bucket, hd = x.shape
    return x.reshape(layers_n, batch, kvh, bucket // page, page, hd).transpose(0, 1, 3, 2, 4, 5)


WAITING, RUNNING, DONE = 0, 1, 2  # a row's status (`PagedEngine`); the streaming engine adds EMPTY = 3


class PagedEngine:
    """The decode machinery of the continuous engine over one pool of slots, rows and pages per batch
    shard: refill free slots with waiting rows, grant pages (preempting the youngest rows when short),
    move active slots to the front, run the narrowest width, write the step's keys/values, record tokens.
    `generate_continuous` runs it to completion in one while_loop; `streaming` runs it in chunks over a
    state that persists between calls. Built while tracing (it holds the model and traced arrays).

    Per shard: `rows` rows in groups of `group` adjacent rows sharing a prompt (the prompt pages of group
    q are q * prompt_pages ...), `slots` slots, `response_pages` response pages after the prompts' pages.
    `row_keys[shard * rows + r]` is row r's sampling key (token i: fold_in(key, i)). The per-shard `data`
    (vmapped over shards) holds the groups' prompt `mask`, prefill `logits`, prompt length `len` and the
    rows' `limit`; optionally `prio` (a row's rank for entering and for keeping its pages: lowest first;
    default the row id) and `v0` (a group's version, recorded for a row's first token, which is sampled
    from the prefill logits). A row state dict may hold `version` [rows, N] (each token's version) and
    `preempted` [] (a count of preemptions)."""

    def __init__(self, model: nnx.Module, *, sampling: SamplingParams, eos_ids: tuple[int, ...], pad_id: int,
                 ways: int, rows: int, group: int, slots: int, prompts: int, bucket: int, max_new_tokens: int,
                 response_pages: int, row_keys: PRNGKeyArray, record_experts: bool = False):
        cfg = model.config
        self.record_experts = record_experts  # a row state's `experts` [rows, N, layers, k] (router replay)
        self.model, self.layers = model, split_layers(model)  # once, outside the token loop
        self.sampling, self.pad_id = sampling, pad_id
        self.eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
        self.ways, self.per_shard, self.g, self.s = ways, rows, group, slots
        self.bucket, self.n = bucket, max_new_tokens
        self.ps = sz.page_size(bucket)
        self.prompt_pages, self.row_pages = sz.pages_per_row(bucket, max_new_tokens)
        self.width_t = self.prompt_pages + self.row_pages  # block table entries per row
        self.resp_pages = response_pages
        self.base = prompts * self.prompt_pages  # a shard's response pages follow its prompt pages
        self.unassigned = self.base + response_pages  # a page id past the pool
        self.cols = bucket + max_new_tokens
        self.widths = sz.step_widths(slots)
        self.reads = sz.read_columns(max_new_tokens, self.ps)
        self.layers_n, self.kvh, self.hd = cfg.num_layers, cfg.num_kv_heads, cfg.dim_per_head
        self.row_keys = row_keys
        self.shard_ids = jnp.arange(ways)

    def init_state(self) -> dict:
        """Every slot idle, every page free, every row waiting with no output (one dict, [shards, ...])."""
        ways, s, per_shard, n = self.ways, self.s, self.per_shard, self.n
        return {
            "row": jnp.full((ways, s), -1, jnp.int32), "i": jnp.ones((ways, s), jnp.int32),
            "tok": jnp.full((ways, s), self.pad_id, jnp.int32), "pos": jnp.zeros((ways, s), jnp.int32),
            "table": jnp.full((ways, s, self.width_t), self.unassigned, jnp.int32),
            "valid": jnp.zeros((ways, s, self.cols), bool),
            "free": jnp.ones((ways, self.resp_pages), bool), "status": jnp.zeros((ways, per_shard), jnp.int32),
            "tokens": jnp.full((ways, per_shard, n), self.pad_id, jnp.int32),
            "logp": jnp.zeros((ways, per_shard, n), jnp.float32),
            "out_valid": jnp.zeros((ways, per_shard, n), bool), "ended": jnp.zeros((ways, per_shard), bool),
        } | ({"experts": jnp.full((ways, per_shard, n, self.layers_n, self.model.config.num_experts_per_tok), -1,
                                  expert_dtype(self.model.config))} if self.record_experts else {})

    def keys_of(self, shard, row, i):
        return jax.vmap(lambda r, t: jax.random.fold_in(self.row_keys[r], t))(
            shard * self.per_shard + jnp.clip(row, 0, self.per_shard - 1), i)

    # ---- per-shard bookkeeping (vmapped over shards); `st` is one shard's dict of slot and row state

    def release(self, st, mask):
        """Return the response pages of the `mask` slots to the free list and clear their tables."""
        ids = jnp.where(mask[:, None], st["table"][:, self.prompt_pages:] - self.base, self.resp_pages)
        return dict(st, free=st["free"].at[ids].set(True, mode="drop"),
                    table=jnp.where(mask[:, None], self.unassigned, st["table"]))

    def record(self, st, lim, row, i, token, logp, write, version=None):
        """Store each writing slot's token i of its row; slots whose row ended free their slot and pages."""
        per_shard = self.per_shard
        target = jnp.where(write, row, per_shard)  # out of range: dropped
        is_eos = jnp.isin(token, self.eos)
        ends = write & (is_eos | (i + 1 >= lim[jnp.clip(row, 0, per_shard - 1)]))
        done = jnp.where(ends, row, per_shard)
        st = dict(st, tokens=st["tokens"].at[target, i].set(token, mode="drop"),
                  logp=st["logp"].at[target, i].set(logp, mode="drop"),
                  out_valid=st["out_valid"].at[target, i].set(True, mode="drop"),
                  ended=st["ended"].at[done].set(is_eos, mode="drop"),
                  status=st["status"].at[done].set(DONE, mode="drop"))
        if "version" in st:
            st["version"] = st["version"].at[target, i].set(version, mode="drop")
        st = self.release(st, ends)
        return dict(st, row=jnp.where(ends, -1, row)), ends

    def refill(self, st, shard, data):
        """Waiting rows (lowest `prio`, else lowest id, first) enter free slots: their table lists their
        prompt's pages and their first token is sampled from the prompt's prefill logits."""
        s, per_shard, pp = self.s, self.per_shard, self.prompt_pages
        free = st["row"] < 0
        waiting = st["status"] == WAITING
        if "prio" in data:
            first = jnp.argsort(jnp.where(waiting, data["prio"], jnp.iinfo(jnp.int32).max))[:s]
            first = jnp.where(waiting[first], first, per_shard)
        else:
            first = jnp.nonzero(waiting, size=s, fill_value=per_shard)[0]
        new = jnp.where(free, first[jnp.clip(jnp.cumsum(free) - 1, 0, s - 1)], per_shard)
        enter = new < per_shard
        row = jnp.where(enter, new, st["row"])
        group = jnp.clip(row, 0, per_shard - 1) // self.g
        prompt_table = jnp.concatenate([group[:, None] * pp + jnp.arange(pp),
                                        jnp.full((s, self.row_pages), self.unassigned, jnp.int32)], axis=1)
        st = dict(st, status=st["status"].at[jnp.where(enter, new, per_shard)].set(RUNNING, mode="drop"),
                  table=jnp.where(enter[:, None], prompt_table, st["table"]),
                  valid=jnp.where(enter[:, None], jnp.pad(data["mask"][group], ((0, 0), (0, self.n))), st["valid"]))
        token, logp = _sample_rows(self.keys_of(shard, row, jnp.zeros_like(row)), data["logits"][group],
                                   self.sampling)
        first_version = data["v0"][group] if "v0" in data else None
        st, ends = self.record(st, data["limit"], row, 0, token, logp, enter, first_version)
        st["row"] = jnp.where(enter & ~ends, row, st["row"])
        for k, v in (("i", 1), ("tok", token), ("pos", data["len"][group])):
            st[k] = jnp.where(enter, v, st[k])
        return st

    def allocate(self, st, data):
        """A page for each slot whose next token starts one; when the pool is short, the youngest rows
        (highest `prio`, else highest ids) are preempted (pages freed, outputs cleared, back to waiting) so
        that the rows before them fit."""
        s, per_shard, ps = self.s, self.per_shard, self.ps
        active, i = st["row"] >= 0, st["i"]
        req = active & ((i - 1) % ps == 0)
        need = jnp.where(active, -(-(i - 1) // ps) + req, 0)
        rank = data["prio"][jnp.clip(st["row"], 0, per_shard - 1)] if "prio" in data else st["row"]
        order = jnp.argsort(jnp.where(active, rank, jnp.iinfo(jnp.int32).max))
        keep = jnp.zeros((s,), bool).at[order].set(jnp.cumsum(need[order]) <= self.resp_pages)
        preempt = active & ~keep
        back = jnp.where(preempt, st["row"], per_shard)
        st = self.release(st, preempt)
        if "preempted" in st:  # a count of preemptions, where the state keeps one
            st["preempted"] = st["preempted"] + preempt.sum(dtype=jnp.int32)
        st = dict(st, status=st["status"].at[back].set(WAITING, mode="drop"),
                  out_valid=st["out_valid"].at[back].set(False, mode="drop"),
                  tokens=st["tokens"].at[back].set(self.pad_id, mode="drop"),
                  logp=st["logp"].at[back].set(0.0, mode="drop"), row=jnp.where(preempt, -1, st["row"]))
        if "experts" in st:
            st["experts"] = st["experts"].at[back].set(-1, mode="drop")
        grant = req & keep
        avail = jnp.nonzero(st["free"], size=s, fill_value=self.resp_pages)[0]
        page = jnp.where(grant, avail[jnp.clip(jnp.cumsum(grant) - 1, 0, s - 1)], self.resp_pages)
        column = jnp.where(grant, self.prompt_pages + (i - 1) // ps, self.width_t)
        return dict(st, free=st["free"].at[page].set(False, mode="drop"),
                    table=st["table"].at[jnp.arange(s), column].set(self.base + page, mode="drop"))

    @staticmethod
    def compact(st):
        """Active slots first (stable): a step runs the narrowest width that holds them."""
        order = jnp.argsort(st["row"] < 0, stable=True)
        return dict(st, **{k: st[k][order] for k in ("row", "i", "tok", "pos", "table", "valid")})

    def advance(self, st, data, token, logp, version=None):
        active = st["row"] >= 0
        st, _ = self.record(st, data["limit"], st["row"], st["i"], token, logp, active, version)
        step = active.astype(jnp.int32)
        return dict(st, i=st["i"] + step, tok=jnp.where(active, token, st["tok"]), pos=st["pos"] + step)

    # ---- the decode step at a static width and read: the model runs the first `w` slots of every shard over
    # the first `read` response columns of their caches (every active slot's tokens so far lie within them)

    def decode(self, w, read, pool, st):
        ways, s, layers_n, kvh, hd = self.ways, self.s, self.layers_n, self.kvh, self.hd
        cols = self.bucket + read
        row, i, tok, pos = (st[k][:, :w] for k in ("row", "i", "tok", "pos"))
        table = st["table"][:, :w, :self.prompt_pages + -(-read // self.ps)]
        valid = st["valid"][:, :w, :cols]
        flat = lambda x: x.reshape(ways * w, *x.shape[2:])  # noqa: E731
        active = row >= 0
        cache = PagedKVCache(k=pool[0], v=pool[1], valid=flat(valid), index=flat(self.bucket + i - 1), table=table)
        args = (flat(tok)[:, None], flat(pos)[:, None], flat(active)[:, None], cache)
        if self.record_experts:  # the routing of each slot's token i - 1, which this step feeds in
            (logits, cache), router = forward_with_router_logits(self.model, *args, layers_split=self.layers)
            routed = routed_experts(self.model.config, router, flat(active)[:, None])[:, 0]
        else:
            logits, cache = self.model(*args, layers_split=self.layers)
        keys = self.keys_of(jnp.repeat(self.shard_ids, w), flat(row), flat(i))
        token, logp = _sample_rows(keys, logits[:, 0], self.sampling)
        widen = lambda x, fill: jnp.full((ways, s), fill, x.dtype).at[:, :w].set(x.reshape(ways, w))  # noqa: E731
        valid = st["valid"].at[:, :w, :cols].set(cache.valid.reshape(ways, w, cols))
        new = jnp.zeros((2, layers_n, ways, s, kvh, hd), cache.new_k.dtype).at[:, :, :, :w].set(
            jnp.stack([cache.new_k, cache.new_v])[:, :, :, 0].reshape(2, layers_n, ways, w, kvh, hd))
        if self.record_experts:
            routed = jnp.full((ways, s, *routed.shape[1:]), -1, routed.dtype).at[:, :w].set(
                routed.reshape(ways, w, *routed.shape[1:]))
            return new, valid, widen(token, self.pad_id), widen(logp, 0.0), routed
        return new, valid, widen(token, self.pad_id), widen(logp, 0.0)

    def step(self, pool, st, peak, data, version=None):
        """One decode step of every shard (the while_loop body): refill, page, compact, decode, record.
        `peak`: the most response pages in use at any step so far (all shards)."""
        shards = jax.vmap  # the bookkeeping runs per batch shard
        can_enter = jnp.any(st["row"] < 0) & jnp.any(st["status"] == WAITING)
        st = jax.lax.cond(can_enter, lambda st: shards(self.refill)(st, self.shard_ids, data), lambda st: st, st)
        # a page is granted (and the pool can run short) only when some row's next token starts a page,
        # and a step needs compacting only when an idle slot sits before an active one: skip both else
        starts = jnp.any((st["row"] >= 0) & ((st["i"] - 1) % self.ps == 0))
        st = jax.lax.cond(starts, lambda st: shards(self.allocate)(st, data), lambda st: st, st)
        peak = jnp.maximum(peak, self.resp_pages * self.ways - st["free"].sum())
        active = st["row"] >= 0
        st = jax.lax.cond(jnp.any(~active[:, :-1] & active[:, 1:]), shards(self.compact), lambda st: st, st)
        busy = (st["row"] >= 0).sum(axis=1).max()
        longest = jnp.where(st["row"] >= 0, st["i"], 0).max()  # the step feeds token i - 1: reads i columns
        branch = ((jnp.asarray(self.widths) >= busy).sum() - 1) * len(self.reads) + (
            jnp.asarray(self.reads) >= longest).sum() - 1
        branches = [lambda pool, st, w=w, r=r: self.decode(w, r, pool, st) for w in self.widths for r in self.reads]
        new, st["valid"], token, logp, *routed = jax.lax.switch(branch, branches, pool, st)
        if routed:  # each active slot's row, column i - 1
            st["experts"] = jax.vmap(lambda e, row, i, x: e.at[jnp.where(row >= 0, row, self.per_shard), i - 1].set(
                x, mode="drop"))(st["experts"], st["row"], st["i"], routed[0])
        index = (self.bucket + st["i"] - 1).reshape(-1)  # idle slots' tables are unassigned: their writes drop
        pool = tuple(write_pages(p, x.reshape(self.layers_n, self.ways * self.s, 1, self.kvh, self.hd), index,
                                 st["table"]) for p, x in zip(pool, new))
        st = shards(lambda st, data, token, logp: self.advance(st, data, token, logp, version))(st, data, token, logp)
        return pool, st, peak


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
    max_lengths: Int[Array, " batch"] | None = None,
    min_bucket: int = 16,
    record_experts: bool = False,
) -> GenerationOutput:
    """Generate for `batch` rows with a pool of `slots` rows and `kv_pages` response pages (see the
    module docstring), as one pure function (the form a placed call compiles). Rows g*G .. g*G + G-1
    must hold the same prompt (G = `group_size`); only the first of each group is read. `max_lengths`:
    a row's own cap on its response length (optional). Same outputs and conventions as
    `generation.generate_tokens` (`record_experts`: the routing of every token too), plus `kv_pages_used`."""
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
    row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(rows))
    eng = PagedEngine(model, sampling=sampling, eos_ids=eos_tuple(eos_id), pad_id=pad_id, ways=ways,
                      rows=per_shard, group=g, slots=sz.pool_size(rows, slots, ways) // ways, prompts=prompts,
                      bucket=bucket, max_new_tokens=n,
                      response_pages=sz.response_pages(bucket, n, rows, slots, kv_pages, ways), row_keys=row_keys,
                      record_experts=record_experts)

    # Each distinct prompt once: its left-aligned tokens, its last logits and its keys/values as pages.
    picked = jnp.arange(rows // g) * g
    prefill = prefill_routed if record_experts else _prefill
    out = prefill(graphdef, state, prompt_tokens[picked], prompt_mask[picked], bucket=bucket, max_new_tokens=0,
                  pad_id=pad_id)
    (group_tokens, group_mask, prefix_logits, prefix), prompt_experts = out if record_experts else (out, None)

    def to_pages(x):  # [layers, shards * prompts, kv_heads, P, hd] -> [layers, shards, pages, kv_heads, ps, hd]
        x = prompt_pages_of(x, eng.ps).reshape(eng.layers_n, ways, eng.base, eng.kvh, eng.ps, eng.hd)
        x = jnp.concatenate([x, jnp.zeros((eng.layers_n, ways, eng.resp_pages, eng.kvh, eng.ps, eng.hd), x.dtype)],
                            axis=2)
        return ax.constrain(x, (None, ax.BATCH, None, None, None, None))

    pool = (to_pages(prefix.k), to_pages(prefix.v))
    shard_view = lambda x: x.reshape(ways, -1, *x.shape[1:])  # noqa: E731  [shards * k, ...] -> [shards, k, ...]
    limits = jnp.full((rows,), n, jnp.int32) if max_lengths is None else jnp.clip(max_lengths, 1, n).astype(jnp.int32)
    data = {"mask": shard_view(group_mask), "logits": shard_view(prefix_logits),
            # the rotary position of the first response token
            "len": shard_view(group_mask.sum(axis=1).astype(jnp.int32)), "limit": shard_view(limits)}

    def cond(carry):
        return jnp.any(carry[1]["status"] != DONE)

    def body(carry):
        return eng.step(*carry, data)

    _, st, peak = jax.lax.while_loop(cond, body, (pool, eng.init_state(), jnp.int32(0)))
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
        experts=jnp.concatenate([jnp.repeat(prompt_experts, g, axis=0), st["experts"].reshape(
            rows, n, *st["experts"].shape[3:])], axis=1) if record_experts else None,
    )


continuous_fn = jax.jit(
    generate_continuous, static_argnums=0,
    static_argnames=("max_new_tokens", "sampling", "eos_id", "pad_id", "group_size", "slots", "kv_pages",
                     "min_bucket", "record_experts"),
)
