"""The loops every train and inference call shares: minibatch updates and micro-batches.

Updates: epochs x minibatches as one `lax.scan`, one optimizer update per
minibatch. An update is skipped (parameters and optimizer state unchanged)
when its loss or gradients are non-finite; a loss may also report that the
minibatch is too far off-policy (PPO's importance ratio early stop), after
which every later update of the call is skipped. A minibatch with nothing
to learn from (zero statistics weight: every response masked out, as after
dynamic sampling found too few informative groups) is skipped too, so Adam's
momentum does not move the parameters on an empty batch. All three are
counted in the returned stats (`skipped_nonfinite`, `skipped_ratio`,
`skipped_empty`).

Micro-batches: with `micro_batch` rows, each minibatch is split into
micro-batches whose gradients are accumulated inside the compiled update (a
scan), so peak activation memory is set by the micro-batch, not the
minibatch. A loss reports the *weight* of its micro-batch in the minibatch's
normaliser (its token count for a token mean, its sequence count for a
sequence mean, its rows for a per-pair loss); the accumulated loss and
gradient are the weight-averaged micro-batch ones, which is exactly the
un-micro-batched value. Micro-batches take rows j, j + k, j + 2k, ... so a
batch split over the data axes stays evenly split in every micro-batch.
Inference calls map over micro-batches the same way (`map_microbatches`).

Under a pipelined placement (stage > 1, `jaxrlhf.models.pipeline`) the
micro-batches are the pipeline's: the call runs the loss (or inference
function) once on the whole minibatch with `pipeline.microbatches(k)` set,
and every model forward inside runs its decoder layers as a GPipe schedule
over those k micro-batches, re-assembling the batch before the heads. The
loss is then computed on the re-assembled minibatch, which is by
construction the value the weighted accumulation reproduces (token-mean,
sequence-mean, Dr.GRPO alike), so both paths give the same loss, gradient
and stats up to float reduction order. The price: the heads' activations
(full-vocabulary logits) of the whole minibatch exist at once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from jaxrlhf.algorithms.optim import guarded_update, join_trainable, split_trainable
from jaxrlhf.models import pipeline

# loss_fn(params, minibatch) -> (loss, {"stats": {...}, "stop": bool scalar, "weight": scalar})
LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, Any]]]

SUMMED_STATS = ("skipped_nonfinite", "skipped_ratio", "skipped_empty")


def loss_aux(
    stats: dict[str, jax.Array],
    weight: jax.Array | float,
    stop: jax.Array | bool = False,
    stats_weight: jax.Array | float | None = None,
) -> dict[str, Any]:
    """The auxiliary output every loss function returns (see the module docstring).

    `stats` named "loss/..." are normalised like the loss and combine over
    micro-batches with `weight`; the others (token means such as clipfrac or
    entropy) combine with `stats_weight` (default: `weight`).
    """
    return {
        "stats": stats, "stop": jnp.asarray(stop), "weight": jnp.asarray(weight, jnp.float32),
        "stats_weight": jnp.asarray(weight if stats_weight is None else stats_weight, jnp.float32),
    }


def minibatch_indices(rng: jax.Array, batch: int, minibatches: int, epochs: int) -> Int[Array, "updates size"]:
    """Row indices of every minibatch of every epoch: [epochs * minibatches, batch / minibatches]."""
    size = batch // minibatches
    if minibatches == 1 and epochs == 1:
        return jnp.arange(batch)[None]
    perms = [jax.random.permutation(k, batch) for k in jax.random.split(rng, epochs)]
    return jnp.concatenate(perms).reshape(epochs * minibatches, size)


def take_rows(tree: Any, idx: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.take(x, idx, axis=0), tree)


def num_microbatches(rows: int, micro_batch: int | None) -> int:
    """Micro-batches of `micro_batch` rows in `rows` (1 without micro-batching)."""
    if micro_batch is None or micro_batch >= rows:
        return 1
    if rows % micro_batch:
        raise ValueError(f"{rows} rows do not split into micro-batches of {micro_batch}")
    return rows // micro_batch


def _rows(tree: Any) -> int:
    """Rows of a batch: the leading size of its arrays (scalars such as a KL coefficient do not count)."""
    return max((x.shape[0] for x in jax.tree_util.tree_leaves(tree) if jnp.ndim(x)), default=1)


# [B, ...] <-> [k, B / k, ...], micro-batch j holding rows j, j + k, ... (strided); the pipeline splits the same way.
split_microbatches = pipeline.split_rows
merge_microbatches = pipeline.merge_rows


def _scan_microbatches(fn: Callable[[Any, Any], tuple[Any, Any]], init: Any, batch: Any, k: int) -> tuple[Any, Any]:
    """`lax.scan` of `fn(carry, micro_batch)` over k micro-batches; scalars are shared, not split."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    split = [i for i, x in enumerate(leaves) if jnp.ndim(x)]
    parts = split_microbatches([leaves[i] for i in split], k)

    def body(carry, xs):
        full = list(leaves)
        for i, x in zip(split, xs):
            full[i] = x
        return fn(carry, jax.tree_util.tree_unflatten(treedef, full))

    return jax.lax.scan(body, init, parts)


