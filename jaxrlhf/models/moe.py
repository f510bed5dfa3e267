"""Mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): a router picks k experts per token, their gated
MLPs' outputs summed with the router's weights (plus, in Qwen2-MoE, a shared expert every token goes through,
scaled by a sigmoid gate); the router logits for the load-balancing loss; that loss.

Routing (`route`), per family (`ModelConfig.router_order`, `norm_topk_prob`): the router's logits
(x @ W_router, accumulated in float32) go through a softmax over every expert and the k largest
probabilities are kept, renormalised to sum to 1 where `norm_topk_prob` (transformers' Qwen2-MoE and
Qwen3-MoE, per config: Qwen3-MoE's published sizes renormalise; Mixtral always does); or, "topk_then_softmax", the k largest logits
go through a softmax of their own (Mistral's reference Mixtral code; the same weights in exact arithmetic).
Ties between equal probabilities go to the lower expert index (`jax.lax.top_k`, as `torch.topk`).

Dispatch: *dense*. Every token goes through every expert as one batched einsum over the stacked expert
weights ([expert, embed, mlp]), and the experts' outputs are combined with one weight per (token, expert)
that is the router's weight for the token's k picked experts and exactly 0 for the others (a one-hot
combine). So each token's output is exactly the weighted sum over its k experts (an unpicked expert adds
0 * a finite value), no token is ever dropped (no expert capacity, no capacity factor), and the program
has static shapes and no gathers or sorts, which makes it simple to differentiate and to shard by the
existing logical axes. Its cost is num_experts / k times the useful FLOPs and a [tokens, experts, mlp]
intermediate: right for the tiny and small models, and the default (`ModelConfig.moe_dispatch="dense"`).
Real-size MoE training wants the *grouped* dispatch (`moe_dispatch="grouped"`, `grouped`): the (token, k)
assignments sorted by expert, `jax.lax.ragged_dot` against the stacked experts with group sizes = tokens per
expert, scattered back weighted by the router; still exact and static-shaped (tokens x k rows, nothing
dropped), with only the k picked experts' FLOPs. CPU's ragged_dot does not exploit the groups (about the
dense dispatch's time there); the planner prices its FLOPs from the k experts (`planner.sizes.flop_params`).

Expert parallelism (a layout's `expert` degree e > 1, the logical EXPERT axis on the "expert" mesh axis;
`expert_parallel`): each device holds num_experts / e experts, and the batch is split over the expert axis
as over data everywhere else. Inside a `shard_map`, a device all-gathers its expert group's tokens and their
combine weights over the axis, runs its own experts on all of them with the dense dispatch above, and the
partial sums are reduce-scattered back to the tokens' devices (summed over the tensor axis too, each device
having run its slice of every local expert's MLP). Why this and not an all-to-all: the all-to-all dispatch
that sends each token only to the devices of its k experts must, to be exact (no token dropped), give
every destination a buffer of (tokens x min(k, num_experts / e)) rows, and its dense compute then runs
every expert on every buffer row; the gather sends each token once to each peer ((e - 1) x tokens x
(hidden + num_experts) bytes in, (e - 1) x tokens x hidden out per device and layer), k times fewer
bytes than the exact all-to-all for k <= num_experts / e, and the FLOPs per device are the dense
dispatch's over the device's own tokens. The all-to-all wins only with a capacity factor that may drop
tokens or a grouped dispatch, neither of which is here. Gradients flow through `all_gather` and
`psum_scatter`, whose transposes are each other; the planner prices exactly this (`planner.cost`,
`expert_comm`; `planner.memory.expert_gather_bytes`).

Router statistics: `SparseMLP` returns its router logits beside its output; the trunk
(`transformer.Transformer`) stacks them over layers and hands them to `record`, which keeps them only
inside `forward_with_router_logits`: a plain forward returns what it always did, and dense models record
nothing. `load_balancing_loss` is transformers' `load_balancing_loss_func` (Switch Transformer's
num_experts * sum_i f_i * P_i over every layer's tokens, padding masked out); `router_statistics` gives
the per-layer load fractions and mean router probabilities.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import ModelConfig

_normal = jax.nn.initializers.normal(stddev=0.02)
# The gate activations of `transformer.MLP`, which a sparse MLP's experts share (config.mlp_activation).
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def route(
    logits: Float[Array, "*tokens experts"], k: int, order: str = "softmax_then_topk", normalize: bool = False,
    experts: Int[Array, "*tokens k"] | None = None,
) -> tuple[Float[Array, "*tokens k"], Int[Array, "*tokens k"]]:
    """The k experts each token goes to and their float32 weights, from the router's logits (see the module
    docstring for the two orders).

    `experts` (router replay): the experts to use instead of the top k, -1 where a token was not recorded
    (it is routed afresh). Their weights are still the current router's, computed by the family's order at
    those indices (softmax over every expert gathered there, renormalised where `normalize`; or a softmax of
    the logits gathered there), so the router keeps its gradient: Megatron's router replay gathers the
    current scores at the replayed indices the same way (verl's and slime's R3 use it)."""
    logits = logits.astype(jnp.float32)
    if order not in ("softmax_then_topk", "topk_then_softmax"):
        raise ValueError(f"router order {order!r}: choose 'softmax_then_topk' or 'topk_then_softmax'")
    if experts is not None:
        experts = jnp.where(experts >= 0, experts, route(logits, k, order, normalize)[1])
    if order == "topk_then_softmax":
        top, experts = jax.lax.top_k(logits, k) if experts is None else (
            jnp.take_along_axis(logits, experts, axis=-1), experts)
        return jax.nn.softmax(top, axis=-1), experts
    probs = jax.nn.softmax(logits, axis=-1)
    if experts is None:
        weights, experts = jax.lax.top_k(probs, k)
    else:
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def combine_weights(
    weights: Float[Array, "*tokens k"], experts: Int[Array, "*tokens k"], num_experts: int
) -> Float[Array, "*tokens experts"]:
    """Each token's weight for every expert: its router weight for the k it goes to, exactly 0 elsewhere."""
    return jnp.einsum("...k,...ke->...e", weights, jax.nn.one_hot(experts, num_experts, dtype=weights.dtype))


