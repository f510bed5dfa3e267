"""KV-cache generation: one jitted prefill, one jitted on-device decode loop.

Design choices:
- Prompts are LEFT-padded to a bucket length (a power of two, at least
  `min_bucket`), so every prompt ends at the same slot and the number of
  compiled programs is bounded by the number of buckets. Rotary positions
  count real tokens only, so padding changes nothing for the real tokens.
- The decode loop is a `lax.while_loop` that stops when every row has hit
  EOS or `max_new_tokens` is reached; nothing is synced to host per token.
  A row ends on any of several EOS ids (Llama 3.1 has three), as in transformers.
- Generating past `max_position_embeddings` raises `GenerationError` before
  anything compiles: rotary positions the model never saw degrade it silently,
  and in RL the policy would then be trained on that output.
- The model enters the jitted functions as `(graphdef, state)`: the graphdef
  is static, the state an ordinary argument, so parameters may be sharded on
  any mesh and a trained state can be swapped in without recompiling.
- Every recorded log-prob is that of the processed distribution
  (`sampling.process_logits`), the same one `sampling.token_logprobs`
  recomputes during training.

The compile cache is jax.jit's own, keyed by (graphdef, bucket, batch,
max_new_tokens, sampling params, eos/pad ids, tag). `trace_count()` counts traces
(one per compile) so tests can check recompilation is bounded.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jaxrlhf.models import axes as ax
from jaxrlhf.models import moe
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.lengths import bucket_length
from jaxrlhf.models.sampling import SamplingParams, response_logprobs, sample
from jaxrlhf.models.slots import check_groups, shard_group
from jaxrlhf.models.transformer import KVCache, positions_from_mask, split_layers

_TRACES: collections.Counter[str] = collections.Counter()


def trace_count(name: str | None = None) -> int:
    """How many times the jitted prefill/decode functions were traced (each trace is a compile)."""
    return sum(_TRACES.values()) if name is None else _TRACES[name]


class GenerationError(ValueError):
    """Generation asked for more than the model supports (positions beyond its maximum)."""


def eos_tuple(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """EOS ids as a hashable tuple: None or a negative id (never stop early) give ()."""
    ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, (int, np.integer)) else list(eos_id)
    return tuple(dict.fromkeys(int(i) for i in ids if int(i) >= 0))


def check_max_positions(max_position_embeddings: int, prompt_length: int, max_new_tokens: int) -> None:
    """Raise unless `prompt_length` real prompt tokens plus `max_new_tokens` fit the model's positions.

    Rotary positions count real tokens only, so the bucket's left padding does
    not count: the last generated token sits at prompt_length + max_new_tokens - 1.
    """
    total = prompt_length + max_new_tokens
    if total > max_position_embeddings:
        raise GenerationError(
            f"a prompt of up to {prompt_length} tokens + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"model's max_position_embeddings {max_position_embeddings}; shorten the prompts or generate fewer "
            "tokens (in training: data.max_prompt_len, generation.max_new_tokens)"
        )


@struct.dataclass
class GenerationOutput:
    """Result of `generate`. P = bucketed prompt length, N = max_new_tokens.

    Response slots after EOS (or after an early exit) hold `pad_id`, log-prob 0
    and mask False. `tokens`/`mask`/`positions` are ready for a training forward.
    """

    tokens: Int[Array, "batch total"]  # left-padded prompt + response, total = P + N
    prompt_tokens: Int[Array, "batch prompt"]
    prompt_mask: Bool[Array, "batch prompt"]
    response_tokens: Int[Array, "batch new"]
    response_mask: Bool[Array, "batch new"]
    logprobs: Float[Array, "batch new"]  # of the processed distribution, 0 where masked
    lengths: Int[Array, " batch"]  # response lengths (EOS included)
    ended_with_eos: Bool[Array, " batch"]
    # the continuous engine's most response KV pages in use at once (all shards); None for the static engine
    kv_pages_used: Int[Array, ""] | None = None
    # with `record_experts` (router replay): the experts every layer routed each token to, as the forward that
    # fed the token in ran (prompt at prefill, response token t at decode step t + 1); -1 for padding and for a
    # row's last token (never fed back: nothing reads its output); int8 or int16 (`expert_dtype`). None without
    # recording.
    experts: Int[Array, "batch total layers k"] | None = None

    @property
    def mask(self) -> Bool[Array, "batch total"]:
        return jnp.concatenate([self.prompt_mask, self.response_mask], axis=1)

    @property
    def positions(self) -> Int[Array, "batch total"]:
        return positions_from_mask(self.mask)

    @property
    def prompt_length(self) -> int:
        return self.prompt_tokens.shape[1]


def _left_align(
    tokens: Int[Array, "batch length"], mask: Bool[Array, "batch length"], pad_id: int, bucket: int
) -> tuple[Int[Array, "batch bucket"], Bool[Array, "batch bucket"]]:
    """Move each row's real tokens to the right end (order kept) and left-pad to `bucket`."""
    order = jnp.argsort(mask.astype(jnp.int32), axis=1, stable=True)  # pads first, then real tokens in order
    mask = jnp.take_along_axis(mask, order, axis=1)
    tokens = jnp.where(mask, jnp.take_along_axis(tokens, order, axis=1), pad_id)
    extra = bucket - tokens.shape[1]
    tokens = jnp.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id)
    mask = jnp.pad(mask, ((0, 0), (extra, 0)), constant_values=False)
    return tokens.astype(jnp.int32), mask


