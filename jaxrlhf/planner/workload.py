"""What one RLHF step processes and how the runtime executes it: the planner's `Workload`.

The fields mirror the run's config (an algorithm's `workload()` fills them), so a plan never assumes
what the runtime does not do. Besides the shapes (batch, prompt and response lengths, minibatches),
it holds the drawn response lengths every plan is priced with (`response_lengths`), the packing the
runtime's packer makes of them (`packed_shape`) and how the generation engines run them
(`decode_fractions`: the continuous engine's narrow tail steps and a partial-rollout stream, simulated
slot by slot); the seconds of calls are `planner.cost`'s, their bytes `planner.memory`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from typing import Any, Mapping

import numpy as np

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.lengths import lognormal_lengths, response_width
from jaxrlhf.models.packing import PackedShape, one_row_rule, packing_shape
from jaxrlhf.models.slots import (
    kv_columns,
    page_size,
    pages_per_row,
    pool_size,
    read_columns,
    shard_group,
    step_widths,
    stream_groups,
)
from jaxrlhf.planner.plan import REMAT_POLICIES

# A memory knob the planner chooses with the placement (`planner.knobs`): the micro-batch size of each call,
# the remat policy of each trained role. The config's unset keys (null) arrive here as AUTO.
AUTO = "auto"
LENGTH_BATCHES = 8  # K: the batches of drawn response lengths the steps cycle through (step i has batch i % K)
# A page pool the planner sizes (`generation.kv_pages` unset) holds this much more than the most pages the
# drawn batches of lengths hold at once: room for batches not drawn. Past it the engine preempts and
# recomputes rows (the same tokens, a slower step).
KV_PAGE_MARGIN = 1.25
LENGTH_SEED = 0


@functools.lru_cache(maxsize=64)
def _drawn_lengths(median: int, sigma: float, cap: int, rows: int) -> np.ndarray:
    """`Workload.response_lengths`' draw, once per distribution and batch size: every plan a search
    estimates prices its generate calls with the same lengths."""
    z = np.random.default_rng(LENGTH_SEED).standard_normal((LENGTH_BATCHES, rows))
    return lognormal_lengths(z, median, sigma, cap)


@functools.lru_cache(maxsize=256)
def _packed_draws(rows: int, prompt_len: int, gen_len: int, median: int | None, sigma: float, updates: int,
                  epochs: int, ways: int, budget: int | None,
                  blockwise: tuple[int, int] | None) -> tuple[PackedShape, ...]:
    """The runtime packer's shapes of each drawn batch of lengths, once per shape question (a search asks
    often): `rows` sequences in `updates` equal parts per epoch (1: an inference call)."""
    wl = Workload(batch_size=rows, prompt_len=prompt_len, gen_len=gen_len, minibatches=updates,
                  gen_len_median=median, gen_len_sigma=sigma)
    order = np.arange(rows).reshape(updates, -1)
    parts = np.concatenate([order] * epochs)
    # rows as wide as the batch trimmed to its longest response, or one row a shard (`blockwise`,
    # `models.packing.pack_batch`); every response token read (`take`)
    return tuple(packing_shape(batch + prompt_len, parts, ways, prompt_len + response_width(int(batch.max()), gen_len),
                               budget, reads=batch, blockwise=blockwise) for batch in wl.response_lengths(rows))


def _mean_shape(draws: tuple[PackedShape, ...]) -> PackedShape:
    """The packing a packed call costs over the drawn batches, as one shape of float fields: their mean
    micro-batches and padded tokens (every row of every micro-batch), in rows of their token-weighted mean
    width, so a row's tokens (linear work) and tokens x width (dense attention over the row) are each the
    draws' mean. Averaging rows and width apart (and rounding each up) had priced rows as wide as a
    long-tailed batch 16-27 % over their tokens: a draw with a wider longest sequence packs fewer rows."""
    micro = np.array([d.micro_batches for d in draws], np.float64)
    tokens = micro * np.array([d.rows * d.width for d in draws], np.float64)
    width = float((tokens * [d.width for d in draws]).sum() / tokens.sum())
    per_micro = lambda field: float((micro * [getattr(d, field) for d in draws]).mean() / micro.mean())  # noqa: E731
    return PackedShape(updates=draws[0].updates, micro_batches=float(micro.mean()),
                       rows=float(tokens.mean() / micro.mean() / width), slots=per_micro("slots"), width=width,
                       reads=per_micro("reads"))


def _peak_shape(draws: tuple[PackedShape, ...]) -> PackedShape:
    """The largest micro-batch of the drawn batches' packings (rows x width, then read positions): what a
    device must hold at once in the step that packs it."""
    return max(draws, key=lambda d: (d.rows * d.width, d.reads))


def _per_role(value: Any, role: str | None, default: Any) -> Any:
    """A Workload setting given for every role, or as a mapping role -> setting."""
    return value.get(role, default) if isinstance(value, Mapping) else value


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one RLHF step processes, and how the runtime executes it.

    `batch_size` counts batch rows (sequences, or pairs for calls with
    `seqs_per_row=2`). The execution fields mirror the runtime settings of the
    same name (an algorithm's `workload()` fills them from the run config), so
    a plan never assumes what the runtime does not do:
    - `micro_batch`: rows per micro-batch in train (gradient accumulation) and
      inference calls, for every call or as a mapping call name -> rows; None = a whole minibatch
      (train) or batch (inference); AUTO = the planner picks each call's count for its placement
      (`planner.knobs`). Generation is never micro-batched.
    - `remat`: "none" / "full" / "dots" (save matmul outputs) for every role, or
      a mapping role -> policy; AUTO (for every role or one) = the planner picks it (`planner.knobs`).
    - `donate`: train calls donate parameters and optimizer state (one copy).
    - `adam_master_fp32`: low-precision params keep fp32 master weights and fp32
      AdamW moments (mixed precision); otherwise the moments use the param dtype.
      A bool for every role, or a mapping role -> bool.
    - `gen_engine`, `gen_group`, `gen_slots`, `gen_pages`: the generation engine (`generation.engine`), how
      many adjacent rows share a prompt, the continuous engine's slot pool (`generate_shape`) and its KV
      page pool (`generation.kv_pages`, `generate_kv_columns`).
    - `base_views`: frozen roles (a reference) that are a LoRA role's base: no resident weights of their
      own, a temporary copy of the base where their call runs away from the source's home.
    - `staleness`: on an off-policy plan, how many steps the generator may run ahead of the trainer
      (`Config.generator_lead`, the number the runtime uses; the plan's own `staleness` overrides it).
    - `gen_len_median`, `gen_len_sigma`: response lengths are log-normal with this median and sigma,
      capped at `gen_len` (`response_lengths`); None = every response runs to the cap.
    - `gen_stream`: the continuous engine streams rollouts across steps (`generation.partial_rollout`
      with a staleness budget of at least 1): on any plan its pool is refilled with the next steps'
      prompts as rows end, so a batch costs its tokens over the pool, without the last round's tail
      (`decode_fractions`). Overlap with training still needs an off-policy plan.
    - `packed`, `token_budget`: train and inference calls run packed rows (`algorithm.pack_sequences`),
      micro-batches of at most `token_budget` real tokens (`algorithm.max_tokens_per_micro_batch`);
      priced by the shapes the runtime's packer gives the drawn lengths (`packed_shape`).
    - `reward_row_s`, `reward_at_once`, `reward_workers`: rule rewards (the `score_rules` host step):
      one row's measured seconds (0: not measured, not priced), the rows the rules score in the time of
      one (`rewards.pool.rows_at_once`; None: one at a time) and `rewards.workers`; priced by
      `planner.rewards.score_seconds`.
    - `multi_turn`, `env_extend_width`, `env_decode_steps`, `env_extends`, `env_wait_s`: the generate call
      plays multi-turn episodes (`env.name`, `models.multiturn`): every device runs the whole batch (the
      engine's pool is not sharded), and the call adds what the run measured per batch (0: not measured,
      priced as one turn to the cap): the decode steps run, the extend forwards of `env_extend_width`
      tokens a row, the seconds waiting on environments; priced by `planner.episodes.episode_cost`.
    """

    batch_size: int = 512
    prompt_len: int = 128
    gen_len: int = 128
    minibatches: int = 4  # optimizer steps per train call and PPO epoch
    ppo_epochs: int = 1
    micro_batch: Any = None  # rows, None, AUTO, or a mapping call -> rows
    remat: Any = "full"
    donate: bool = True
    adam_master_fp32: Any = True
    gen_engine: str = "static"  # generation.engine
    gen_group: int = 1  # adjacent rows sharing a prompt (GRPO's G): either engine prefills one
    gen_slots: Any = None  # generation.slots; None = the whole batch; AUTO = the planner's (continuous engine)
    gen_pages: Any = None  # generation.kv_pages; None = every slot holds gen_len; AUTO = sized to the drawn lengths
    # (role, source): frozen roles that hold no weights and run on a LoRA source's frozen base
    base_views: tuple[tuple[str, str], ...] = ()
    staleness: int = 1  # steps the generator may run ahead on an off-policy plan
    gen_len_median: int | None = None  # median response length; None = every response is gen_len long
    gen_len_sigma: float = 0.0  # sigma of the log-normal response lengths
    gen_stream: bool = False  # generation.partial_rollout (eta >= 1): the pool stays full across steps
    gen_chunk: int = 16  # generation.stream_chunk: decode steps between the stream's reads
    packed: bool = False  # algorithm.pack_sequences
    # a packer without padding, whose attention stays inside each sequence (varlen kernels): how peers' dynamic
    # batching runs (`scripts/validate_published.py` prices their runs with it). jaxrlhf's runtime packs one row
    # a shard, padded to whole blocks, where its models attend blockwise, else rows as wide as the longest
    # sequence attending densely, masked (`packed_shape`): the planner never sets this
    varlen: bool = False
    # a paged engine whose attention reads only the tokens each row holds (vLLM's and SGLang's paged attention):
    # how peers' engines decode (`scripts/validate_published.py` prices their runs with it). jaxrlhf's engines
    # read every column of a row's cache, masked, at every step: the planner never sets this
    live_kv: bool = False
    # a trainer whose attention skips the causal mask's empty half and recomputes its scores in the backward
    # (FlashAttention): how peers train (`scripts/validate_published.py`). jaxrlhf's runtime does so for long rows
    # only (`ModelConfig.attends_blockwise`), which the cost model reads from the model: the planner never sets this
    flash_attention: bool = False
    token_budget: int | None = None  # algorithm.max_tokens_per_micro_batch
    # the packing a packed call reads as the plan lays it out (`planner.knobs.shared_packings`, set per call by
    # `for_call`): the shards its host step packs (the lcm of all its readers' batch ways) and their one-row rule
    # (`packing.one_row_rule` of the readers' models and context degrees); None: the call's own ways and rule
    packing: tuple[int, tuple[int, int] | None] | None = None
    # algorithm.logit_chunk_tokens: response positions a device whose logits the actor's and reference's
    # log-prob calls build at once (`models.logit_chunks`); None = all at once (and every non-RL call)
    logit_chunk: int | None = None
    reward_row_s: float = 0.0  # one row's rule-reward seconds, measured by the run (0: not priced)
    reward_at_once: int | None = None  # rows the rules score in the time of one (`rows_at_once`)
    reward_workers: int = 0  # rewards.workers
    multi_turn: bool = False  # env.name: episodes through the multi-turn engine
    env_extend_width: int = 0  # tokens of one extend forward a row (1 + env.max_observation_tokens)
    env_decode_steps: float = 0.0  # decode steps per episode batch, measured (0: gen_len)
    env_extends: float = 0.0  # extend forwards per episode batch, measured
    env_wait_s: float = 0.0  # seconds per batch waiting on environments with no row to decode, measured

    def __post_init__(self):
        if self.gen_len_median is not None and not 1 <= self.gen_len_median <= self.gen_len:
            raise ValueError(f"workload.gen_len_median={self.gen_len_median} must lie in 1..gen_len={self.gen_len}")
        if self.gen_len_sigma < 0:
            raise ValueError(f"workload.gen_len_sigma must be >= 0, got {self.gen_len_sigma}")
        for f in ("batch_size", "prompt_len", "gen_len", "minibatches", "ppo_epochs", "staleness"):
            if getattr(self, f) < 1:
                raise ValueError(f"workload.{f} must be >= 1, got {getattr(self, f)}")
        micro = self.micro_batch.values() if isinstance(self.micro_batch, Mapping) else [self.micro_batch]
        for m in micro:
            if m is not None and m != AUTO and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
                raise ValueError(f"workload.micro_batch must be >= 1, None or {AUTO!r}, got {m!r}")
        if self.gen_engine not in ("static", "continuous"):
            raise ValueError(f"workload.gen_engine {self.gen_engine!r} is not 'static' or 'continuous'")
        if self.gen_group < 1 or self.batch_size % self.gen_group:
            raise ValueError(f"workload.gen_group={self.gen_group} must divide batch_size={self.batch_size}")
        if self.batch_size % self.minibatches:
            raise ValueError(
                f"workload.batch_size={self.batch_size} must divide into minibatches={self.minibatches}"
            )
        policies = self.remat.values() if isinstance(self.remat, Mapping) else [self.remat]
        for p in policies:
            if p not in (*REMAT_POLICIES, AUTO) and not isinstance(p, bool):
                raise ValueError(f"workload.remat {p!r} is not one of {REMAT_POLICIES} or {AUTO!r}")

    def remat_for(self, role: str) -> str:
        """The remat policy `role` is priced with (booleans read as "full" / "none"); one the planner has not
        chosen yet (AUTO) prices as "none", the fastest, until `planner.knobs` chooses it."""
        p = self.remat_setting(role)
        return "none" if p == AUTO else p

    def remat_setting(self, role: str) -> str:
        """The remat policy of `role` as set: a policy, or AUTO (the planner's to choose)."""
        p = _per_role(self.remat, role, "none")
        return {True: "full", False: "none"}.get(p, p) if isinstance(p, bool) else p

    @property
    def streams(self) -> bool:
        """Whether generation runs as a partial-rollout stream (`rollouts.stream`): `gen_stream` on the
        continuous engine, single-turn."""
        return self.gen_stream and self.gen_engine == "continuous" and not self.multi_turn

    def engine_rows(self, call: CallSpec, batch_ways: int) -> int:
        """Rows the engine of generate call `call` holds at once, all shards: the batch, or for a stream its
        group slots' rows, which hold the prompts of staleness + 1 batches (`rollouts.stream`, sized by the
        run's staleness budget) rounded up to whole group slots per shard: a stream admits prompts to free
        group slots, so its batch need not split evenly over the shards."""
        rows = self.call_seqs(call)
        if not self.streams:
            return rows
        return stream_groups(rows // self.gen_group, self.staleness, batch_ways) * self.gen_group

    def engine_pool(self, call: CallSpec, batch_ways: int) -> int:
        """Rows the continuous engine of `call` decodes at once, all shards (`models.slots.pool_size` of
        `engine_rows`): the pool as set, else the whole batch (a stream's default is the synchronous
        engine's pool, one batch, as `rollouts.stream` sizes it). A stream's pool may hold rows of
        several batches: a generator running ahead decodes them side by side."""
        rows = self.call_seqs(call)
        if not self.streams:
            return pool_size(rows, self.slots, batch_ways)
        return pool_size(self.engine_rows(call, batch_ways), self.slots or rows, batch_ways)

    def pool_spans_batches(self, call: CallSpec, batch_ways: int) -> bool:
        """Whether a stream's pool is wider than one batch: its full-width steps then decode several batches'
        rows, so a batch costs a share of them (`decode_fractions`), whatever the lengths."""
        return self.streams and self.engine_pool(call, batch_ways) > self.call_seqs(call)

    def priced_per_batch(self, call: CallSpec, batch_ways: int) -> bool:
        """Whether generate call `call` costs each batch of lengths its own seconds (`decode_fractions`): drawn
        lengths, or a stream whose pool spans several batches."""
        return self.lengths_vary or self.pool_spans_batches(call, batch_ways)

    @property
    def slots(self) -> int | None:
        """The continuous engine's slot pool as priced: `gen_slots`, with one the planner has not chosen yet
        (AUTO) priced as the whole batch, the fastest, until `planner.knobs` chooses it."""
        return None if self.gen_slots == AUTO else self.gen_slots

    def micro_batch_for(self, call: str) -> int | str | None:
        """Rows per micro-batch of the call named `call` as set (None: one micro-batch; AUTO: the planner's)."""
        return _per_role(self.micro_batch, call, None)

    @property
    def chooses_knobs(self) -> bool:
        """Whether any memory knob is the planner's to choose (`planner.knobs`)."""
        remat = self.remat.values() if isinstance(self.remat, Mapping) else [self.remat]
        micro = self.micro_batch.values() if isinstance(self.micro_batch, Mapping) else [self.micro_batch]
        return AUTO in remat or AUTO in micro or self.gen_slots == AUTO

    def master_for(self, role: str | None) -> bool:
        """Whether `role`'s optimizer keeps fp32 master weights (when its params are low precision)."""
        return bool(_per_role(self.adam_master_fp32, role, True))

    def micro_batches(self, call: CallSpec) -> int:
        """How many micro-batches one step of `call` runs (1 for generation; AUTO prices as 1: a knob the
        planner has not chosen yet, `planner.knobs` chooses it)."""
        rows = self.call_batch(call.kind)
        micro = self.micro_batch_for(call.name)
        if call.kind == "generate" or micro is None or micro == AUTO or micro >= rows:
            return 1
        return math.ceil(rows / micro)

    def with_micro_batches(self, call: CallSpec, count: int | None) -> "Workload":
        """This workload with `call` split into `count` micro-batches (None: unchanged)."""
        if count is None or call.kind == "generate":
            return self
        return dataclasses.replace(self, micro_batch=max(self.call_batch(call.kind) // count, 1))

    def micro_misfit(self, call: CallSpec, batch_ways: int) -> str | None:
        """Why `call`'s fixed micro-batch size cannot run on a layout splitting the batch `batch_ways` ways
        (None: it can). The runtime takes rows j, j + k, ... into micro-batch j
        (`algorithms.update.split_microbatches`), so each micro-batch must split evenly over the batch
        axes: its rows a multiple of data x fsdp x expert."""
        micro = self.micro_batch_for(call.name)
        if call.kind == "generate" or self.packed or micro is None or micro == AUTO:
            return None
        rows = self.call_batch(call.kind)
        if micro < rows and micro % batch_ways:
            return (f"{call.name}: micro-batches of {micro} rows (algorithm.micro_batch_size) do not split over "
                    f"data x fsdp x expert = {batch_ways} devices; use a multiple of {batch_ways} or leave "
                    "algorithm.micro_batch_size unset for the planner to choose")
        return None

    def for_call(self, call: CallSpec, micro: int | None = None, remat: str | None = None,
                 slots: int | None = None, packing: tuple[int, tuple[int, int] | None] | None = None) -> "Workload":
        """This workload as `call` alone runs it: split into `micro` micro-batches (None: the workload's),
        for a train call its role under `remat`, for a generate call the continuous engine's pool at `slots`
        (None: the workload's), a packed call reading `packing` (the shards and one-row rule of a packing it
        shares with other calls; None: its own). What prices one call under the knobs `planner.knobs` chose;
        the other calls' knobs are not kept."""
        wl = self.with_micro_batches(call, micro)
        if slots is not None and call.kind == "generate":
            wl = dataclasses.replace(wl, gen_slots=slots)
        if packing is not None and self.packed and call.kind != "generate":
            wl = dataclasses.replace(wl, packing=packing)
        if remat is not None and call.kind == "train" and wl.remat_setting(call.role) != remat:
            wl = dataclasses.replace(wl, remat={call.role: remat})
        return wl

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def minibatch_size(self) -> int:
        return self.batch_size // self.minibatches

    @classmethod
    def from_tokens(cls, tokens_per_batch: int, prompt_len: int, gen_len: int, **kw) -> "Workload":
        """The ReaLHF convention: a fixed token budget per batch of prompt + response sequences."""
        return cls(batch_size=max(tokens_per_batch // (prompt_len + gen_len), 1), prompt_len=prompt_len,
                   gen_len=gen_len, **kw)

    def call_batch(self, kind: str) -> int:
        """Batch rows one call step feeds at once (train: one minibatch); the batch axes must divide it."""
        return self.minibatch_size if kind == "train" else self.batch_size

    def call_seqs(self, call: CallSpec) -> int:
        """Sequences one call step feeds at once: its batch rows times the call's sequences per row."""
        return self.call_batch(call.kind) * call.seqs_per_row

    def generate_shape(self, call: CallSpec, batch_ways: int) -> tuple[float, float, int]:
        """Per device: (prompts prefilled, rows each decode step runs, decode steps) of a generate call as
        its engine runs it when every response is `gen_len` long (the planner's worst case): both engines
        prefill each group's prompt once per shard (`models.slots.shard_group`); static decodes all rows for
        gen_len steps, continuous runs its slot pool (`engine_pool`) ceil(rows / pool) rounds of gen_len at full
        width (a pool that preempts is not modelled; a stream's pool wider than the batch: one round, and a
        stream prefills each group once wherever its prompts land); the multi-turn engine prefills and
        decodes every row on every device (its pool is not sharded), gen_len steps before measurement
        (`planner.episodes` scales them to the measured steps)."""
        rows = self.call_seqs(call)
        if self.multi_turn:
            return rows, rows, self.gen_len
        if self.streams:  # each admitted group's prompt prefilled once; the pool of `engine_pool` rows
            pool = self.engine_pool(call, batch_ways)
            return rows / batch_ways / self.gen_group, pool / batch_ways, math.ceil(rows / pool) * self.gen_len
        if rows % batch_ways:
            return rows / batch_ways, rows / batch_ways, self.gen_len
        prompts = rows // batch_ways // shard_group(rows, self.gen_group, batch_ways)
        if self.gen_engine == "static":
            return prompts, rows / batch_ways, self.gen_len
        pool = self.engine_pool(call, batch_ways)
        return prompts, pool / batch_ways, math.ceil(rows / pool) * self.gen_len

    @property
    def lengths_vary(self) -> bool:
        """Whether response lengths are drawn: a median and a spread; else every response runs to the cap.
        Never for multi-turn episodes: their decode steps are measured (`env_decode_steps`)."""
        return self.gen_len_median is not None and self.gen_len_sigma > 0 and not self.multi_turn

    def response_lengths(self, rows: int) -> np.ndarray:
        """LENGTH_BATCHES batches of `rows` response lengths, shape [batches, rows]: log-normal around
        `gen_len_median` with `gen_len_sigma`, rounded, in 1..gen_len. Drawn with a fixed seed rather
        than taken as quantiles: what a buffer of steps absorbs is how one batch differs from the next,
        and batches built from the same quantiles would all be alike. Fixed, so an estimate is
        deterministic and its schedule repeats every LENGTH_BATCHES steps."""
        if not self.lengths_vary:
            return np.full((LENGTH_BATCHES, rows), self.gen_len, dtype=np.int64)
        return _drawn_lengths(self.gen_len_median, self.gen_len_sigma, self.gen_len, rows).copy()

    def packed_shape(self, call: CallSpec, batch_ways: int, model: Any = None, context: int = 1) -> PackedShape:
        """The packing a packed train or inference call costs, per shard (`models.packing`, the runtime's
        packer): each drawn batch of lengths (prompt_len + response) packed for the call's updates (a
        train call: minibatches x epochs of `minibatch_size` rows; inference: one of the whole batch), and the
        mean over the LENGTH_BATCHES draws (`_mean_shape`: float fields). `model` (its `ModelConfig`) and
        `context` (its layout's degree): one row a shard where the model attends it blockwise
        (`packing.one_row_rule`, the runtime's rule for the packing's readers); without a model, rows as wide
        as the batch."""
        return _mean_shape(self._packed_draws(call, batch_ways, model, context))

    def packed_peak(self, call: CallSpec, batch_ways: int, model: Any = None, context: int = 1) -> PackedShape:
        """`packed_shape`'s largest micro-batch over the draws (`_peak_shape`): the memory model's."""
        return _peak_shape(self._packed_draws(call, batch_ways, model, context))

    def _packed_draws(self, call: CallSpec, batch_ways: int, model: Any, context: int) -> tuple[PackedShape, ...]:
        """The drawn batches' packings as one device of the call reads them: packed over its own batch ways with
        its model's one-row rule, or over a shared packing's shards (`packing`), of which each device holds
        shards / batch_ways side by side in every micro-batch (`update.map_packed`: the shard axis split over
        the call's batch axes)."""
        if self.packing is not None:
            shards, blockwise = self.packing
        else:
            shards, blockwise = batch_ways, None if model is None else one_row_rule([model], [context])
        if shards % batch_ways:
            raise ValueError(f"{call.name}: a packing of {shards} shards cannot be split over {batch_ways} batch ways")
        train = call.kind == "train"
        draws = _packed_draws(self.batch_size * call.seqs_per_row, self.prompt_len, self.gen_len,
                              self.gen_len_median, self.gen_len_sigma, self.minibatches if train else 1,
                              self.ppo_epochs if train else 1, shards, self.token_budget, blockwise)
        parts = shards // batch_ways
        return draws if parts == 1 else tuple(
            dataclasses.replace(d, rows=d.rows * parts, slots=d.slots * parts, reads=d.reads * parts) for d in draws)

    def live_context(self) -> float:
        """Cached tokens a decoded token attends to on average under a `live_kv` engine: a row of L tokens
        reads prompt_len + s at its step s < L, so over the drawn rows prompt_len + sum L(L - 1) / 2 / sum L."""
        lengths = self.response_lengths(self.batch_size).astype(np.float64)
        return self.prompt_len + float((lengths * (lengths - 1) / 2).sum() / lengths.sum())

    def varlen_shape(self, call: CallSpec, batch_ways: int) -> tuple[float, float, int, float]:
        """A `varlen` packer's forward of `call` (one update, per shard): (real tokens, the attention keys a
        token meets on average: sum L^2 / sum L over the drawn sequences, micro-batches of at most
        `token_budget` tokens, response tokens read)."""
        rows = self.call_seqs(call)
        responses = self.response_lengths(rows).astype(np.float64)
        seqs = responses + self.prompt_len
        tokens = rows * float(seqs.mean()) / batch_ways
        keys = float((seqs**2).sum() / seqs.sum())
        micro = max(1, math.ceil(tokens * batch_ways / self.token_budget)) if self.token_budget else 1
        return tokens, keys, micro, rows * float(responses.mean()) / batch_ways

    def decode_reads(self, call: CallSpec, batch_ways: int) -> tuple[int, ...] | None:
        """The response columns a decode step of `call` may read (`models.slots.read_columns`), where the call is
        priced at them: the continuous engine whose pool holds every row of its shard at once, so all start together
        and step t (0-based) reads the narrowest read >= t + 1 (`read_context`). None (the call priced reading the
        whole cache): the static engine, a smaller pool or a stream (rows of different ages side by side,
        `aged_reads`), multi-turn, an uneven batch, or a cap of one read."""
        return self._spans() if self._pool_starts_together(call, batch_ways) is True else None

    def aged_reads(self, call: CallSpec, batch_ways: int) -> tuple[int, ...] | None:
        """The reads (`models.slots.read_columns`) of an engine whose rows start at different steps: a partial-rollout
        stream, or a continuous pool smaller than its shard's rows (rows enter as others end). A step reads the
        narrowest that holds its oldest active row's tokens (`PagedEngine.decode`), which `decode_fractions` follows
        step by step in its simulation of the engine, against the call priced at the whole cache; None where the
        cap has one read or every row starts together (`decode_reads`)."""
        aged = self.streams or self._pool_starts_together(call, batch_ways) is False
        return self._spans() if aged else None

    def _pool_starts_together(self, call: CallSpec, batch_ways: int) -> bool | None:
        """For the continuous engine outside a stream or multi-turn, on an even batch: whether its pool holds every
        row of its shard (all rows start at step 0) or fewer (rows enter as others end); None for any other engine."""
        rows = self.call_seqs(call)
        if self.gen_engine != "continuous" or self.streams or self.multi_turn or rows % batch_ways:
            return None
        return self.engine_pool(call, batch_ways) >= rows

    def _spans(self) -> tuple[int, ...] | None:
        """The continuous engine's reads at this cap (`models.slots.read_columns`); None for a single one."""
        reads = read_columns(self.gen_len, page_size(self.prompt_len))
        return reads if len(reads) > 1 else None

    def read_context(self, reads: tuple[int, ...]) -> np.ndarray:
        """Cached columns each of the gen_len decode steps reads under `reads` (`decode_reads`): prompt_len plus the
        narrowest read that holds t + 1 response tokens at step t."""
        return _read_context(reads, self.gen_len, self.prompt_len)

    def decode_fractions(self, call: CallSpec, batch_ways: int, streamed: bool = False,
                         width_share: float = 1.0, eta: int | None = None,
                         context_share: float = 0.0) -> tuple[float, ...]:
        """Per length batch, its decode steps as a fraction of `generate_shape`'s (every response at the
        cap, every step at the pool's full width): the static engine's loop runs until the batch's
        longest row ends (`models.generation` stops when every row is done), so max(L) / gen_len; the
        continuous engine runs each shard's rows through its slots and each step at the narrowest width
        that holds the active rows (`continuous_decode_steps`: the tail's steps are narrow; a step costs
        (1 - width_share) + width_share x width / slots of a full one), over ceil(rows / P) x gen_len;
        `streamed` (partial rollouts running ahead: the next batches' rows keep the pool full) sum(L) / P
        full-width steps, its admission paced by `eta` (the plan's; None: `staleness`) while its pool and
        group slots are sized as the runtime sizes them (`engine_pool`, `engine_rows`). All 1.0 when the
        lengths do not vary, but for a stream whose pool spans several batches (`pool_spans_batches`): there
        a full-width step decodes rows of several batches, and the stream is simulated at the cap.

        Where the engine's steps read only the columns their rows filled (`decode_reads`; by their oldest active
        row where rows start at different steps, `aged_reads`), a step's row part scales by (1 - context_share) +
        context_share x c(t), c(t) its columns read over the whole cache's and `context_share` the share of a
        row's seconds that grows with the columns it reads, against the row parts of the steps the call is priced
        at: the tail's narrow steps read the most columns."""
        if not self.lengths_vary and not (streamed and self.pool_spans_batches(call, batch_ways)):
            return (1.0,) * LENGTH_BATCHES
        rows = self.call_seqs(call)
        n = self.generate_shape(call, batch_ways)[2]
        # an uneven batch runs as static does, but in a stream (its prompts enter free group slots)
        if self.gen_engine == "static" or (rows % batch_ways and not self.streams):
            return tuple(float(s / n) for s in self.response_lengths(rows).max(axis=1))
        slots = self.engine_pool(call, batch_ways) // batch_ways
        drawn = (self.gen_len_median, self.gen_len_sigma) if self.lengths_vary else (None, 0.0)
        if streamed:
            groups = self.engine_rows(call, batch_ways) // self.gen_group // batch_ways  # `rollouts.stream`'s
            reads = self.aged_reads(call, batch_ways)
            runs = _stream_runs(*drawn, self.gen_len, rows, self.gen_group, batch_ways, slots,
                                groups, self.gen_chunk, self.staleness if eta is None else eta, reads, self.prompt_len)
            kv = context_share if reads else 0.0
            priced = float(n)  # the call is priced reading the whole cache at every step
        else:
            together = self.decode_reads(call, batch_ways)  # the call is priced at its steps' reads (`read_context`)
            reads = together or self.aged_reads(call, batch_ways)  # else at the whole cache's
            runs = _continuous_batches(*drawn, self.gen_len, rows, batch_ways, slots, reads, self.prompt_len)
            kv = context_share if reads else 0.0
            priced = (1 - kv) * n + kv * float(self.read_context(together).sum()) / self.seq_len \
                if kv and together else float(n)
        # a step of width w costs (1 - share) + share x w / slots of a full-width one, its row part scaled by the
        # columns it reads (1 - kv + kv c(t)) against the row parts of the steps the call is priced at
        return tuple(float(min((1 - width_share) * run[0] / n
                               + width_share * ((1 - kv) * run[1] + kv * run[2]) / priced, 1.0)) for run in runs)

    def kv_pages(self, call: CallSpec, batch_ways: int) -> int | None:
        """The continuous engine's response pages over all shards as priced (`generation.kv_pages`): as set,
        or where the planner sizes them (AUTO) `held_pages`'s pool."""
        return self.held_pages(call, batch_ways) if self.gen_pages == AUTO else self.gen_pages

    def held_pages(self, call: CallSpec, batch_ways: int) -> int | None:
        """Response pages over all shards that hold, with KV_PAGE_MARGIN to spare, the most pages the engine's
        rows hold at once on any drawn batch of lengths, decoding them slot by slot as `decode_fractions`
        does (a stream in steady state): a pool of pages for the tokens rows hold, not one full response per
        slot (vLLM's paged KV cache). At least one full response per shard; None (every slot can hold a
        full response) where that is no fewer, or where the lengths do not vary."""
        rows = self.call_seqs(call)
        if (not self.lengths_vary or self.gen_engine != "continuous" or self.multi_turn
                or (rows % batch_ways and not self.streams)):
            return None
        slots = self.engine_pool(call, batch_ways) // batch_ways
        one_row = pages_per_row(self.prompt_len, self.gen_len)[1]
        stream = (self.gen_group, self.engine_rows(call, batch_ways) // self.gen_group // batch_ways, self.gen_chunk,
                  self.staleness) if self.streams else None
        held = _held(self.gen_len_median, self.gen_len_sigma, self.gen_len, rows, page_size(self.prompt_len),
                     batch_ways, slots, stream)
        need = max(math.ceil(held * KV_PAGE_MARGIN), one_row)
        return None if need >= slots * one_row else need * batch_ways

    def generate_kv_columns(self, call: CallSpec, batch_ways: int) -> float:
        """KV-cache columns (tokens) one device holds during a generate call, as its engine allocates them:
        static: its rows x (prompt + gen_len), carried into and out of the decode loop (two copies), plus
        the prefill's cache of one row per group it is copied from;
        continuous: the page pool (prefix pages + response pages, `models.slots.kv_columns`), carried in
        and out, plus the prefill's dense prefix the pool is built from; a stream's pool holds the prompts
        of staleness + 1 batches (`stream_columns`); multi-turn: every row's pages on every device, prompt,
        trajectory and an extend's columns, carried in and out, plus the prefill's dense prefix."""
        rows = self.call_seqs(call)
        if self.multi_turn:
            return 2 * rows * (self.seq_len + self.env_extend_width) + rows * self.prompt_len
        if self.streams:  # its pool, carried in and out, plus a batch's dense prefix
            return 2 * self.stream_columns(call, batch_ways) + rows / batch_ways / self.gen_group * self.prompt_len
        if rows % batch_ways:
            return 2 * rows / batch_ways * self.seq_len
        if self.gen_engine == "static":
            prompts = self.generate_shape(call, batch_ways)[0]
            return (2 * rows / batch_ways + (prompts if prompts < rows / batch_ways else 0)) * self.seq_len
        prefix, pool = kv_columns(self.prompt_len, self.gen_len, rows, self.gen_group, self.slots,
                                  self.kv_pages(call, batch_ways), batch_ways)
        return 2 * pool + prefix

    def stream_columns(self, call: CallSpec, batch_ways: int) -> float:
        """KV-cache columns one device keeps between steps for a partial-rollout stream (`gen_stream`): its
        page pool, whose group slots hold the prompts of staleness + 1 batches (`rollouts.stream`), lives on
        the generate call's devices for the whole run; 0 without a stream."""
        if not self.streams:
            return 0.0
        return kv_columns(self.prompt_len, self.gen_len, self.engine_rows(call, batch_ways), self.gen_group,
                          self.engine_pool(call, batch_ways), self.kv_pages(call, batch_ways), batch_ways)[1]


def _steps_and_widths(spans: list[tuple[np.ndarray, np.ndarray]], slots: int, cuts: np.ndarray | None = None,
                      weights: np.ndarray | None = None) -> list[tuple[float, float, float]]:
    """Decode steps run, their summed width / slots and that sum with each step's width scaled by weights[t] (a
    step past them by the last; None: the plain sum), from each shard's rows' (starts, ends) in steps: every
    shard steps together, a step runs where any row is active, at the narrowest of
    `models.slots.step_widths(slots)` holding the most active rows of any shard; split at the step indices
    `cuts` (one triple per interval before, between and after them)."""
    total = int(max(e.max() for _, e in spans))
    active = np.zeros(total, dtype=np.int64)
    for starts, ends in spans:
        counts = np.zeros(total + 1, dtype=np.int64)
        np.add.at(counts, starts, 1)
        np.add.at(counts, ends, -1)
        active = np.maximum(active, np.cumsum(counts)[:total])
    widths = np.array(sorted(step_widths(slots)))
    width = np.where(active > 0, widths[np.minimum(np.searchsorted(widths, active), len(widths) - 1)], 0) / slots
    weighted = width if weights is None else width * weights[np.minimum(np.arange(total), len(weights) - 1)]
    bounds = [0, *(() if cuts is None else np.minimum(cuts, total)), total]
    return [(float(np.count_nonzero(active[a:b])), float(width[a:b].sum()), float(weighted[a:b].sum()))
            for a, b in zip(bounds, bounds[1:])]


@functools.lru_cache(maxsize=256)
def _continuous_spans(lengths: tuple[int, ...], ways: int, slots: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Each shard's rows' (starts, ends) in decode steps on the continuous engine, for one batch of response
    `lengths`: each shard's rows (contiguous blocks) enter its `slots` in order, a row taking the slot that
    frees first."""
    spans = []
    for shard in np.asarray(lengths, dtype=np.int64).reshape(ways, -1):
        free = [0] * slots  # when each slot frees (a heap)
        starts = np.empty(len(shard), dtype=np.int64)
        for i, n in enumerate(shard):
            starts[i] = heapq.heappop(free)
            heapq.heappush(free, int(starts[i] + n))
        spans.append((starts, starts + shard))
    return tuple(spans)


def _batches(median: int | None, sigma: float, cap: int, rows: int) -> tuple[tuple[int, ...], ...]:
    """The LENGTH_BATCHES batches of `rows` drawn response lengths (`_drawn_lengths`; every one at `cap`
    without a median), as tuples: what the engine simulations below are cached by."""
    if median is None:
        return ((cap,) * rows,) * LENGTH_BATCHES
    return tuple(map(tuple, _drawn_lengths(median, sigma, cap, rows).astype(int).tolist()))


def _continuous_batch(lengths: tuple[int, ...], ways: int, slots: int, reads: tuple[int, ...] | None = None,
                      prompt_len: int = 0, cap: int = 0) -> tuple[float, float, float]:
    """(steps, summed width / slots, summed width / slots x the step's columns read over the whole cache's) of the
    continuous engine on one batch of response `lengths`. A step reads the narrowest of `reads` that holds its
    oldest active row's tokens (`_oldest_ages`; with the pool holding every row, t + 1 at step t), after a
    prompt of `prompt_len`, of a cache of prompt_len + `cap` columns; `reads` None: the whole cache."""
    spans = _continuous_spans(lengths, ways, slots)
    weights = None if reads is None else (
        (prompt_len + _span_of(reads, np.maximum(_oldest_ages(spans), 1))) / (prompt_len + cap))
    return _steps_and_widths(list(spans), slots, weights=weights)[0]


@functools.lru_cache(maxsize=4096)  # small entries, keyed by the lengths' parameters: the search asks for every pool
def _continuous_batches(median: int | None, sigma: float, cap: int, rows: int, ways: int, slots: int,
                        reads: tuple[int, ...] | None = None, prompt_len: int = 0
                        ) -> tuple[tuple[float, float, float], ...]:
    """`_continuous_batch` on each drawn batch of response lengths (`_batches`)."""
    return tuple(_continuous_batch(batch, ways, slots, reads, prompt_len, cap)
                 for batch in _batches(median, sigma, cap, rows))


def _read_context(reads: tuple[int, ...], cap: int, prompt_len: int) -> np.ndarray:
    """Cached columns read at each of the `cap` decode steps of a pool that started together: step t (0-based,
    feeding response token t) reads prompt_len plus the narrowest of `reads` that holds t + 1 tokens."""
    return prompt_len + _span_of(reads, np.arange(1, cap + 1))


def _span_of(reads: tuple[int, ...], tokens: np.ndarray) -> np.ndarray:
    """The narrowest of `reads` that holds `tokens` response tokens (the widest for more), as floats."""
    ordered = np.sort(np.asarray(reads))
    return ordered[np.minimum(np.searchsorted(ordered, tokens), len(ordered) - 1)].astype(np.float64)


@functools.lru_cache(maxsize=4096)
def _held(median: int, sigma: float, cap: int, rows: int, page: int, ways: int, slots: int,
          stream: tuple[int, int, int, int] | None) -> int:
    """The most response pages a shard's rows hold at once (`_held_pages`) over the drawn batches of lengths
    (`_drawn_lengths`): on the continuous engine, batch by batch, or in a partial-rollout stream of
    `stream` = (group, group slots, chunk, staleness) in steady state. Cached: the search asks it for every
    plan it weighs."""
    lengths = _batches(median, sigma, cap, rows)
    if stream is not None:
        group, group_slots, chunk, staleness = stream
        return _held_pages(_stream_spans(lengths, group, ways, slots, group_slots, chunk, staleness)[0], page)
    return max(_held_pages(_continuous_spans(batch, ways, slots), page) for batch in lengths)


def _held_pages(spans: tuple[tuple[np.ndarray, np.ndarray], ...], page: int) -> int:
    """The most response pages any one shard's rows hold at once, to within a page a row: a row that has
    decoded k tokens holds ceil(k / page) pages (`models.continuous` takes one as its length crosses a page
    boundary and frees them when it ends), at most k / page + 1, so at each step the active rows hold at
    most their tokens / page plus one page each. Between a shard's events that only grows, so it peaks on
    the step before some row ends: counted there alone, from the rows' sorted starts and ends (the search
    asks this of every pool it weighs)."""
    most = 0
    for starts, ends in spans:
        by_start, by_end = np.sort(starts), np.argsort(ends, kind="stable")
        sorted_ends = ends[by_end]
        last = sorted_ends - 1  # the step before each row ends
        began = np.searchsorted(by_start, last, side="right")
        ended = np.searchsorted(sorted_ends, last, side="right")
        begun = np.concatenate([[0], np.cumsum(by_start)])[began] - np.concatenate([[0], np.cumsum(starts[by_end])])[ended]
        active = began - ended
        tokens = active * (last + 1) - begun  # the active rows' tokens after that step
        most = max(most, int(np.max(np.ceil(tokens / page) + active)))
    return most


@functools.lru_cache(maxsize=4096)
def _stream_runs(median: int | None, sigma: float, cap: int, rows: int, group: int, ways: int, slots: int,
                 group_slots: int, chunk: int, staleness: int, reads: tuple[int, ...] | None = None,
                 prompt_len: int = 0) -> tuple[tuple[float, float, float], ...]:
    """`_stream_batches` on the drawn batches of response lengths (`_batches`)."""
    return _stream_batches(_batches(median, sigma, cap, rows), group, ways, slots, group_slots, chunk, staleness,
                           reads, prompt_len, cap)


def _stream_batches(lengths: tuple[tuple[int, ...], ...], group: int, ways: int, slots: int, group_slots: int,
                    chunk: int, staleness: int, reads: tuple[int, ...] | None = None, prompt_len: int = 0,
                    cap: int = 0) -> tuple[tuple[float, float, float], ...]:
    """(steps, summed width / slots, summed width / slots x the step's columns read over the whole cache's) of a
    partial-rollout stream between one batch's completion and the next's, per batch of `lengths` [batches][rows],
    in steady state: the middle round of `_stream_spans` (work enters it from the round before and leaves it for
    the round after). A step reads the narrowest of `reads` that holds its oldest active row's tokens
    (`_oldest_ages`), after a prompt of `prompt_len`, of a cache of prompt_len + `cap` columns; `reads` None: the
    whole cache."""
    shards, done_at = _stream_spans(lengths, group, ways, slots, group_slots, chunk, staleness)
    weights = None if reads is None else (
        (prompt_len + _span_of(reads, np.maximum(_oldest_ages(shards), 1))) / (prompt_len + cap))
    parts = _steps_and_widths(list(shards), slots, np.array(done_at), weights)  # part k: batch k's, to its completion
    return tuple(parts[len(lengths):2 * len(lengths)])


def _oldest_ages(shards: tuple[tuple[np.ndarray, np.ndarray], ...]) -> np.ndarray:
    """At each decode step t, the tokens the oldest active row of any shard will hold after it (t - start + 1):
    the runtime reads that many response columns at least (`models.continuous.PagedEngine.step`); 0 where no row
    is active. Per shard, rows in start order: the oldest active at t is the first whose end is past t, found
    through the running maximum of the ends."""
    total = int(max(e.max() for _, e in shards))
    steps = np.arange(total)
    ages = np.zeros(total, dtype=np.int64)
    for starts, ends in shards:
        order = np.argsort(starts, kind="stable")
        first = np.searchsorted(np.maximum.accumulate(ends[order]), steps, side="right")
        found = first < len(order)
        start = starts[order][np.minimum(first, len(order) - 1)]
        ages = np.maximum(ages, np.where(found & (start <= steps), steps - start + 1, 0))
    return ages


@functools.lru_cache(maxsize=256)
def _stream_spans(lengths: tuple[tuple[int, ...], ...], group: int, ways: int, slots: int, group_slots: int,
                  chunk: int, staleness: int) -> tuple[tuple[tuple[np.ndarray, np.ndarray], ...], tuple[int, ...]]:
    """Each shard's rows' (starts, ends) in decode steps of a partial-rollout stream (`rollouts.stream`,
    `models.streaming`) running the batches of `lengths` [batches][rows] three times over, and the step at
    which each batch completes. As the runtime runs it: `group_slots`
    group slots per shard (staleness + 1 batches' groups), groups admitted in order to the shard with the
    most free ones, batch k's only once batch k - 1 - staleness is trained (admission pacing; an update
    counts as instant here: the simulator schedules it); a group's rows wait for the shard's `slots`
    decode slots in admission order; a done group's slot frees at the end of the chunk it ended in (the
    stream is read every `chunk` steps); a batch is complete when its last group is taken."""
    batches = [np.asarray(b, dtype=np.int64).reshape(-1, group) for b in lengths] * 3
    queue = [(k, g) for k, b in enumerate(batches) for g in b]
    free_slots = [[0] * slots for _ in range(ways)]  # when each decode slot frees, per shard (heaps)
    free_groups = [group_slots] * ways
    spans: list[list[tuple[int, int]]] = [[] for _ in range(ways)]
    running: list[tuple[int, int, int]] = []  # heap of (read at, shard, batch) of admitted groups not yet taken
    left = [len(b) for b in batches]  # groups of each batch not yet taken
    done_at = [0] * len(batches)
    t, nxt = 0, 0
    while nxt < len(queue) or running:
        while running and running[0][0] <= t:  # read at the end of the chunk they ended in
            _, shard, k = heapq.heappop(running)
            free_groups[shard] += 1
            left[k] -= 1
            if not left[k]:
                done_at[k] = t
        while nxt < len(queue):
            k, rows = queue[nxt]
            if k - 1 - staleness >= 0 and left[k - 1 - staleness]:
                break  # paced: that batch is not trained yet
            shard = max(range(ways), key=free_groups.__getitem__)
            if not free_groups[shard]:
                break
            free_groups[shard] -= 1
            end, heap, out = 0, free_slots[shard], spans[shard]
            for n in rows.tolist():
                start = heap[0] if heap[0] > t else t
                heapq.heapreplace(heap, start + n)  # the row takes the slot that frees first
                out.append((start, start + n))
                end = end if end > start + n else start + n
            heapq.heappush(running, (max(t + chunk, -(-end // chunk) * chunk), shard, k))
            nxt += 1
        t = running[0][0] if running else t + chunk
    shards = tuple((np.array([a for a, _ in s], dtype=np.int64), np.array([b for _, b in s], dtype=np.int64))
                   for s in spans if s)
    return shards, tuple(done_at)