class SparseMLP(nnx.Module):
    """`num_experts` gated MLPs (the activation of `config.mlp_activation`) and a linear router without
    bias. Parameters: `router` [embed, expert], `gate` / `up` [expert, embed, mlp], `down` [expert, mlp,
    embed] (HF's per-expert `gate_proj` / `up_proj` / `down_proj`, transposed and stacked); with a shared
    expert (`shared_expert_intermediate_size`, Qwen2-MoE) also `shared_gate` / `shared_up` [embed, mlp],
    `shared_down` [mlp, embed] and its gate `shared_expert_gate` [embed]: every token's output gains
    sigmoid(x @ shared_expert_gate) * the shared MLP's."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.dtype = config.jnp_dtype
        self.activation = config.mlp_activation
        self.top_k = config.num_experts_per_tok
        self.order = config.router_order
        self.normalize = config.norm_topk_prob
        self.dispatch = config.moe_dispatch
        e, d, f, pd = config.num_experts, config.hidden_size, config.expert_intermediate_size, config.jnp_param_dtype

        def param(shape, names):
            return nnx.Param(_normal(rngs.params(), shape, pd), logical_axes=names)

        self.router = param((d, e), (ax.EMBED, ax.EXPERT))
        self.gate = param((e, d, f), (ax.EXPERT, ax.EMBED, ax.MLP))
        self.up = param((e, d, f), (ax.EXPERT, ax.EMBED, ax.MLP))
        self.down = param((e, f, d), (ax.EXPERT, ax.MLP, ax.EMBED))
        self.shared = config.shared_expert_intermediate_size is not None
        if self.shared:  # Qwen2-MoE: one more gated MLP for every token, scaled by a sigmoid gate
            fs = config.shared_expert_intermediate_size
            self.shared_gate = param((d, fs), (ax.EMBED, ax.MLP))
            self.shared_up = param((d, fs), (ax.EMBED, ax.MLP))
            self.shared_down = param((fs, d), (ax.MLP, ax.EMBED))
            self.shared_expert_gate = param((d,), (ax.EMBED,))

    def __call__(
        self, x: Float[Array, "batch length embed"], layer: Int[Array, ""] | int | None = None
    ) -> tuple[Float[Array, "batch length embed"], Float[Array, "batch length experts"]]:
        """The MLP's output and the router's float32 logits. `layer` (this layer's index) reads its experts
        from a `replaying` forward's recorded routing."""
        dt = self.dtype
        b, t, d = x.shape
        xs = x.reshape(b * t, d)  # tokens flattened, as `transformer.dense` (a plain matmul's gradient on CPU)
        logits = jnp.matmul(xs, self.router.value.astype(dt), preferred_element_type=jnp.float32)
        weights, experts = route(logits, self.top_k, self.order, self.normalize, _replayed(layer, b, t))
        combine = combine_weights(weights, experts, logits.shape[-1]).astype(dt)  # [tokens, experts]
        weights3 = tuple(w.value.astype(dt) for w in (self.gate, self.up, self.down))
        if ax.expert_ways() > 1:  # expert parallelism: each device runs its own experts (see the module docstring)
            grouped_k = self.top_k if self.dispatch == "grouped" else None
            y = expert_parallel(x, combine.reshape(b, t, -1), *weights3, self.activation, grouped_k)
        elif self.dispatch == "grouped":
            y = grouped(xs, weights.astype(dt), experts, *weights3, self.activation).reshape(b, t, d)
        else:
            g = jnp.einsum("nd,edf->nef", xs, weights3[0])
            u = jnp.einsum("nd,edf->nef", xs, weights3[1])
            h = _ACTIVATIONS[self.activation](g) * u * combine[:, :, None]
            h = ax.constrain(h.reshape(b, t, *h.shape[1:]), (ax.BATCH, ax.LENGTH, ax.EXPERT, ax.MLP))
            y = jnp.einsum("btef,efd->btd", h, weights3[2])
        if self.shared:
            act = _ACTIVATIONS[self.activation]
            hs = act(xs @ self.shared_gate.value.astype(dt)) * (xs @ self.shared_up.value.astype(dt))
            scale = jax.nn.sigmoid(xs @ self.shared_expert_gate.value.astype(dt))[:, None]
            y = y + (scale * (hs @ self.shared_down.value.astype(dt))).reshape(b, t, d)
        return y, logits.reshape(b, t, -1)


def grouped(
    xs: Float[Array, "tokens embed"], weights: Float[Array, "tokens k"], experts: Int[Array, "tokens k"],
    gate: Float[Array, "experts embed mlp"], up: Float[Array, "experts embed mlp"],
    down: Float[Array, "experts mlp embed"], activation: str,
) -> Float[Array, "tokens embed"]:
    """The grouped dispatch: the tokens x k (token, expert) assignments sorted by expert (stable), each
    token's row gathered once per assignment, `jax.lax.ragged_dot` against the stacked expert weights with
    group sizes = assignments per expert (static shapes, nothing dropped), and the rows scattered back onto
    their tokens weighted by the router. Only the k picked experts' FLOPs, unlike the dense dispatch."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k  # assignment i of the sorted order is token order[i] // k's choice order[i] % k
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    rows = xs[token]
    h = _ACTIVATIONS[activation](jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(h, down, sizes) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(xs).at[token].add(out.astype(xs.dtype))


# ---------------------------------------------------------------- router replay

_REPLAY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("router_replay", default=None)


@contextlib.contextmanager
def replaying(experts: Int[Array, "layers batch length k"] | None) -> Iterator[None]:
    """Inside, every sparse MLP routes token (row, column) of layer l to `experts[l, row, column]` (-1: the
    current router's top k) with the current router's weights there (`route`): router replay, the rollout's
    routing reused in a train or inference forward of the same rows. Set it where the model is called (inside
    the same jit or grad); None replays nothing."""
    token = _REPLAY.set(experts)
    try:
        yield
    finally:
        _REPLAY.reset(token)


def _replayed(layer: Int[Array, ""] | int | None, b: int, t: int) -> Int[Array, "tokens k"] | None:
    """This layer's replayed experts, flattened as the MLP's tokens; a forward longer than the recorded rows
    (context parallelism pads the length) routes the extra columns afresh."""
    experts = _REPLAY.get()
    if experts is None:
        return None
    if layer is None or experts.shape[1] != b or experts.shape[2] > t:
        raise ValueError(f"router replay: recorded experts {experts.shape} (layers, batch, length, k) do not fit "
                         f"a forward of {b} rows x {t} tokens at layer {layer} (a pipelined forward, stage > 1, "
                         "splits the batch and cannot replay)")
    mine = experts[layer]
    mine = jnp.pad(mine, ((0, 0), (0, t - mine.shape[1]), (0, 0)), constant_values=-1)
    return mine.reshape(b * t, -1).astype(jnp.int32)


# ---------------------------------------------------------------- expert parallelism


def _entry(entry: Any) -> tuple[str, ...]:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _fit(entry: Any, size: int, mesh_shape: Any) -> Any:
    """The leading mesh axes of a spec entry whose sizes divide `size` (a dimension they cannot split stays
    replicated over the rest, as placement's rules do)."""
    names = list(_entry(entry))
    while names and size % math.prod(mesh_shape[n] for n in names):
        names.pop()
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def expert_parallel(
    x: Float[Array, "batch length embed"], combine: Float[Array, "batch length experts"],
    gate: Float[Array, "experts embed mlp"], up: Float[Array, "experts embed mlp"],
    down: Float[Array, "experts mlp embed"], activation: str, grouped_k: int | None = None,
) -> Float[Array, "batch length embed"]:
    """The experts' weighted sum for every token with the experts split over the mesh axis the current
    activation rules give "expert" (`axes.expert_ways` > 1): inside a `shard_map`, each device gathers the
    tokens of its expert group (all-gather over the axis), runs its num_experts / e experts densely on them
    (each token's unpicked experts weighted 0, as the dense dispatch), and the partial sums are reduce-
    scattered back to the devices that own the tokens (a psum where the batch is not split over the axis).
    Under tensor parallelism each device holds its slice of every local expert's MLP and the partial sums
    are also summed over the tensor axis. Exact: the same sums as the dense dispatch, in another order.
    `grouped_k` (the router's k): each device runs the grouped dispatch over its local experts instead, a
    token's picks of other devices' experts going to no group (nothing computed for them)."""
    sharding = ax.resolved((ax.EXPERT,))
    mesh, shape = sharding.mesh, sharding.mesh.shape
    axis = _entry(sharding.spec[0])
    axis_name = axis[0] if len(axis) == 1 else axis
    ways = math.prod(shape[n] for n in axis)
    b, t, _ = x.shape
    num_experts, _, f = gate.shape
    if num_experts % ways:
        ok = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ValueError(f"expert parallelism over {ways} devices (mesh {dict(shape)}) does not divide "
                         f"num_experts={num_experts}: use a layout with expert in {ok}")
    tok_spec = tuple(ax.resolved((ax.BATCH, ax.LENGTH, ax.EMBED)).spec) + (None,) * 3
    batch, length = _fit(tok_spec[0], b, shape), _fit(tok_spec[1], t, shape)
    mlp = _fit(ax.resolved((ax.MLP,)).spec[0] if ax.resolved((ax.MLP,)).spec else None, f, shape)
    if set(_entry(mlp)) & set(axis):
        mlp = None
    gathered = bool(set(_entry(batch)) & set(axis))  # tokens split over the expert axis: gather, then scatter
    local = num_experts // ways
    act = _ACTIVATIONS[activation]

    def body(x, combine, gate, up, down):
        if gathered:  # the expert group's tokens, in the order of its devices' blocks
            x = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
            combine = jax.lax.all_gather(combine, axis_name, axis=0, tiled=True)
        mine = jax.lax.dynamic_slice_in_dim(combine, jax.lax.axis_index(axis_name) * local, local, axis=-1)
        if grouped_k is not None:  # this device's picks; a token's other picks get id `local`: no group
            picked, ids = jax.lax.top_k(mine, min(grouped_k, local))
            ids = jnp.where(picked != 0, ids, local)
            bb, tt, dd = x.shape
            y = grouped(x.reshape(bb * tt, dd), picked.reshape(bb * tt, -1), ids.reshape(bb * tt, -1),
                        gate, up, down, activation).reshape(bb, tt, dd)
        else:
            h = act(jnp.einsum("btd,edf->btef", x, gate)) * jnp.einsum("btd,edf->btef", x, up) * mine[..., None]
            y = jnp.einsum("btef,efd->btd", h, down)
        if mlp is not None:  # each tensor peer summed its slice of the MLP width
            y = jax.lax.psum(y, mlp)
        if gathered:
            return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, axis_name)

    tokens = P(batch, length, None)
    w_in, w_out = P(axis_name, None, mlp), P(axis_name, mlp, None)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, w_in, w_in, w_out), out_specs=tokens)
    return mapped(x, combine, gate, up, down)