def routed_experts(
    config: ModelConfig, router_logits: Float[Array, "layers batch length experts"], valid: Bool[Array, "batch length"]
) -> Int[Array, "batch length layers k"]:
    """The experts each token was routed to (`moe.route` of the router logits a forward recorded: the choice
    the forward made), -1 where `valid` is False, as `expert_dtype`."""
    _, experts = moe.route(router_logits, config.num_experts_per_tok, config.router_order, config.norm_topk_prob)
    return jnp.where(valid[:, :, None, None], jnp.moveaxis(experts, 0, 2), -1).astype(expert_dtype(config))


def expert_dtype(config: ModelConfig) -> jnp.dtype:
    """The narrowest signed integer that holds every expert index and -1: recorded experts travel with the
    batch (layers x k per token), int8 up to 128 experts (indices 0..127; 4x less than int32), int16 beyond."""
    return jnp.dtype(jnp.int8 if config.num_experts <= 128 else jnp.int16)


def prefill_routed(
    graphdef: nnx.GraphDef, state: nnx.State, tokens: Int[Array, "batch length"], mask: Bool[Array, "batch length"],
    **kwargs: Any,
) -> tuple[tuple[Any, ...], Int[Array, "batch bucket layers k"]]:
    """`_prefill`'s outputs and the experts its forward routed each real prompt token to (router replay)."""
    out, router = moe.forward_with_router_logits(functools.partial(_prefill, graphdef, state), tokens, mask, **kwargs)
    return out, routed_experts(nnx.merge(graphdef, state).config, router, out[1])


def _prefill(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: Int[Array, "batch length"],
    mask: Bool[Array, "batch length"],
    *,
    bucket: int,
    max_new_tokens: int,
    pad_id: int,
    tag: Hashable = None,
) -> tuple[Int[Array, "batch bucket"], Bool[Array, "batch bucket"], Float[Array, "batch vocab"], KVCache]:
    """Left-align and bucket the prompt, run it through the model, return last logits and the cache."""
    _TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    tokens, mask = _left_align(tokens, mask.astype(bool), pad_id, bucket)
    cache = KVCache.init(model.config, tokens.shape[0], bucket + max_new_tokens)
    logits, cache = model(tokens, positions_from_mask(mask), mask, cache, logits_from=-1)
    return tokens, mask, logits[:, -1], cache