def map_microbatches(fn: Callable[[Any], Any], batch: Any, micro_batch: int | None) -> Any:
    """`fn(batch)` computed micro-batch by micro-batch (outputs batch-major, in the original row order)."""
    k = num_microbatches(_rows(batch), micro_batch)
    if k == 1 or pipeline.is_pipelined():
        with pipeline.microbatches(k):
            return fn(batch)
    _, out = _scan_microbatches(lambda carry, b: (carry, fn(b)), None, batch, k)
    return merge_microbatches(out)


# ---------------------------------------------------------------- packed batches (`models.packing`)


def packed_micro_batch(data: Any, packed: dict[str, jax.Array], k: int | jax.Array | None) -> Any:
    """Micro-batch `k` of one update's packing (arrays [s, K, ...]; `k` None: all K merged into one,
    as a pipelined call runs them): the packed rows ([s * R, T]) and positions to read under
    "packed", and `data`'s per-sequence arrays gathered for its slots ([s * M, ...]; an empty slot gets
    zeros, so its masks are False), with `row_valid` marking the slots that hold a sequence. `take`
    ([s, P]) and `take_from` ([s * P] into the flattened [s * M, N] grid) are the real response
    tokens' read positions (`models.packing`)."""
    s = packed["slots"].shape[0]
    if k is None:  # [s, K, R, T] -> [s, K * R, T]; a slot's flat index moves by its micro-batch's rows
        kk, r, t = packed["tokens"].shape[1:4]
        offset = (jnp.arange(kk) * r * t).astype(jnp.int32)
        part = {name: x.reshape(s, -1, *x.shape[3:]) for name, x in packed.items()
                if name in ("tokens", "positions", "segments", "experts")}
        part["read"] = (packed["read"] + offset[None, :, None, None]).reshape(s, -1, packed["read"].shape[-1])
        part["last"] = (packed["last"] + offset[None, :, None]).reshape(s, -1)
        part["take"] = (packed["take"] + offset[None, :, None]).reshape(s, -1)
        grid = packed["slots"].shape[2] * packed["read"].shape[-1]  # a micro-batch's M * N
        k_grid = jnp.arange(kk, dtype=jnp.int32)[None, :, None] * grid
        part["take_from"] = jnp.where(packed["take_from"] < grid, packed["take_from"] + k_grid, kk * grid).reshape(s, -1)
        part["slots"] = packed["slots"].reshape(s, -1)
    else:
        part = {name: jnp.asarray(x)[:, k] for name, x in packed.items()}
    rows = _rows(data)
    slots = part["slots"].reshape(-1)
    gathered = jax.tree_util.tree_map(
        lambda x: jnp.take(x, slots, axis=0, mode="fill", fill_value=0) if jnp.ndim(x) else x, data)
    flat = lambda name: part[name].reshape(-1, part[name].shape[-1])  # noqa: E731
    # `take_from` indexes one shard's [M, N] grid: over all shards' [s * M, N] (s * M * N = none)
    grid = part["read"].shape[1] * part["read"].shape[2]
    shard_grid = jnp.arange(s, dtype=jnp.int32)[:, None] * grid
    take_from = jnp.where(part["take_from"] < grid, part["take_from"] + shard_grid, s * grid).reshape(-1)
    gathered["packed"] = {"tokens": flat("tokens"), "positions": flat("positions"), "segments": flat("segments"),
                          "read": part["read"], "last": part["last"], "slots": slots,
                          "take": part["take"], "take_from": take_from}
    if "experts" in part:  # router replay: [s * R, T, layers, k], as the tokens
        gathered["packed"]["experts"] = part["experts"].reshape(-1, *part["experts"].shape[-3:])
    gathered["row_valid"] = slots < rows
    return gathered


def map_packed(fn: Callable[[Any], Any], data: Any, packed: dict[str, jax.Array]) -> Any:
    """`fn(micro_batch)` over the micro-batches of a one-update packing (`packed_micro_batch`), its
    per-slot outputs scattered back to `data`'s rows (batch-major, in the original order)."""
    rows = _rows(data)
    one = jax.tree_util.tree_map(lambda x: x[:, 0], packed)
    kk = one["slots"].shape[1]
    if pipeline.is_pipelined():  # one forward over every micro-batch, the pipeline's schedule splits it
        with pipeline.microbatches(kk):
            out = fn(packed_micro_batch(data, one, None))
        slots = one["slots"].reshape(-1)
    else:
        def body(carry, k):
            return carry, fn(packed_micro_batch(data, one, k))

        _, out = jax.lax.scan(body, None, jnp.arange(kk))  # [K, s * M, ...]
        out = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), out)
        slots = jnp.moveaxis(one["slots"], 1, 0).reshape(-1)

    def scatter(x):
        return jnp.zeros((rows, *x.shape[1:]), x.dtype).at[slots].set(x, mode="drop")

    return jax.tree_util.tree_map(scatter, out)