# ---------------------------------------------------------------- router logits out of a forward

_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("router_logits_sink", default=None)


def record(router_logits: Float[Array, "layers batch length experts"] | Sequence[jax.Array]) -> None:
    """Called by the trunk with every layer's router logits (stacked, or one array per layer): kept, stacked,
    only inside `forward_with_router_logits`; elsewhere (generation, training) nothing is computed."""
    sink = _SINK.get()
    if sink is not None:
        sink.append(jnp.stack(router_logits) if isinstance(router_logits, (list, tuple)) else router_logits)


def forward_with_router_logits(model: nnx.Module, *args: Any, **kwargs: Any) -> tuple[Any, jax.Array]:
    """`model(*args, **kwargs)` (any head on a mixture-of-experts trunk) and its router logits, float32
    [layers, batch, length, experts]. Call it where the model is called (inside the same jit or grad), as
    the model itself. A pipelined forward (stages > 1) does not collect them (not supported yet)."""
    sink: list = []
    token = _SINK.set(sink)
    try:
        out = model(*args, **kwargs)
    finally:
        _SINK.reset(token)
    if not sink:
        raise ValueError("this forward recorded no router logits: the model has no experts (num_experts=0) "
                         "or ran pipelined (router logits are not collected across pipeline stages)")
    return out, sink[-1]