def _decode(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt_tokens: Int[Array, "batch prompt"],
    prompt_mask: Bool[Array, "batch prompt"],
    last_logits: Float[Array, "batch vocab"],
    cache: KVCache,
    rng: PRNGKeyArray,
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    eos_ids: tuple[int, ...],
    pad_id: int,
    tag: Hashable = None,
    max_lengths: Int[Array, " batch"] | None = None,
    prompt_experts: Int[Array, "batch prompt layers k"] | None = None,
) -> GenerationOutput:
    """Sample up to `max_new_tokens` tokens on device; a row ends on any of `eos_ids` or after its
    `max_lengths` tokens (optional, per row), the loop when all rows have ended. With `prompt_experts`
    (the prefill's routing, `prefill_routed`) every step records the experts its token went to too."""
    _TRACES["decode"] += 1
    model = nnx.merge(graphdef, state)
    batch, n = prompt_tokens.shape[0], max_new_tokens

    def emit(i, logits, done, outs):
        """Sample response token i; rows already done get pad, log-prob 0 and mask False."""
        token, logp = sample(jax.random.fold_in(rng, i), logits, sampling)
        token = jnp.where(done, pad_id, token)
        valid = ~done
        logp = jnp.where(done, 0.0, logp)
        outs = tuple(
            jax.lax.dynamic_update_slice_in_dim(o, x[:, None], i, axis=1) for o, x in zip(outs, (token, logp, valid))
        )
        if eos_ids:
            done = done | jnp.isin(token, jnp.asarray(eos_ids, jnp.int32))
        if max_lengths is not None:
            done = done | (i + 1 >= max_lengths)
        return token, valid, done, outs

    outs = (
        jnp.full((batch, n), pad_id, jnp.int32),  # tokens
        jnp.zeros((batch, n), jnp.float32),  # log-probs
        jnp.zeros((batch, n), bool),  # mask
    )
    record = prompt_experts is not None
    routed = jnp.full((batch, n, *prompt_experts.shape[2:]), -1, prompt_experts.dtype) if record else None
    token, valid, done, outs = emit(0, last_logits, jnp.zeros((batch,), bool), outs)
    position = prompt_mask.sum(axis=1).astype(jnp.int32)  # rotary position of the first response token

    def cond(carry):
        i, _, _, _, done, _, _, _ = carry
        return (i < n) & ~jnp.all(done)

    layers = split_layers(model)  # once, outside the token loop (see Transformer.__call__)

    def body(carry):
        i, cache, token, valid, done, position, outs, routed = carry
        args = (token[:, None], position[:, None], valid[:, None], cache)
        if record:  # the routing of response token i - 1, which this step feeds in
            (logits, cache), router = moe.forward_with_router_logits(model, *args, layers_split=layers)
            routed = jax.lax.dynamic_update_slice_in_dim(
                routed, routed_experts(model.config, router, valid[:, None]), i - 1, axis=1)
        else:
            logits, cache = model(*args, layers_split=layers)
        token, valid, done, outs = emit(i, logits[:, 0], done, outs)
        return i + 1, cache, token, valid, done, position + 1, outs, routed

    carry = (jnp.int32(1), cache.per_layer(), token, valid, done, position, outs, routed)
    *_, done, _, (out_tokens, out_logp, out_valid), routed = jax.lax.while_loop(cond, body, carry)
    if max_lengths is not None:  # a row cut by its length limit did not end with EOS
        last = jnp.take_along_axis(out_tokens, jnp.maximum(out_valid.sum(axis=1) - 1, 0)[:, None], axis=1)[:, 0]
        done = done & jnp.isin(last, jnp.asarray(eos_ids or (-1,), jnp.int32))
    return GenerationOutput(
        tokens=jnp.concatenate([prompt_tokens, out_tokens], axis=1),
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        response_tokens=out_tokens,
        response_mask=out_valid,
        logprobs=out_logp,
        lengths=out_valid.sum(axis=1).astype(jnp.int32),
        ended_with_eos=done,
        experts=jnp.concatenate([prompt_experts, routed], axis=1) if record else None,
    )


