"""Streaming continuous generation: the continuous engine (`continuous.py`) as resumable chunks over a
state that persists between calls, the building block of an asynchronous generator.

Why: reasoning RL spends most of a step generating long-tailed responses. An asynchronous generator
keeps its decode batch full by admitting new prompts as groups finish, hands finished groups to the
trainer as they complete, and applies new weights at the next chunk while the rows in flight go on
with their KV cache (partial rollouts, as AReaL and verl's async trainer do). Each token records the
policy version that sampled it. Three pure, jittable functions over a `StreamState` do it:

- `admit`: prefill new prompts (each once: a group's G rows list its pages) into free group slots;
  their rows wait for a decode slot.
- `run`: the continuous engine's decode loop (`continuous.PagedEngine`: refill, paging, preemption,
  narrow widths) for at most `max_steps` steps or until `until_done_groups` groups are done. Rows still
  running at the end keep their slots, pages and outputs and continue at the next `run`, possibly with
  other parameters; every token sampled records the call's `version` (a row's first token is drawn
  from the prefill logits, so it records the version `admit` was given).
- `take` (host step): the done groups' outputs in admission order, their slots freed.

Keys: token i of sample j of the prompt with id `uid` is drawn with fold_in(fold_in(rng, uid * G + j), i)
(rng: `admit`'s), so a row's tokens do not depend on its slot, chunk, call or the pool: with the same
weights throughout, streaming equals `generate_continuous` over rows ordered uid * G + j.

Sharded batch: `StreamSpec.batch_ways` shards (the generation layout's batch ways, or 1) each own
groups / ways contiguous group slots, their rows, slots and pages, as in the continuous engine; `admit`
fills free slots round-robin over the shards. Limits: a fixed prompt bucket per state
(`StreamSpec.prompt_bucket`); uid * G + j must fit int32. The KV of tokens sampled before a weight
change is kept (the prompt's pages too: they are the admitting weights'), unless `recompute` rebuilds
it with the new weights (`generation.partial_recompute`).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxrlhf.models import axes as ax
from jaxrlhf.models import slots as sz
from jaxrlhf.models.continuous import DONE, RUNNING, WAITING, PagedEngine, prompt_pages_of
from jaxrlhf.models.generation import GenerationOutput, _prefill, check_max_positions, eos_tuple, note_trace
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import KVCache, positions_from_mask, write_pages

EMPTY = 3  # a row of a free group slot (the engine's WAITING, RUNNING, DONE otherwise)
FREE, GROUP_RUNNING, GROUP_DONE = 0, 1, 2  # a group slot's status


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """The static shape of a stream (hashable: a static argument). `groups` group slots of `group_size`
    rows; prompts of up to `prompt_bucket` tokens (a multiple of 16 keeps pages of 16); `slots` rows decode
    at once (None: every row); `kv_pages` response pages (None: every slot's full response, never
    preempts); `batch_ways`: shards of the batch axis (each its own groups / ways group slots, slots and
    pages; all sizes here are over all shards, as `generation.slots` and `kv_pages` are)."""

    groups: int
    group_size: int
    max_new_tokens: int
    prompt_bucket: int
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    pad_id: int
    slots: int | None = None
    kv_pages: int | None = None
    batch_ways: int = 1

    @classmethod
    def make(cls, *, eos_id: int | Sequence[int] | None, **kw) -> "StreamSpec":
        return cls(eos_ids=eos_tuple(eos_id), **kw)

    @property
    def rows(self) -> int:
        return self.groups * self.group_size

    @property
    def slots_per_shard(self) -> int:
        return sz.pool_size(self.rows, self.slots, self.batch_ways) // self.batch_ways

    @property
    def response_pages(self) -> int:
        """Response pages of one shard."""
        return sz.response_pages(self.prompt_bucket, self.max_new_tokens, self.rows, self.slots, self.kv_pages,
                                 self.batch_ways)


@struct.dataclass
class StreamState:
    """Everything a stream keeps between calls (R = groups x G rows, N = max_new_tokens, P = bucket).

    `pool`: (keys, values) pages [layers, shards, groups / shards x P/16 prompt pages + response pages,
    kv_heads, 16, head_dim]; group slot q (shard q // (groups / shards)) owns the prompt pages
    (q % (groups / shards)) x P/16 ... of its shard (written by `admit`, never by decode).
    `rows`: the engine's dict (`PagedEngine.init_state`, [shards, ...]; row q x G + j is row
    (q x G + j) % (R / shards) of shard (q x G + j) // (R / shards)): per slot its row,
    token index, last token, position, block table and valid columns; the response pages' free list;
    per row its status (waiting / running / done / EMPTY), tokens, log-probs, valid mask, ended_with_eos
    and each token's `version` (int32); `preempted`: rows preempted so far."""

    pool: tuple[jax.Array, jax.Array]
    rows: dict
    prompt_tokens: Int[Array, "groups bucket"]  # left-aligned
    prompt_mask: Bool[Array, "groups bucket"]
    prefill_logits: Float[Array, "groups vocab"]
    first_version: Int[Array, " groups"]  # `admit`'s version: the prefill's weights (a row's token 0)
    uid: Int[Array, " groups"]  # -1 for a free slot
    serial: Int[Array, " groups"]  # admission order (lower enters slots first and keeps its pages)
    status: Int[Array, " groups"]  # FREE / GROUP_RUNNING / GROUP_DONE
    limit: Int[Array, " rows"]  # a row's cap on its response length
    row_key: PRNGKeyArray  # [rows]: fold_in(rng, uid * G + j)
    admitted: Int[Array, ""]  # groups admitted so far (the next serial)
    steps: Int[Array, ""]  # decode steps run so far
    kv_pages_used: Int[Array, ""]  # the most response pages in use at any step so far


@dataclasses.dataclass
class Taken:
    """`take`'s result (host arrays): `output` holds the taken groups' G rows each, group after group in
    admission order (row k * G + j: sample j of `uids[k]`); `versions[r, i]`: the version that sampled
    response token i of row r (-1 past the response)."""

    output: GenerationOutput
    versions: np.ndarray
    uids: np.ndarray
    serials: np.ndarray  # each taken group's admission number (`StreamState.admitted` when it came in)


def _check(spec: StreamSpec) -> None:
    if ax.batch_ways() not in (1, spec.batch_ways):
        raise ValueError(f"the generation layout shards the batch {ax.batch_ways()} ways but the stream was "
                         f"made for batch_ways={spec.batch_ways}")
    if spec.batch_ways < 1 or spec.groups % spec.batch_ways:
        raise ValueError(f"{spec.groups} group slots do not split into batch_ways={spec.batch_ways} shards")
    if spec.prompt_bucket < 1 or spec.max_new_tokens < 1:
        raise ValueError(f"prompt_bucket and max_new_tokens must be >= 1: {spec}")


def _constrain(pool: jax.Array) -> jax.Array:
    return ax.constrain(pool, (None, ax.BATCH, None, None, None, None))


def _engine(model: nnx.Module, spec: StreamSpec, row_keys: PRNGKeyArray) -> PagedEngine:
    ways = spec.batch_ways
    return PagedEngine(model, sampling=spec.sampling, eos_ids=spec.eos_ids, pad_id=spec.pad_id, ways=ways,
                       rows=spec.rows // ways, group=spec.group_size, slots=spec.slots_per_shard,
                       prompts=spec.groups // ways,
                       bucket=spec.prompt_bucket, max_new_tokens=spec.max_new_tokens,
                       response_pages=spec.response_pages, row_keys=row_keys)


def init(graphdef: nnx.GraphDef, params: nnx.State, *, spec: StreamSpec) -> StreamState:
    """An empty stream: every group slot free, every page free."""
    _check(spec)
    model = nnx.merge(graphdef, params)
    cfg = model.config
    check_max_positions(cfg.max_position_embeddings, spec.prompt_bucket, spec.max_new_tokens)
    sz.check_groups(spec.rows, spec.group_size)
    keys = jax.random.split(jax.random.key(0), spec.rows)
    eng = _engine(model, spec, keys)
    pages = eng.base + eng.resp_pages
    ways = spec.batch_ways
    shape = (cfg.num_layers, ways, pages, cfg.num_kv_heads, eng.ps, cfg.dim_per_head)
    rows = dict(eng.init_state(), status=jnp.full((ways, spec.rows // ways), EMPTY, jnp.int32),
                version=jnp.zeros((ways, spec.rows // ways, spec.max_new_tokens), jnp.int32),
                preempted=jnp.zeros((ways,), jnp.int32))
    g, b = spec.groups, spec.prompt_bucket
    return StreamState(
        pool=(_constrain(jnp.zeros(shape, cfg.jnp_dtype)), _constrain(jnp.zeros(shape, cfg.jnp_dtype))), rows=rows,
        prompt_tokens=jnp.full((g, b), spec.pad_id, jnp.int32), prompt_mask=jnp.zeros((g, b), bool),
        prefill_logits=jnp.zeros((g, cfg.vocab_size), jnp.float32), first_version=jnp.zeros((g,), jnp.int32),
        uid=jnp.full((g,), -1, jnp.int32), serial=jnp.zeros((g,), jnp.int32),
        status=jnp.full((g,), FREE, jnp.int32), limit=jnp.full((spec.rows,), spec.max_new_tokens, jnp.int32),
        row_key=keys, admitted=jnp.int32(0), steps=jnp.int32(0), kv_pages_used=jnp.int32(0))


def admit(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: StreamState,
    prompt_tokens: Int[Array, "k length"],
    prompt_mask: Bool[Array, "k length"],
    uids: Int[Array, " k"],
    rng: PRNGKeyArray,
    *,
    spec: StreamSpec,
    version: Int[Array, ""] | int = 0,
    max_lengths: Int[Array, " k"] | Int[Array, "k group"] | None = None,
    tag: Hashable = None,
) -> tuple[StreamState, Bool[Array, " k"]]:
    """Prefill k prompts (one row each, `length` <= the bucket) and place them, in order, into free group
    slots (the lowest of each shard first, round-robin over the shards); returns the state and which were
    admitted. A prompt with uid < 0 is a blank (pad a call to a fixed k with them: one program); prompts
    beyond the free slots are not admitted (check the mask: nothing is queued). `max_lengths`: a prompt's
    cap on each of its responses, or [k, G] one per response (optional)."""
    note_trace("stream_admit")
    _check(spec)
    k, width = prompt_tokens.shape
    if width > spec.prompt_bucket:
        raise ValueError(f"prompts of width {width} do not fit the stream's prompt_bucket {spec.prompt_bucket}")
    G, n, groups = spec.group_size, spec.max_new_tokens, spec.groups
    model = nnx.merge(graphdef, params)
    eng = _engine(model, spec, state.row_key)
    tokens, mask, logits, prefix = _prefill(graphdef, params, prompt_tokens, prompt_mask,
                                            bucket=spec.prompt_bucket, max_new_tokens=0, pad_id=spec.pad_id)
    uids = jnp.asarray(uids, jnp.int32)
    want = uids >= 0
    rank = jnp.cumsum(want) - 1
    per_shard = groups // spec.batch_ways  # group slots per shard
    q = jnp.arange(groups)
    free = jnp.where(state.status == FREE, q % per_shard * spec.batch_ways + q // per_shard, groups)  # rank
    free = jnp.concatenate([jnp.where(jnp.sort(free) < groups, jnp.argsort(free), groups),
                            jnp.full((k,), groups, jnp.int32)])[:k]  # free slots in round-robin order
    slot = jnp.where(want, free[jnp.clip(rank, 0, k - 1)], groups)  # `groups`: not admitted (writes drop)
    accepted = slot < groups
    serial = state.admitted + rank
    version = jnp.asarray(version, jnp.int32)

    shard = slot // per_shard  # out of range for a prompt not admitted: its writes drop
    page_ids = slot[:, None] % per_shard * eng.prompt_pages + jnp.arange(eng.prompt_pages)
    pool = tuple(_constrain(p.at[:, shard[:, None], page_ids].set(prompt_pages_of(x, eng.ps).astype(p.dtype),
                                                                   mode="drop"))
                 for p, x in zip(state.pool, (prefix.k, prefix.v)))
    j = jnp.arange(G)
    rows = (slot[:, None] * G + j).reshape(-1)  # out of range for a prompt not admitted
    limits = jnp.full((k,), n, jnp.int32) if max_lengths is None else jnp.clip(max_lengths, 1, n).astype(jnp.int32)
    limits = jnp.broadcast_to(limits.reshape(k, -1), (k, G)).reshape(-1)  # one per row
    keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))((uids[:, None] * G + j).reshape(-1))
    rows_s = spec.rows // spec.batch_ways
    st = dict(state.rows, status=state.rows["status"].at[rows // rows_s, rows % rows_s].set(WAITING, mode="drop"))
    put = lambda x, at, v: x.at[at].set(v, mode="drop")  # noqa: E731
    state = state.replace(
        pool=pool, rows=st,
        prompt_tokens=put(state.prompt_tokens, slot, tokens), prompt_mask=put(state.prompt_mask, slot, mask),
        prefill_logits=put(state.prefill_logits, slot, logits.astype(jnp.float32)),
        first_version=put(state.first_version, slot, version), uid=put(state.uid, slot, uids),
        serial=put(state.serial, slot, serial), status=put(state.status, slot, GROUP_RUNNING),
        limit=put(state.limit, rows, limits), row_key=put(state.row_key, rows, keys),
        admitted=state.admitted + accepted.sum(dtype=jnp.int32))
    return state, accepted


def run(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: StreamState,
    *,
    spec: StreamSpec,
    version: Int[Array, ""] | int,
    max_steps: Int[Array, ""] | int,
    until_done_groups: Int[Array, ""] | int,
    tag: Hashable = None,
) -> StreamState:
    """Decode for at most `max_steps` steps, or until at least `until_done_groups` groups are done (not
    yet taken), or until no row is left to decode; every token sampled records `version`. Rows still
    running keep their slots, pages and outputs for the next call (which may pass other `params`)."""
    note_trace("stream_run")
    _check(spec)
    G = spec.group_size
    model = nnx.merge(graphdef, params)
    eng = _engine(model, spec, state.row_key)
    shards = lambda x: x.reshape(spec.batch_ways, -1, *x.shape[1:])  # noqa: E731  [k, ...] -> [shards, k/shards, ...]
    data = {"mask": shards(state.prompt_mask), "logits": shards(state.prefill_logits),
            "len": shards(state.prompt_mask.sum(axis=1).astype(jnp.int32)), "limit": shards(state.limit),
            "prio": shards((state.serial[:, None] * G + jnp.arange(G)).reshape(-1)),
            "v0": shards(state.first_version)}
    version = jnp.asarray(version, jnp.int32)
    stop = state.steps + jnp.asarray(max_steps, jnp.int32)
    until = jnp.asarray(until_done_groups, jnp.int32)

    def groups_done(st):
        return jnp.all(st["status"].reshape(spec.groups, G) == DONE, axis=1)

    def cond(carry):
        _, st, _, steps = carry
        busy = jnp.any((st["status"] == WAITING) | (st["status"] == RUNNING))
        return busy & (steps < stop) & (groups_done(st).sum() < until)

    def body(carry):
        pool, st, peak, steps = carry
        return *eng.step(pool, st, peak, data, version), steps + 1

    pool, st, peak, steps = jax.lax.while_loop(
        cond, body, (state.pool, state.rows, state.kv_pages_used, state.steps))
    status = jnp.where(groups_done(st), GROUP_DONE, state.status)
    return state.replace(pool=tuple(_constrain(p) for p in pool), rows=st, kv_pages_used=peak, steps=steps,
                         status=status)


def release_done(state: StreamState, *, spec: StreamSpec, tag: Hashable = None
                 ) -> tuple[StreamState, dict, Bool[Array, " groups"]]:
    """Every group slot's outputs (done or not), which are done, and the state with the done slots
    freed (their rows empty, outputs cleared; their response pages went back when their rows ended, and
    their prompt pages are the next admission's to overwrite)."""
    note_trace("stream_release")
    G = spec.group_size
    done = state.status == GROUP_DONE
    st = state.rows
    flat = lambda x: x.reshape(spec.rows, *x.shape[2:])  # noqa: E731  [shards, R / shards, ...] -> [R, ...]
    valid = flat(st["out_valid"])
    outs = {"prompt_tokens": state.prompt_tokens, "prompt_mask": state.prompt_mask, "uid": state.uid,
            "serial": state.serial, "tokens": flat(st["tokens"]), "logp": flat(st["logp"]), "valid": valid,
            "version": jnp.where(valid, flat(st["version"]), -1), "ended": flat(st["ended"])}
    clear = jnp.repeat(done, G)

    def keep(x, empty):
        return jnp.where(clear.reshape(-1, *[1] * (x.ndim - 2)), empty, flat(x)).reshape(x.shape)

    rows = dict(st, status=keep(st["status"], EMPTY), tokens=keep(st["tokens"], spec.pad_id),
                logp=keep(st["logp"], 0.0), out_valid=keep(st["out_valid"], False),
                version=keep(st["version"], 0), ended=keep(st["ended"], False))
    state = state.replace(rows=rows, status=jnp.where(done, FREE, state.status),
                          uid=jnp.where(done, -1, state.uid))
    return state, outs, done


# The state is donated: a call writes the pool and outputs in place (one copy of the pool, not two);
# the state passed in is invalid afterwards. `tag` only separates compile caches, as in `generation`:
# one per `axes.activation_sharding` resolver a stream is traced under.
admit_fn = jax.jit(admit, static_argnums=0, static_argnames=("spec", "tag"), donate_argnames=("state",))
run_fn = jax.jit(run, static_argnums=0, static_argnames=("spec", "tag"), donate_argnames=("state",))
release_fn = jax.jit(release_done, static_argnames=("spec", "tag"), donate_argnames=("state",))


def take(state: StreamState, *, spec: StreamSpec, tag: Hashable = None, read=jax.device_get
         ) -> tuple[Taken, StreamState]:
    """The done groups' outputs (host arrays, admission order) and the state with their slots freed.
    `read` brings device values to host (a multi-process run reads them alike on every process)."""
    state, outs, done = release_fn(state, spec=spec, tag=tag)
    outs, done = read((outs, done))
    G = spec.group_size
    picked = np.flatnonzero(done)
    picked = picked[np.argsort(outs["serial"][picked], kind="stable")]
    rows = (picked[:, None] * G + np.arange(G)).reshape(-1)
    prompt_tokens = np.repeat(outs["prompt_tokens"][picked], G, axis=0)
    response = outs["tokens"][rows]
    valid = outs["valid"][rows]
    output = GenerationOutput(
        tokens=np.concatenate([prompt_tokens, response], axis=1), prompt_tokens=prompt_tokens,
        prompt_mask=np.repeat(outs["prompt_mask"][picked], G, axis=0), response_tokens=response,
        response_mask=valid, logprobs=outs["logp"][rows], lengths=valid.sum(axis=1).astype(np.int32),
        ended_with_eos=outs["ended"][rows])
    return Taken(output=output, versions=outs["version"][rows], uids=outs["uid"][picked],
                 serials=outs["serial"][picked]), state


def recompute(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    state: StreamState,
    *,
    spec: StreamSpec,
    version: Int[Array, ""] | int,
    tag: Hashable = None,
) -> StreamState:
    """The keys/values of every admitted prompt and of every decoding row's tokens so far recomputed
    with `params` (`generation.partial_recompute`): one prefill of each prompt (its pages and the
    logits a waiting row samples its first token from, recorded as `version`) and one of each slot's
    prompt + response, written into the row's own pages. A row then decodes on exactly as a full
    forward of the new weights over its tokens would, instead of over keys/values the old weights
    wrote. The tokens already sampled, their log-probs and versions stay: the old weights drew them."""
    note_trace("stream_recompute")
    _check(spec)
    model = nnx.merge(graphdef, params)
    eng = _engine(model, spec, state.row_key)
    P, N, groups, ways = spec.prompt_bucket, spec.max_new_tokens, spec.groups, spec.batch_ways
    per_shard = groups // ways
    _, _, logits, prefix = _prefill(graphdef, params, state.prompt_tokens, state.prompt_mask, bucket=P,
                                    max_new_tokens=0, pad_id=spec.pad_id)
    q = jnp.arange(groups)
    admitted = state.status != FREE
    shard = jnp.where(admitted, q // per_shard, ways)  # a free slot's writes drop
    page_ids = q[:, None] % per_shard * eng.prompt_pages + jnp.arange(eng.prompt_pages)
    pool = tuple(p.at[:, shard[:, None], page_ids].set(prompt_pages_of(x, eng.ps).astype(p.dtype), mode="drop")
                 for p, x in zip(state.pool, (prefix.k, prefix.v)))

    st = state.rows
    rows_s = spec.rows // ways
    slot_rows = jnp.clip(st["row"], 0, rows_s - 1) + jnp.arange(ways)[:, None] * rows_s  # [shards, slots] flat
    slot_rows = slot_rows.reshape(-1)
    group = slot_rows // spec.group_size
    flat = lambda x: x.reshape(spec.rows, *x.shape[2:])  # noqa: E731
    tokens = jnp.concatenate([state.prompt_tokens[group], flat(st["tokens"])[slot_rows]], axis=1)
    mask = jnp.concatenate([state.prompt_mask[group], flat(st["out_valid"])[slot_rows]], axis=1)
    mask = mask & (st["row"] >= 0).reshape(-1, 1)
    cache = KVCache.init(model.config, tokens.shape[0], P + N)
    _, cache = model(tokens, positions_from_mask(mask), mask, cache, logits_from=-1)
    # response columns P.. of each slot into the pages its table lists: an idle slot's table and the
    # columns past its pages are unassigned (dropped); columns from its last token on are not valid
    # yet, and decode writes each before attending to it
    response = lambda x: jnp.swapaxes(x[:, :, :, P:], 2, 3)  # noqa: E731  [layers, slots, N, kv_heads, hd]
    offset = jnp.full((tokens.shape[0],), P, jnp.int32)
    pool = tuple(_constrain(write_pages(p, response(x), offset, st["table"])) for p, x in zip(pool, (cache.k, cache.v)))
    version = jnp.asarray(version, jnp.int32)
    return state.replace(pool=pool, prefill_logits=jnp.where(admitted[:, None], logits.astype(jnp.float32),
                                                             state.prefill_logits),
                         first_version=jnp.where(admitted, version, state.first_version))


# donated as `run`'s state is
recompute_fn = jax.jit(recompute, static_argnums=0, static_argnames=("spec", "tag"), donate_argnames=("state",))


def finished_rows(state: StreamState, *, spec: StreamSpec, tag: Hashable = None
                  ) -> tuple[Bool[Array, " rows"], Int[Array, " groups"]]:
    """Which rows have ended (row q x G + j of group slot q) and each group slot's admission serial: a
    row's output is final once it is done (a done row is never preempted), so it can be scored before
    its group ends (`response_rows` reads it). A read: the state is left as it is."""
    return state.rows["status"].reshape(spec.rows) == DONE, state.serial


def response_rows(state: StreamState, rows: Int[Array, " k"], *, spec: StreamSpec, tag: Hashable = None
                  ) -> tuple[Int[Array, "k new"], Bool[Array, "k new"]]:
    """The response tokens and valid mask of `rows` (indices as `finished_rows` numbers them): only
    those rows cross to the host, not the whole stream's."""
    flat = lambda x: x.reshape(spec.rows, *x.shape[2:])  # noqa: E731  [shards, R / shards, ...] -> [R, ...]
    return flat(state.rows["tokens"])[rows], flat(state.rows["out_valid"])[rows]


finished_rows_fn = jax.jit(finished_rows, static_argnames=("spec", "tag"))
response_rows_fn = jax.jit(response_rows, static_argnames=("spec", "tag"))


def free_groups(state: StreamState) -> int:
    """Group slots an `admit` can fill now (a host read)."""
    return int(jax.device_get((state.status == FREE).sum()))