# ---------------------------------------------------------------- the load-balancing loss


def _assignments(
    router_logits: Float[Array, "*lead tokens experts"], top_k: int
) -> tuple[Float[Array, "*lead tokens experts"], Float[Array, "*lead tokens experts"]]:
    """The softmax probabilities and how many of each token's top-k slots went to each expert (0 or 1)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, experts = jax.lax.top_k(probs, top_k)
    return probs, jnp.sum(jax.nn.one_hot(experts, probs.shape[-1], dtype=jnp.float32), axis=-2)


def _token_weights(router_logits: jax.Array, mask: Bool[Array, "batch length"] | None) -> jax.Array:
    """1 for every real token, broadcast against [layers, batch, length, 1]; 0 for padding."""
    if mask is None:
        return jnp.ones(router_logits.shape[:-1] + (1,), jnp.float32)
    m = jnp.asarray(mask, jnp.float32)[..., None]
    return jnp.broadcast_to(m, router_logits.shape[:-1] + (1,))


def load_balancing_loss(
    router_logits: Float[Array, "layers batch length experts"], top_k: int,
    mask: Bool[Array, "batch length"] | None = None,
) -> Float[Array, ""]:
    """Switch Transformer's auxiliary loss as transformers computes it (`load_balancing_loss_func`):
    num_experts * sum_i f_i * P_i, where over every layer's real tokens f_i is the mean number of top-k
    slots routed to expert i (the k experts of a softmax over all experts, whatever the family's router
    order) and P_i the mean softmax probability of expert i. Minimal (top_k) when routing is uniform."""
    probs, counts = _assignments(router_logits, top_k)
    w = _token_weights(router_logits, mask)
    total = jnp.sum(w)
    f = jnp.sum(counts * w, axis=tuple(range(counts.ndim - 1))) / total
    p = jnp.sum(probs * w, axis=tuple(range(probs.ndim - 1))) / total
    return probs.shape[-1] * jnp.sum(f * p)


def router_statistics(
    router_logits: Float[Array, "layers batch length experts"], top_k: int,
    mask: Bool[Array, "batch length"] | None = None,
) -> dict[str, jax.Array]:
    """Per layer over its real tokens: `load` [layers, experts], the fraction of the layer's token-to-expert
    assignments each expert received (each row sums to 1; uniform is 1 / num_experts), and `probability`
    [layers, experts], each expert's mean router probability."""
    probs, counts = _assignments(router_logits, top_k)
    w = _token_weights(router_logits, mask)
    reduce = tuple(range(1, counts.ndim - 1))  # the token axes (batch, length) after the layer axis
    tokens = jnp.sum(w, axis=reduce)
    return {"load": jnp.sum(counts * w, axis=reduce) / (top_k * tokens),
            "probability": jnp.sum(probs * w, axis=reduce) / tokens}
