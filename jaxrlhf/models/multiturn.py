"""Multi-turn generation: rows that talk to environments, on a paged KV cache that is extended, never
recomputed (docs/agentic.md, "Multi-turn generation").

A row decodes until it samples an end-of-turn token (one of the EOS ids). It then waits while its
environment steps (on host threads; with `env.workers` the threads wait on worker processes holding the
environments, `environments/pool.py`), and the rest of the batch keeps decoding. The observation's tokens
are appended by an *extend* prefill: one forward over [the turn's last sampled token, the observation's
tokens] at the row's own next columns and rotary positions, reading the row's existing pages (the
prefix is never recomputed) and writing the new keys/values into its pages; its last logits give the
row's next token, and the row resumes. Trajectories are token in / token out: a row's response is the
tokens it sampled and the observation tokens interleaved, exactly as fed to the model, with a
`loss_mask` that is 0 on observation tokens (so the training forward scores exactly these tokens).

Device functions (pure, jitted, static `MultiTurnSpec`), over a `MultiTurnState`:

- `start`: the prompts prefilled once (dense, as the other engines), cut into each row's first pages,
  and each row's first token sampled from the prefill logits.
- `decode`: up to `steps` decode steps of every running row (`lax.while_loop`); a row that samples an
  end-of-turn token stops (AWAIT), and so does one that fills its turn budget (`max_turn_tokens`: the turn
  is cut; the host closes it with an end-of-turn token, a loss-masked observation token, before the
  observation); one that fills the trajectory's budget (`max_tokens`) is done.
- `extend`: the waiting rows named by `extending` take their observation tokens and resume.

`generate_multiturn` is the host loop: `decode` a chunk, hand the rows that ended a turn to their
environments on a thread pool (their steps run while the next chunk decodes), `extend` the rows whose
observations are back, until every row is done. Sampling keys are per row and response index,
`fold_in(fold_in(rng, row), n)`, so a row's draws do not depend on chunking or on other rows.

Layout: row r owns pages r x W ... (W = pages of prompt bucket + max_tokens); its block table lists them,
then unassigned entries for an extend's padding columns (their writes drop). No shared prompt pages,
no preemption: the pool holds every row's full trajectory (the single-turn engines' savings are not
here yet). One batch shard (the pool is not sharded).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxrlhf.models import slots as sz
from jaxrlhf.models.continuous import _sample_rows, prompt_pages_of
from jaxrlhf.models.generation import _prefill, check_max_positions
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.transformer import PagedKVCache, split_layers, write_pages

RUNNING, AWAIT, DONE = 0, 1, 2  # a row's status
# why a row is done (MultiTurnState.finish): the host's reasons (the environment ended it) come after
NOT_DONE, MAX_TOKENS, ENV_DONE, MAX_TURNS, ENV_ERROR = 0, 1, 2, 3, 4
FINISH_NAMES = {NOT_DONE: "", MAX_TOKENS: "max_tokens", ENV_DONE: "done", MAX_TURNS: "max_turns",
                ENV_ERROR: "env_error"}
# `MultiTurnOutput.metrics` of the engine's work on a batch: they depend on when the environments answer (the
# same episodes decode in more steps when rows fall out of step), unlike the trajectories
ENGINE_METRICS = ("env/decode_steps", "env/extends", "env/wait_s", "env/step_s")


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec:
    """Static sizes (hashable): `rows` rows, prompts of up to `prompt_bucket` tokens, `max_tokens` response
    tokens per trajectory (model and observation tokens together), `max_turn_tokens` model tokens per turn,
    observations of up to `max_observation_tokens` tokens per extend (an extend call's width)."""

    rows: int
    prompt_bucket: int
    max_tokens: int
    max_turn_tokens: int
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    pad_id: int
    max_observation_tokens: int = 256

    @property
    def page(self) -> int:
        return sz.page_size(self.prompt_bucket)

    @property
    def row_pages(self) -> int:
        """Pages a row owns: its prompt bucket and `max_tokens` response columns."""
        return -(-(self.prompt_bucket + self.max_tokens) // self.page)

    @property
    def extend_width(self) -> int:
        """Tokens of one extend call: the pending token and an observation."""
        return 1 + self.max_observation_tokens

    @property
    def table_width(self) -> int:
        """Block-table entries per row: its pages, then unassigned ones an extend's padding writes to."""
        return self.row_pages + -(-self.extend_width // self.page)

    @property
    def columns(self) -> int:
        return self.table_width * self.page


@struct.dataclass
class MultiTurnState:
    """The pool and every row's state. Response index n of row r is column `prompt_bucket + n` and rotary
    position `prompt_len[r] + n`. `n[r]` tokens are recorded; the last of them (`tokens[r, n - 1]`) is sampled
    but not yet fed to the model (a decode step or an extend feeds it)."""

    pool: tuple[jax.Array, jax.Array]  # [layers, 1, rows x row_pages, kv_heads, page, head_dim]
    valid: Bool[Array, "rows columns"]
    prompt_tokens: Int[Array, "rows bucket"]
    prompt_mask: Bool[Array, "rows bucket"]
    prompt_len: Int[Array, " rows"]
    tokens: Int[Array, "rows n"]
    logp: Float[Array, "rows n"]
    loss_mask: Bool[Array, "rows n"]  # True on sampled tokens
    n: Int[Array, " rows"]
    turn_len: Int[Array, " rows"]  # model tokens sampled in the current turn
    status: Int[Array, " rows"]
    finish: Int[Array, " rows"]
    ended: Bool[Array, " rows"]  # the last model token was an end-of-turn token
    row_key: PRNGKeyArray


def _tables(spec: MultiTurnSpec, rows: Bool[Array, " rows"]) -> Int[Array, "1 rows table"]:
    """Each row's block table (its own pages, then unassigned entries); rows not in `rows` unassigned."""
    unassigned = spec.rows * spec.row_pages
    own = jnp.arange(spec.rows)[:, None] * spec.row_pages + jnp.arange(spec.row_pages)[None, :]
    table = jnp.concatenate([own, jnp.full((spec.rows, spec.table_width - spec.row_pages), unassigned)], axis=1)
    return jnp.where(rows[:, None], table, unassigned).astype(jnp.int32)[None]


def _record(spec: MultiTurnSpec, st: MultiTurnState, write: Bool[Array, " rows"], token: Int[Array, " rows"],
            logp: Float[Array, " rows"]) -> MultiTurnState:
    """Store a sampled token at each writing row's next index; end its turn or its trajectory."""
    r = jnp.arange(spec.rows)
    at = jnp.where(write, st.n, spec.max_tokens)  # out of range: dropped
    is_eos = jnp.isin(token, jnp.asarray(spec.eos_ids or (-1,), jnp.int32))
    n, turn_len = st.n + write, st.turn_len + write
    full = n >= spec.max_tokens
    turn_full = turn_len >= spec.max_turn_tokens
    # the environment sees every finished turn, and a turn cut at its budget (the host ends a row with no room)
    await_ = write & (is_eos | (turn_full & ~full))
    done = write & ~await_ & full
    finish = jnp.where(done, MAX_TOKENS, st.finish)
    return st.replace(
        tokens=st.tokens.at[r, at].set(token, mode="drop"), logp=st.logp.at[r, at].set(logp, mode="drop"),
        loss_mask=st.loss_mask.at[r, at].set(True, mode="drop"), n=n, turn_len=turn_len,
        status=jnp.where(await_, AWAIT, jnp.where(done, DONE, st.status)), finish=finish,
        ended=jnp.where(write, is_eos, st.ended))


def _keys(st: MultiTurnState) -> PRNGKeyArray:
    return jax.vmap(jax.random.fold_in)(st.row_key, st.n)


def start(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens: Int[Array, "rows length"],
          prompt_mask: Bool[Array, "rows length"], rng: PRNGKeyArray, *, spec: MultiTurnSpec) -> MultiTurnState:
    """Prefill the prompts, lay them into each row's first pages, sample each row's first token."""
    model = nnx.merge(graphdef, params)
    cfg = model.config
    check_max_positions(cfg.max_position_embeddings, spec.prompt_bucket, spec.max_tokens)
    tokens, mask, logits, prefix = _prefill(graphdef, params, prompt_tokens, prompt_mask,
                                            bucket=spec.prompt_bucket, max_new_tokens=0, pad_id=spec.pad_id)
    pp = spec.prompt_bucket // spec.page

    def to_pool(x):  # [layers, rows, kv_heads, P, hd] -> [layers, 1, rows x row_pages, kv_heads, page, hd]
        pages = prompt_pages_of(x, spec.page)  # [layers, rows, pp, kv_heads, page, hd]
        rest = jnp.zeros((*pages.shape[:2], spec.row_pages - pp, *pages.shape[3:]), pages.dtype)
        return jnp.concatenate([pages, rest], axis=2).reshape(pages.shape[0], 1, -1, *pages.shape[3:])

    rows, n = spec.rows, spec.max_tokens
    st = MultiTurnState(
        pool=(to_pool(prefix.k), to_pool(prefix.v)),
        valid=jnp.pad(mask, ((0, 0), (0, spec.columns - spec.prompt_bucket))),
        prompt_tokens=tokens, prompt_mask=mask, prompt_len=mask.sum(axis=1).astype(jnp.int32),
        tokens=jnp.full((rows, n), spec.pad_id, jnp.int32), logp=jnp.zeros((rows, n), jnp.float32),
        loss_mask=jnp.zeros((rows, n), bool), n=jnp.zeros((rows,), jnp.int32),
        turn_len=jnp.zeros((rows,), jnp.int32), status=jnp.full((rows,), RUNNING, jnp.int32),
        finish=jnp.zeros((rows,), jnp.int32), ended=jnp.zeros((rows,), bool),
        row_key=jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.arange(rows)))
    token, logp = _sample_rows(_keys(st), logits, spec.sampling)
    return _record(spec, st, jnp.ones((rows,), bool), token, logp)


def _forward(model, layers, spec: MultiTurnSpec, st: MultiTurnState, rows: Bool[Array, " rows"],
             tokens: Int[Array, "rows t"], mask: Bool[Array, "rows t"]):
    """The `rows`' tokens (the pending one first) at their next columns, reading and then writing their
    pages; returns every position's logits and the state with the pool and valid columns updated."""
    col = spec.prompt_bucket + st.n - 1  # the pending token's column
    positions = st.prompt_len[:, None] + st.n[:, None] - 1 + jnp.arange(tokens.shape[1])[None, :]
    table = _tables(spec, rows)
    cache = PagedKVCache(k=st.pool[0], v=st.pool[1], valid=st.valid, index=col, table=table)
    logits, cache = model(tokens, positions, mask & rows[:, None], cache, layers_split=layers)
    pool = tuple(write_pages(p, x, col, table) for p, x in zip(st.pool, (cache.new_k, cache.new_v)))
    return logits, st.replace(pool=pool, valid=jnp.where(rows[:, None], cache.valid, st.valid))


def decode(graphdef: nnx.GraphDef, params: nnx.State, st: MultiTurnState, *, spec: MultiTurnSpec,
           steps: int) -> MultiTurnState:
    """Up to `steps` decode steps of every RUNNING row, or until none runs."""
    model = nnx.merge(graphdef, params)
    layers = split_layers(model)

    def body(carry):
        st, step = carry
        running = st.status == RUNNING
        pending = st.tokens[jnp.arange(spec.rows), jnp.maximum(st.n - 1, 0)]
        logits, st = _forward(model, layers, spec, st, running, pending[:, None], running[:, None])
        token, logp = _sample_rows(_keys(st), logits[:, 0], spec.sampling)
        return _record(spec, st, running, token, logp), step + 1

    def cond(carry):
        st, step = carry
        return jnp.any(st.status == RUNNING) & (step < steps)

    return jax.lax.while_loop(cond, body, (st, jnp.int32(0)))[0]


def extend(graphdef: nnx.GraphDef, params: nnx.State, st: MultiTurnState,
           observation: Int[Array, "rows width"], length: Int[Array, " rows"], extending: Bool[Array, " rows"], *,
           spec: MultiTurnSpec) -> tuple[MultiTurnState, Float[Array, "rows vocab"]]:
    """The `extending` rows (waiting, with room for their observation and one more token) append their
    observation's `length` tokens (loss_mask 0) after their pending token, and sample their next token
    from the last logits (returned, for tests). `width` = `spec.extend_width - 1`."""
    model = nnx.merge(graphdef, params)
    r = jnp.arange(spec.rows)
    pending = st.tokens[r, jnp.maximum(st.n - 1, 0)]
    tokens = jnp.concatenate([pending[:, None], observation.astype(jnp.int32)], axis=1)
    mask = jnp.arange(tokens.shape[1])[None, :] <= length[:, None]
    logits, st = _forward(model, split_layers(model), spec, st, extending, tokens, mask)
    last = logits[r, length]
    cols = st.n[:, None] + jnp.arange(observation.shape[1])[None, :]
    cols = jnp.where(extending[:, None] & (jnp.arange(observation.shape[1])[None, :] < length[:, None]), cols,
                     spec.max_tokens)
    st = st.replace(tokens=st.tokens.at[r[:, None], cols].set(observation, mode="drop"),
                    n=st.n + jnp.where(extending, length, 0), turn_len=jnp.where(extending, 0, st.turn_len),
                    status=jnp.where(extending, RUNNING, st.status))
    token, logp = _sample_rows(_keys(st), last, spec.sampling)
    return _record(spec, st, extending, token, logp), last


def stop(st: MultiTurnState, rows: Bool[Array, " rows"], reason: Int[Array, " rows"]) -> MultiTurnState:
    """Mark `rows` done (the host's reasons: the environment ended the episode, or a budget)."""
    return st.replace(status=jnp.where(rows, DONE, st.status), finish=jnp.where(rows, reason, st.finish))


def admit(graphdef: nnx.GraphDef, params: nnx.State, st: MultiTurnState, prompt_tokens: Int[Array, "rows length"],
          prompt_mask: Bool[Array, "rows length"], rows: Bool[Array, " rows"], rng: PRNGKeyArray, *,
          spec: MultiTurnSpec) -> MultiTurnState:
    """The `rows` start afresh from their prompts (prefilled into their own pages, first token sampled, as
    `start` does); every other row keeps its state and pages. The prefill runs over every row (the others'
    prompt rows are ignored): one program whatever rows are admitted."""
    fresh = start(graphdef, params, prompt_tokens, prompt_mask, rng, spec=spec)
    per_row = lambda x: x.reshape(x.shape[0], 1, spec.rows, spec.row_pages, *x.shape[3:])  # noqa: E731
    pick = rows[None, None, :, None, None, None, None]
    pool = tuple(jnp.where(pick, per_row(new), per_row(old)).reshape(old.shape) for new, old in zip(fresh.pool, st.pool))

    def row_wise(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(rows.reshape(-1, *([1] * (new.ndim - 1))), new, old)

    others = {f.name: row_wise(getattr(fresh, f.name), getattr(st, f.name))
              for f in dataclasses.fields(MultiTurnState) if f.name not in ("pool", "row_key")}
    row_key = jax.vmap(lambda keep, new, old: jax.lax.select(keep, new, old))(
        rows, jax.random.key_data(fresh.row_key), jax.random.key_data(st.row_key))
    return st.replace(pool=pool, row_key=jax.random.wrap_key_data(row_key), **others)


def rewind(st: MultiTurnState, rows: Bool[Array, " rows"], n: Int[Array, " rows"], *,
           spec: MultiTurnSpec) -> MultiTurnState:
    """The `rows` cut back to their first `n` response tokens (n >= 1), the last of them pending again (fed by
    the next extend), waiting: their cache past it no longer counts. What a caller does when a row sampled
    more than its record kept (an answer cut at a stop string or a token limit) before extending it."""
    n = jnp.where(rows, n, st.n)
    columns = jnp.arange(spec.columns)[None, :]
    valid = jnp.where(rows[:, None] & (columns >= spec.prompt_bucket + n[:, None] - 1), False, st.valid)
    return st.replace(n=n, valid=valid, turn_len=jnp.where(rows, 0, st.turn_len),
                      status=jnp.where(rows, AWAIT, st.status), finish=jnp.where(rows, NOT_DONE, st.finish))


start_fn = jax.jit(start, static_argnums=0, static_argnames=("spec",))
admit_fn = jax.jit(admit, static_argnums=0, static_argnames=("spec",), donate_argnames=("st",))
rewind_fn = jax.jit(rewind, static_argnames=("spec",), donate_argnames=("st",))
decode_fn = jax.jit(decode, static_argnums=0, static_argnames=("spec", "steps"), donate_argnames=("st",))
extend_fn = jax.jit(extend, static_argnums=0, static_argnames=("spec",), donate_argnames=("st",))
stop_fn = jax.jit(stop, donate_argnames=("st",))


# ---------------------------------------------------------------- the host loop


@dataclasses.dataclass
class MultiTurnOutput:
    """Host arrays, one row per trajectory: the left-padded prompts, the responses (model and observation
    tokens interleaved, pad after `lengths`), the behaviour log-probs (0 on observation tokens), `loss_mask`
    (1 on sampled tokens), `response_mask` (every real response token), and per row the environment's
    reward, turns, counters (summed step infos) and why it ended (`FINISH_NAMES`); and for the batch, what the
    planner prices an episode batch with (`planner.episodes`): the decode steps the engine ran, its extend
    forwards, the seconds it waited on environments with no row to decode, and each step's seconds.
    `episodes`: the first rows are whole episodes, the rest earlier segments of them (an agent that rewrote its
    history, `environments.agents.agent_output`), trained as rows but not counted as episodes; None: every row
    is an episode."""

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    response_tokens: np.ndarray
    response_mask: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    env_reward: np.ndarray
    turns: np.ndarray
    counters: list[dict[str, float]]
    finish: list[str]
    decode_steps: int | None = None  # None: not played by this engine (the agent endpoint's episodes)
    extends: int = 0
    env_wait_s: float = 0.0
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    episodes: int | None = None

    def rollout_batch(self) -> dict[str, np.ndarray]:
        """The rollout batch's generated values (`algorithms.rl.GENERATED`, the generate call's layout: prompt
        then response, positions counting real tokens) plus `action_mask` (the sampled tokens: the RL math
        counts only these) and `env_reward`. `ended_with_eos` is true for trajectories the environment ended
        (a budget's cut gets no score under `rewards.eos_only`)."""
        mask = np.concatenate([self.prompt_mask, self.response_mask], axis=1)
        return {"tokens": np.concatenate([self.prompt_tokens, self.response_tokens], axis=1), "mask": mask,
                "positions": np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32),
                "response_tokens": self.response_tokens, "response_mask": self.response_mask,
                "behaviour_logp": np.where(self.loss_mask, self.logprobs, 0.0).astype(np.float32),
                "ended_with_eos": np.array([f == "done" for f in self.finish]), "action_mask": self.loss_mask,
                "env_reward": self.env_reward.astype(np.float32)}

    def metrics(self) -> dict[str, float]:
        """`env/...` metrics: mean reward, turns, trajectory and observation tokens, each counter per
        trajectory, the fraction of trajectories ending each way, and the batch's engine work: decode
        steps, extend forwards, seconds waiting on environments, an environment step's mean seconds. Over the
        episodes' rows only (`episodes`)."""
        e = len(self.finish) if self.episodes is None else self.episodes
        rows = max(e, 1)
        observed = self.response_mask[:e] & ~self.loss_mask[:e]
        out = {"env/reward": float(self.env_reward[:e].mean()), "env/turns": float(self.turns[:e].mean()),
               "env/tokens": float(self.lengths[:e].mean()), "env/observation_tokens": float(observed.sum() / rows)}
        if self.decode_steps is not None:
            out.update({"env/decode_steps": float(self.decode_steps), "env/extends": float(self.extends),
                        "env/wait_s": float(self.env_wait_s)})
        if self.step_seconds:
            out["env/step_s"] = float(np.mean(self.step_seconds))
        for key in sorted({k for c in self.counters[:e] for k in c}):
            out[f"env/{key}"] = sum(c.get(key, 0.0) for c in self.counters[:e]) / rows
        for name in FINISH_NAMES.values():
            if name:
                out[f"env/finish/{name}"] = sum(f == name for f in self.finish[:e]) / rows
        return out


def generate_multiturn(
    graphdef: nnx.GraphDef, params: nnx.State, *, envs: Sequence[Any], rows: Sequence[Mapping[str, Any]],
    encode: Callable[[str], list[int]], decode_text: Callable[[Sequence[int]], str], rng: PRNGKeyArray,
    spec: MultiTurnSpec, max_turns: int, chunk: int = 16, threads: int = 4,
    prompt_ids: Sequence[Sequence[int]] | None = None, failure_reward: float | None = None,
) -> MultiTurnOutput:
    """Run one episode per row: `envs[i].reset(rows[i])` gives its prompt (`encode`d), or, when the caller
    has reset the environments itself, `prompt_ids` gives the first observations' tokens (reset is not
    called again: an environment may draw its task there). Then turns until the environment says done,
    `max_turns` turns, or a budget. A row that ended a turn is stepped on a thread pool while the other
    rows decode the next `chunk` steps; an observation that does not fit the trajectory's budget (or
    `spec.max_observation_tokens`) ends the row (`max_tokens`), and so does a step that raises
    (`env_error`, counted: one environment's fault is not the run's, also as `env_error/<kind>`, the
    exception's `kind` (`environments.pool.FAULT_KINDS`: environments in worker processes) or `raised`); its episode's
    reward is then `failure_reward` (None: the reward its earlier steps earned)."""
    R, P = spec.rows, spec.prompt_bucket
    if len(envs) != R or len(rows) != R:
        raise ValueError(f"{len(envs)} environments and {len(rows)} rows for a spec of {R} rows")
    if prompt_ids is None:
        prompt_ids = [encode(env.reset(row).text) for env, row in zip(envs, rows)]
    if max(len(p) for p in prompt_ids) > P:
        raise ValueError(f"a prompt of {max(len(p) for p in prompt_ids)} tokens does not fit prompt_bucket={P}")
    prompt = np.full((R, P), spec.pad_id, np.int32)
    prompt_mask = np.zeros((R, P), bool)
    for i, ids in enumerate(prompt_ids):
        prompt[i, P - len(ids):], prompt_mask[i, P - len(ids):] = ids, True
    st = start_fn(graphdef, params, jnp.asarray(prompt), jnp.asarray(prompt_mask), rng, spec=spec)
    reward, turns = np.zeros(R, np.float32), np.zeros(R, np.int32)
    counters: list[dict[str, float]] = [{} for _ in range(R)]
    turn_start = np.zeros(R, np.int64)  # response index where the current turn began
    cut = np.zeros(R, bool)  # the waiting turn ran out of tokens (no end-of-turn token)
    host_ended = np.zeros(R, bool)
    if not spec.eos_ids:
        raise ValueError("multi-turn generation needs end-of-turn (EOS) ids: a turn ends on one")
    stepping: dict[int, concurrent.futures.Future] = {}
    width = spec.extend_width - 1
    decode_steps, extends, waited, step_seconds = 0, 0, 0.0, []

    def timed_step(env: Any, text: str) -> Any:  # an environment step, timed on its thread
        began = time.perf_counter()
        try:
            return env.step(text)
        finally:
            step_seconds.append(time.perf_counter() - began)

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        while True:
            status, n, tokens, ended = jax.device_get((st.status, st.n, st.tokens, st.ended))
            for i in np.flatnonzero(status == AWAIT):
                if i not in stepping:
                    turns[i] += 1
                    cut[i] = not ended[i]
                    if cut[i]:
                        counters[i]["turn_cut"] = counters[i].get("turn_cut", 0.0) + 1.0
                    text = decode_text(tokens[i, turn_start[i]:n[i]])  # the turn, its end-of-turn token dropped
                    stepping[i] = pool.submit(timed_step, envs[i], text)
            if not stepping and not (status == RUNNING).any():
                break
            ready = [i for i, f in stepping.items() if f.done()]
            if not ready and not (status == RUNNING).any():  # nothing to decode: wait for an environment
                began = time.perf_counter()
                concurrent.futures.wait(list(stepping.values()), return_when=concurrent.futures.FIRST_COMPLETED)
                waited += time.perf_counter() - began
                ready = [i for i, f in stepping.items() if f.done()]
            obs = np.full((R, width), spec.pad_id, np.int32)
            length = np.zeros(R, np.int32)
            go, end, reason = np.zeros(R, bool), np.zeros(R, bool), np.zeros(R, np.int32)
            for i in ready:
                try:
                    result = stepping.pop(i).result()
                except Exception as e:  # an environment that raised ends its own episode (counted), not the run
                    for key in ("env_error", f"env_error/{getattr(e, 'kind', 'raised')}"):
                        counters[i][key] = counters[i].get(key, 0.0) + 1.0
                    if failure_reward is not None:
                        reward[i] = failure_reward
                    end[i], reason[i] = True, ENV_ERROR
                    continue
                reward[i] += float(result.reward)
                for key, value in result.info.items():
                    counters[i][key] = counters[i].get(key, 0.0) + float(value)
                ids = [] if result.done or result.observation is None else encode(result.observation.text)
                if ids and cut[i]:  # a cut turn is closed as the model would have closed it, before the observation
                    ids = [spec.eos_ids[0], *ids]
                if result.done:
                    end[i], reason[i] = True, ENV_DONE
                elif turns[i] >= max_turns:
                    end[i], reason[i] = True, MAX_TURNS
                elif len(ids) > width or n[i] + len(ids) + 1 > spec.max_tokens:
                    end[i], reason[i] = True, MAX_TOKENS
                else:
                    go[i], length[i], obs[i, :len(ids)] = True, len(ids), ids
                    turn_start[i] = n[i] + len(ids)
            if end.any():
                host_ended |= end
                st = stop_fn(st, jnp.asarray(end), jnp.asarray(reason))
            if go.any():
                st, _ = extend_fn(graphdef, params, st, jnp.asarray(obs), jnp.asarray(length), jnp.asarray(go),
                                  spec=spec)
                extends += 1
            status, before = jax.device_get((st.status, st.n))
            if (status == RUNNING).any():
                st = decode_fn(graphdef, params, st, spec=spec, steps=chunk)
                # the loop ran while any row ran: as many steps as the row that ran longest sampled
                decode_steps += int(np.max(np.where(status == RUNNING, jax.device_get(st.n) - before, 0)))
    out = jax.device_get(st)
    turns += (out.finish == MAX_TOKENS) & ~host_ended  # the turn the trajectory's budget cut counts too
    lengths = out.n.astype(np.int32)
    response_mask = np.arange(spec.max_tokens)[None, :] < lengths[:, None]
    return MultiTurnOutput(
        prompt_tokens=np.asarray(out.prompt_tokens), prompt_mask=np.asarray(out.prompt_mask),
        response_tokens=np.asarray(out.tokens), response_mask=response_mask,
        loss_mask=np.asarray(out.loss_mask) & response_mask, logprobs=np.asarray(out.logp), lengths=lengths,
        env_reward=reward, turns=turns, counters=counters, finish=[FINISH_NAMES[int(f)] for f in out.finish],
        decode_steps=decode_steps, extends=extends, env_wait_s=waited, step_seconds=step_seconds)