def generate_tokens(
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
    min_bucket: int = 16,
    max_lengths: Int[Array, " batch"] | None = None,
    group_size: int = 1,
    record_experts: bool = False,
) -> GenerationOutput:
    """Prefill and decode as one pure function: the form a placed call compiles (one program
    per placement and prompt bucket). Prompts may be padded on either side (see `Generator`).

    eos_id: one id or all the ids that end a row; max_lengths (optional): a row's own cap on its
    response length (a benchmark forces long-tailed lengths with it); group_size: rows g*G .. g*G + G-1
    hold the same prompt (G samples of it), which is prefilled once and its cache copied to the group;
    record_experts: a mixture of experts' routing of every token, in `GenerationOutput.experts`. Raises `GenerationError` at trace time when the prompt width plus `max_new_tokens` exceeds the
    model's `max_position_embeddings`.
    """
    config = nnx.merge(graphdef, state).config
    rows = prompt_tokens.shape[0]
    check_max_positions(config.max_position_embeddings, prompt_tokens.shape[1], max_new_tokens)
    check_groups(rows, group_size)
    bucket = bucket_length(prompt_tokens.shape[1], min_bucket)
    ways = ax.batch_ways()
    g = shard_group(rows, group_size, ways) if rows % ways == 0 else 1  # never straddling two batch shards
    if g > 1:
        picked = jnp.arange(rows // g) * g
        prompt_tokens, prompt_mask = jnp.asarray(prompt_tokens)[picked], jnp.asarray(prompt_mask)[picked]
    prefill = prefill_routed if record_experts else _prefill
    out = prefill(graphdef, state, prompt_tokens, prompt_mask, bucket=bucket, max_new_tokens=max_new_tokens,
                  pad_id=pad_id)
    (tokens, mask, last_logits, cache), experts = out if record_experts else (out, None)
    if g > 1:
        tokens, mask, last_logits = (jnp.repeat(x, g, axis=0) for x in (tokens, mask, last_logits))
        experts = None if experts is None else jnp.repeat(experts, g, axis=0)
        cache = cache.repeat_rows(g)
    return _decode(
        graphdef, state, tokens, mask, last_logits, cache, rng,
        max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_tuple(eos_id), pad_id=pad_id,
        max_lengths=max_lengths, prompt_experts=experts,
    )


# `tag` only separates compile caches: `axes.constrain` reads its resolver while tracing, so generation
# under different `activation_sharding` resolvers needs a distinct tag per resolver.
prefill_fn = jax.jit(_prefill, static_argnums=0, static_argnames=("bucket", "max_new_tokens", "pad_id", "tag"))
decode_fn = jax.jit(
    _decode, static_argnums=0, static_argnames=("max_new_tokens", "sampling", "eos_ids", "pad_id", "tag")
)


def note_trace(name: str) -> None:
    """Count one trace of a jitted generation function (another engine's, see `trace_count`)."""
    _TRACES[name] += 1


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int, min_bucket: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into a bucket-length [batch, bucket] array and mask (host side)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    bucket = bucket_length(max(len(p) for p in prompts), min_bucket)
    tokens = np.full((len(prompts), bucket), pad_id, np.int32)
    mask = np.zeros((len(prompts), bucket), bool)
    for row, p in enumerate(prompts):
        tokens[row, bucket - len(p):] = p
        mask[row, bucket - len(p):] = True
    return tokens, mask


class Generator:
    """Generation bound to a model structure (graphdef) and special tokens; the state is passed per call.

    For the RL rollout: build once from the actor's graphdef, call with the
    current (possibly sharded) actor state each step. Same shapes and
    settings never recompile. `tag` (any hashable) keeps separate compiled
    programs per tag: use one per placement when tracing under different
    `axes.activation_sharding` resolvers. `eos_id` is one id or all the ids
    that end a row (None or -1: never stop early).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        *,
        eos_id: int | Sequence[int] | None,
        pad_id: int,
        min_bucket: int = 16,
        tag: Hashable = None,
    ):
        self.graphdef = graphdef
        self.tag = tag
        self.eos_ids = eos_tuple(eos_id)
        self.pad_id = int(pad_id)
        self.min_bucket = min_bucket

    @classmethod
    def for_model(cls, model: nnx.Module, **kwargs: Any) -> tuple["Generator", nnx.State]:
        """Split a model; eos/pad default to its config's ids (every EOS id; pad falls back to 0)."""
        graphdef, state = nnx.split(model)
        cfg = model.config
        kwargs.setdefault("eos_id", cfg.eos_token_ids)
        kwargs.setdefault("pad_id", cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        return cls(graphdef, **kwargs), state

    def __call__(
        self,
        state: nnx.State,
        prompt_tokens: Sequence[Sequence[int]] | Int[Array, "batch length"] | np.ndarray,
        prompt_mask: Bool[Array, "batch length"] | np.ndarray | None = None,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        rng: PRNGKeyArray | int = 0,
    ) -> GenerationOutput:
        """Generate for a batch of prompts: token lists, or a [batch, length] array plus mask.

        An array may be padded on either side (its mask says which tokens are
        real); it is left-aligned on device and padded to the bucket of its width.
        Every row needs at least one real token. Raises `GenerationError` when the
        longest prompt plus `max_new_tokens` exceeds the model's `max_position_embeddings`.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prompt_mask is None:
            if isinstance(prompt_tokens, (np.ndarray, jax.Array)):
                raise ValueError("pass prompt_mask with an array of prompt tokens")
            longest = max((len(p) for p in prompt_tokens), default=0)
            prompt_tokens, prompt_mask = pad_prompts(prompt_tokens, self.pad_id, self.min_bucket)
        elif isinstance(prompt_mask, np.ndarray):
            longest = int(prompt_mask.sum(axis=1).max(initial=0))
        else:  # a device array: its width bounds the prompt length without a device-to-host copy
            longest = prompt_tokens.shape[1]
        max_positions = nnx.merge(self.graphdef, state).config.max_position_embeddings
        check_max_positions(max_positions, longest, max_new_tokens)
        if isinstance(rng, int):
            rng = jax.random.key(rng)
        bucket = bucket_length(prompt_tokens.shape[1], self.min_bucket)
        tokens, mask, last_logits, cache = prefill_fn(
            self.graphdef, state, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask),
            bucket=bucket, max_new_tokens=max_new_tokens, pad_id=self.pad_id, tag=self.tag,
        )
        return decode_fn(
            self.graphdef, state, tokens, mask, last_logits, cache, rng,
            max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=self.eos_ids, pad_id=self.pad_id,
            tag=self.tag,
        )


def generate(
    model: nnx.Module | tuple[nnx.GraphDef, nnx.State],
    prompt_tokens: Sequence[Sequence[int]] | Int[Array, "batch length"] | np.ndarray,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    rng: PRNGKeyArray | int = 0,
    *,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int | None = None,
    prompt_mask: Bool[Array, "batch length"] | np.ndarray | None = None,
    min_bucket: int = 16,
) -> GenerationOutput:
    """One-call generation from an nnx model or a (graphdef, state) pair.

    eos_id (one id or several: a row stops on any) and pad_id default to the
    model config's ids (all its EOS ids; pad falls back to 0). Pass eos_id=-1
    to never stop early.
    """
    if isinstance(model, tuple):
        graphdef, state = model
        config = nnx.merge(graphdef, state).config if eos_id is None or pad_id is None else None
    else:
        graphdef, state = nnx.split(model)
        config = model.config
    if eos_id is None:
        eos_id = config.eos_token_ids
    if pad_id is None:
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    gen = Generator(graphdef, eos_id=eos_id, pad_id=pad_id, min_bucket=min_bucket)
    return gen(state, prompt_tokens, prompt_mask, max_new_tokens=max_new_tokens, sampling=sampling, rng=rng)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _recompute(graphdef: nnx.GraphDef, state: nnx.State, out: GenerationOutput, sampling: SamplingParams):
    logits, _ = nnx.merge(graphdef, state)(out.tokens, out.positions, out.mask)
    return response_logprobs(logits, out.response_tokens, out.response_mask, sampling)


def recompute_logprobs(
    model: nnx.Module, out: GenerationOutput, sampling: SamplingParams
) -> Float[Array, "batch new"]:
    """Training-style log-probs of the response: one full forward, same logits processing, 0 where masked."""
    graphdef, state = nnx.split(model)
    return _recompute(graphdef, state, out, sampling)