def _combine_stats(stats: dict[str, jax.Array], loss_weights: jax.Array, stats_weights: jax.Array) -> dict:
    """Micro-batch stats -> minibatch stats: weighted means (see `loss_aux`), maxima for `.../max`."""

    def combine(key: str, v: jax.Array) -> jax.Array:
        if key.endswith("/max"):
            return jnp.max(v)
        w = loss_weights if key.startswith("loss/") else stats_weights
        return jnp.sum(v * w) / jnp.maximum(jnp.sum(w), 1e-30)

    return {k: combine(k, v) for k, v in stats.items()}


def accumulated_grad(
    loss_fn: LossFn, params: Any, batch: Any, micro_batch: int | None, packed: dict[str, jax.Array] | None = None,
) -> tuple[Any, ...]:
    """(loss, stats, stop, gradient, statistics weight) of `batch`, accumulated over micro-batches in fp32:
    strided micro-batches of `micro_batch` rows, or with `packed` (one update's packing, arrays
    [s, K, ...]) its K packed micro-batches (`packed_micro_batch`)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    k = num_microbatches(_rows(batch), micro_batch) if packed is None else packed["slots"].shape[1]
    if k == 1 or pipeline.is_pipelined():  # a pipeline splits the micro-batches inside the forward
        with pipeline.microbatches(k):
            whole = batch if packed is None else packed_micro_batch(batch, packed, None)
            (loss, aux), grads = grad_fn(params, whole)
        return loss, aux["stats"], aux["stop"], grads, aux["stats_weight"]

    def one(acc, micro):
        if packed is not None:  # the scan runs over micro-batch numbers
            micro = packed_micro_batch(batch, packed, micro)
        (loss, aux), grads = grad_fn(params, micro)
        w = aux["weight"]
        acc = jax.tree_util.tree_map(lambda a, g: a + w * g.astype(jnp.float32), acc, grads)
        return acc, (loss, aux["stats"], aux["stop"], w, aux["stats_weight"])

    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if packed is None:
        acc, (losses, stats, stops, weights, stats_weights) = _scan_microbatches(one, zeros, batch, k)
    else:
        acc, (losses, stats, stops, weights, stats_weights) = jax.lax.scan(one, zeros, jnp.arange(k))
    total = jnp.maximum(jnp.sum(weights), 1e-30)
    grads = jax.tree_util.tree_map(lambda a, p: (a / total).astype(p.dtype), acc, params)
    stats = _combine_stats(stats, weights, stats_weights)
    return jnp.sum(losses * weights) / total, stats, jnp.any(stops), grads, jnp.sum(stats_weights)


def minibatch_updates(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    data: Any,
    rng: jax.Array,
    *,
    minibatches: int = 1,
    epochs: int = 1,
    micro_batch: int | None = None,
    early_stop: bool = False,
    packed: dict[str, jax.Array] | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """Run the updates; stats are averaged over updates except the skip counters (summed).

    With `early_stop` the stop flag a loss returns skips that update and every later one. With
    `packed` (`models.packing`, arrays [s, U, K, ...]) update u trains on the sequences its
    packing holds, in its packed micro-batches; the host drew those rows with `minibatch_indices`
    from the same key, so the updates see the same minibatches as unpacked ones.
    """
    params, frozen = split_trainable(optimizer, params)  # LoRA: differentiate and update the adapters only
    if frozen is not None:
        full_loss = loss_fn
        loss_fn = lambda trained, rows: full_loss(join_trainable(trained, frozen), rows)  # noqa: E731
    batch = _rows(data)
    if batch % minibatches:
        raise ValueError(f"batch of {batch} rows does not split into {minibatches} minibatches")
    if packed is None:
        steps = minibatch_indices(rng, batch, minibatches, epochs)
    else:
        steps = jnp.arange(packed["slots"].shape[1])
        if steps.shape[0] != epochs * minibatches:
            raise ValueError(f"the packing holds {steps.shape[0]} updates; the call runs {epochs * minibatches}")

    def one(carry, rows):
        params, opt_state, stopped = carry
        if packed is None:
            loss, stats, stop, grads, weight = accumulated_grad(loss_fn, params, take_rows(data, rows), micro_batch)
        else:  # `rows` is the update's number
            update = jax.tree_util.tree_map(lambda x: x[:, rows], packed)
            loss, stats, stop, grads, weight = accumulated_grad(loss_fn, params, data, None, update)
        if early_stop:
            stopped = stopped | stop
        empty = weight <= 0
        params, opt_state, finite, grad_norm = guarded_update(
            optimizer, grads, opt_state, params, loss, ~stopped & ~empty
        )
        stats = dict(stats)
        stats["grad_norm"] = grad_norm
        stats["skipped_nonfinite"] = (~finite).astype(jnp.float32)
        stats["skipped_ratio"] = stopped.astype(jnp.float32)
        stats["skipped_empty"] = empty.astype(jnp.float32)
        return (params, opt_state, stopped), stats

    (params, opt_state, _), stats = jax.lax.scan(one, (params, opt_state, jnp.array(False)), steps)
    stats = {k: (jnp.sum(v) if k in SUMMED_STATS else jnp.mean(v)) for k, v in stats.items()}
    return join_trainable(params, frozen), opt_state, stats
