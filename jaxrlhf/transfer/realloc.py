"""Move parameter pytrees between placements with no bytes through host.

`jax.device_put` to a sharding with different shard shapes copies the whole
array through host memory; across processes it is not
supported at all. Only a move between shardings with the same
number of devices and the same shard at every position is a pure
device-to-device copy. So every leaf moves in two steps:

(a) on the *source* devices, one jitted reshard (`out_shardings`, donating
    the source when its buffers can be reused) produces an intermediate whose
    per-device shards are exactly the target's shards. The intermediate mesh
    is the source devices, in the same order, reshaped to the target's block
    grid (replicated over what is left). When the source has fewer devices
    than the target has distinct blocks, the array is moved in *rounds*: each
    round reshards one rectangular region of blocks;
(b) the intermediate's shards, viewed as an array over the source devices
    that hold them (no copy), are `device_put` to a congruent sharding over
    the target devices: same device count, same shard per position, so the
    runtime copies device to device. Targets that replicate a block get one
    such copy per replica. When the source already has the target's shard
    shape (same layout on other devices), step (a) is skipped;
(c) the target array is assembled from the received shards (no copy) and the
    intermediates are dropped.

Leaves are processed in chunks of about `chunk_bytes`: step (a) of every leaf
is dispatched, then step (b) for the chunk, and the chunk is waited for
before the next starts, so peak extra memory stays near one chunk.

Two common moves skip all of that and are one asynchronous operation for the
whole tree (no wait; the caller synchronises where it needs the values):

- *same devices*, in the same order (a batch moving between two layouts of one
  group, the hybrid engine's training -> generation copy): one jitted copy of
  every leaf with the target shardings; XLA's collectives do the reshard on the
  devices that hold the data;
- *other devices, as many*, in one process (rollout data crossing between the
  groups of an interleaved plan, a shadow copy refreshed on its own devices):
  one jitted reshard of every leaf onto the target's layout over the source
  devices (step a), then one batched `device_put` of all of them to the
  target (step b, congruent: device-to-device copies).

Across processes (multi-host) step (b) follows what JAX 0.10 needs to be
correct: one `device_put` per array (a list of arrays moving between
different devices across processes hung or swapped data), each holding only
shards that go from one process to one process (a put whose positions mix
local and cross-process copies is split into per-(source process, target
process) parts, carried as a stack of the shards along the first axis; a
part that stays inside one process is put by that process alone: the others
may not call it), and a barrier after a chunk that crossed processes, so the
sender cannot run ahead into the next collective while the receiver still
waits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxrlhf.transfer.processes import barrier

DEFAULT_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass
class ReallocStats:
    """What one reallocation did. `bytes` counts each leaf once (its global size);
    `bytes_copied` counts shard bytes that crossed from one device to another."""

    bytes: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    leaves: int = 0
    chunks: int = 0
    rounds: int = 0

    def __iadd__(self, other: "ReallocStats") -> "ReallocStats":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# ---- helpers ----------------------------------------------------------------------------
def _device_order(sharding: Sharding) -> list[jax.Device]:
    """Devices of a sharding in its flat order (what jit compares)."""
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    if isinstance(sharding, SingleDeviceSharding):
        return list(sharding.device_set)
    raise TypeError(
        f"cannot reallocate an array with {type(sharding).__name__}; place it with a NamedSharding first"
    )


def _auto_mesh(devices: Sequence[jax.Device], shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(devices, dtype=object).reshape(shape), names, axis_types=(AxisType.Auto,) * len(names))


def _block_grid(shape: tuple[int, ...], target: NamedSharding) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shard shape, number of blocks per dimension) of `target` for an array of `shape`."""
    shard = tuple(target.shard_shape(shape))
    return shard, tuple(s // b if b else 1 for s, b in zip(shape, shard))


def _block_of(index: tuple[slice, ...], shard: tuple[int, ...]) -> tuple[int, ...]:
    return tuple((sl.start or 0) // b if b else 0 for sl, b in zip(index, shard))


@functools.lru_cache(maxsize=None)
def _reshard_fn(
    region: tuple[tuple[int, int], ...] | None, mid: NamedSharding | None, out: NamedSharding, donate: bool
):
    """Jitted `x[region]` (or a copy of x) laid out as `out` on the source devices.

    `mid`, when given, is a fully partitioned stop on the way: the target's blocks
    with the replica axis still splitting the dimension the source splits. XLA then
    lowers the reshard as all-to-all + all-gather instead of gathering the whole
    array on every device and slicing it.
    """

    def f(x):
        if region is not None:
            x = x[tuple(slice(a, b) for a, b in region)]
        if mid is not None:
            x = jax.lax.with_sharding_constraint(x, mid)
        return jnp.copy(x)  # a fresh buffer: the result never aliases a source that is kept

    return jax.jit(f, out_shardings=out, donate_argnums=(0,) if donate else ())


def _mid_sharding(out: NamedSharding, shape: tuple[int, ...], src_grid: tuple[int, ...]) -> NamedSharding | None:
    """`out`'s blocks, further split over the mesh axes `out` replicates over, along the
    dimension the source splits most (when it divides); None when there is nothing to add."""
    mesh = out.mesh
    spec = list(out.spec) + [None] * (len(shape) - len(out.spec))
    entries = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    used = {a for e in entries for a in e}
    free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    if not free:
        return None
    extra = math.prod(mesh.shape[a] for a in free)
    out_shard = out.shard_shape(shape)
    dims = [k for k in range(len(shape)) if src_grid[k] > 1 and out_shard[k] % extra == 0]
    if not dims:
        return None
    k = max(dims, key=lambda i: src_grid[i])
    entries[k] = entries[k] + free
    return NamedSharding(mesh, PartitionSpec(*(e or None for e in entries)))


@functools.lru_cache(maxsize=None)
def _copy_fn(out: NamedSharding, donate: bool):
    return jax.jit(jnp.copy, out_shardings=out, donate_argnums=(0,) if donate else ())


def _serialised(y: jax.Array, src: list[jax.Device]) -> jax.Array:
    """On CPU, wait for a multi-device reshard before the next: XLA:CPU runs the collectives
    of all programs in flight on one shared thread pool, and several multi-device
    programs at once can starve each other's rendezvous."""
    if len(src) > 1 and src[0].platform == "cpu":
        y.block_until_ready()
    return y


# ---- one leaf ---------------------------------------------------------------------------
@dataclasses.dataclass
class _LeafMove:
    """The dispatched first step of one leaf and the device_put (step b) still to issue."""

    views: list[jax.Array] = dataclasses.field(default_factory=list)
    dests: list[NamedSharding] = dataclasses.field(default_factory=list)
    may_alias: bool = True
    shards: list[jax.Array] | None = None  # final shards when nothing needs a device_put
    delete: jax.Array | None = None  # source to delete once the chunk is done


def _views(
    blocks: list[tuple[int, ...]],
    wanted: dict[tuple[int, ...], list[jax.Device]],
    holders: dict[tuple[int, ...], list[jax.Device]],
    local: dict[jax.Device, jax.Array],
    grid: tuple[int, ...],
    region_shape: tuple[int, ...],
    dtype: Any,
    memory_kind: str | None,
    shard_bytes: int,
    move: _LeafMove,
    stats: ReallocStats,
) -> None:
    """Congruent (view, destination) pairs: one per replica of the target's blocks."""
    names = tuple(f"b{i}" for i in range(len(grid)))
    spec = PartitionSpec(*names)
    for j in range(len(wanted[blocks[0]])):
        s_devs, t_devs = [], []
        for blk in blocks:
            t_dev = wanted[blk][j]
            cands = holders[blk]
            s_dev = t_dev if t_dev in cands else cands[j % len(cands)]
            s_devs.append(s_dev)
            t_devs.append(t_dev)
            stats.bytes_copied += shard_bytes if s_dev != t_dev else 0
        # Same grid, same spec, same block at every position: the runtime copies device to device.
        view = NamedSharding(_auto_mesh(s_devs, grid + (1,), names + ("rep",)), spec)
        dest = NamedSharding(_auto_mesh(t_devs, grid + (1,), names + ("rep",)), spec, memory_kind=memory_kind)
        pieces = [local[d] for d in s_devs if d in local]
        move.views.append(jax.make_array_from_single_device_arrays(region_shape, view, pieces, dtype=dtype))
        move.dests.append(dest)


def _start_leaf(x: jax.Array, target: NamedSharding, free_source: bool) -> tuple[_LeafMove, ReallocStats]:
    """Step (a) for one leaf, dispatched; returns what step (b) must copy."""
    stats = ReallocStats(bytes=x.nbytes, leaves=1)
    shape = tuple(x.shape)
    same_memory = x.sharding.memory_kind == target.memory_kind
    if same_memory and x.sharding.is_equivalent_to(target, x.ndim):
        if free_source:  # hand the buffers over
            return _LeafMove(shards=[s.data for s in x.addressable_shards]), stats
        y = _copy_fn(target, False)(x)
        return _LeafMove(shards=[s.data for s in y.addressable_shards]), stats

    src = _device_order(x.sharding)
    shard, grid = _block_grid(shape, target)
    shard_bytes = math.prod(shard) * x.dtype.itemsize
    wanted: dict[tuple[int, ...], list[jax.Device]] = {}
    for d, idx in target.devices_indices_map(shape).items():
        wanted.setdefault(_block_of(idx, shard), []).append(d)
    order = {d: i for i, d in enumerate(_device_order(target))}
    for devs in wanted.values():
        devs.sort(key=order.__getitem__)
    all_blocks = list(itertools.product(*(range(t) for t in grid)))
    src_shard_shape = tuple(x.sharding.shard_shape(shape))

    if same_memory and src_shard_shape == shard:
        # The source already holds every target block as a whole shard: skip step (a).
        holders: dict[tuple[int, ...], list[jax.Device]] = {}
        for d, idx in x.sharding.devices_indices_map(shape).items():
            holders.setdefault(_block_of(idx, shard), []).append(d)
        local = {s.device: s.data for s in x.addressable_shards}
        move = _LeafMove(may_alias=False, delete=x if free_source else None)
        _views(all_blocks, wanted, holders, local, grid, shape, x.dtype, target.memory_kind, shard_bytes, move, stats)
        return move, stats

    src_grid = tuple(n // b if b else 1 for n, b in zip(shape, src_shard_shape))
    tgt = _device_order(target)
    if len(src) == len(tgt):
        # Same device count: the intermediate is the target's layout over the source devices,
        # so position i of the intermediate holds what position i of the target needs.
        if src == tgt and same_memory:
            inter = target
        else:
            tm = target.mesh
            mesh = Mesh(np.array(src, dtype=object).reshape(tm.devices.shape), tm.axis_names, axis_types=tm.axis_types)
            inter = NamedSharding(mesh, target.spec)
        donate = free_source and src_shard_shape == shard
        y = _reshard_fn(None, _mid_sharding(inter, shape, src_grid), inter, donate)
        y = _serialised(y(x), src)
        stats.rounds += 1
        if inter is target:
            move = _LeafMove(shards=[s.data for s in y.addressable_shards])
        else:
            move = _LeafMove(views=[y], dests=[target])
            stats.bytes_copied += shard_bytes * sum(a != b for a, b in zip(src, tgt))
        if free_source and not x.is_deleted():
            move.delete = x
        return move, stats

    # Otherwise reshard to the target's block grid over the source devices, in rounds of
    # as many blocks as the source devices can hold at once.
    sub, left = [], len(src)
    for t in grid:
        g = math.gcd(t, left)
        sub.append(g)
        left //= g
    sub, rep = tuple(sub), left
    names = tuple(f"b{i}" for i in range(len(shape)))
    inter_mesh = _auto_mesh(src, sub + (rep,), names + ("rep",))
    inter = NamedSharding(inter_mesh, PartitionSpec(*names))
    region_shape = tuple(g * b for g, b in zip(sub, shard))
    mid = _mid_sharding(inter, region_shape, src_grid)
    rounds = list(itertools.product(*(range(t // g) for t, g in zip(grid, sub))))
    move = _LeafMove()
    for offset in rounds:
        region = None
        if len(rounds) > 1:
            region = tuple((o * g * b, (o + 1) * g * b) for o, g, b in zip(offset, sub, shard))
        # Donate when the source buffers can become the intermediate's (same shard shape).
        donate = free_source and region is None and src_shard_shape == tuple(inter.shard_shape(shape))
        y = _serialised(_reshard_fn(region, mid, inter, donate)(x), src)
        stats.rounds += 1
        holders = {}
        for pos, d in zip(itertools.product(*(range(g) for g in sub), range(rep)), src):
            holders.setdefault(tuple(o * g + p for o, g, p in zip(offset, sub, pos[:-1])), []).append(d)
        blocks = list(itertools.product(*(range(o * g, (o + 1) * g) for o, g in zip(offset, sub))))
        local = {s.device: s.data for s in y.addressable_shards}
        _views(blocks, wanted, holders, local, sub, region_shape, x.dtype, target.memory_kind, shard_bytes, move,
               stats)
    if free_source and not x.is_deleted():
        move.delete = x  # y never aliases x unless donated, so deleting it later is safe
    return move, stats


def _put(view: jax.Array, dest: NamedSharding, may_alias: bool) -> tuple[list[jax.Array], bool]:
    """Step (b) for one congruent (view, dest) pair: the received shards this process holds, and whether
    any shard crossed processes. One device_put when every position goes from one process to one
    process; otherwise one per (source process, target process) part, each carrying its positions'
    shards stacked along the first axis (scalars one position at a time)."""
    srcs, tgts = list(view.sharding.mesh.devices.flat), list(dest.mesh.devices.flat)
    pairs = {(a.process_index, b.process_index) for a, b in zip(srcs, tgts)}
    crossed = any(a != b for a, b in pairs)
    if len(pairs) == 1:
        (a, b), = pairs
        if a == b != jax.process_index():  # a copy inside another process: JAX refuses it here, and it is no
            return [], crossed            # collective, so that process does it alone
        return [s.data for s in jax.device_put(view, dest, may_alias=may_alias).addressable_shards], crossed
    local = {s.device: s.data for s in view.addressable_shards}
    shard = tuple(view.sharding.shard_shape(view.shape))
    parts: dict[Any, list[int]] = {}
    for k, (a, b) in enumerate(zip(srcs, tgts)):
        parts.setdefault((a.process_index, b.process_index) if shard else k, []).append(k)
    received = []
    for positions in parts.values():
        n, owner = len(positions), srcs[positions[0]].process_index
        if owner == tgts[positions[0]].process_index != jax.process_index():
            continue  # a copy inside another process (see above)
        carrier = (n * shard[0],) + shard[1:] if shard else ()
        spec = PartitionSpec("c") if shard else PartitionSpec()

        def sharding(devices, memory_kind=None):
            return NamedSharding(_auto_mesh(devices, (n,), ("c",)), spec, memory_kind=memory_kind)

        pieces = [local[srcs[k]] for k in positions if srcs[k] in local]
        stack = jax.make_array_from_single_device_arrays(carrier, sharding([srcs[k] for k in positions]), pieces,
                                                         dtype=view.dtype)
        moved = jax.device_put(stack, sharding([tgts[k] for k in positions], dest.memory_kind), may_alias=may_alias)
        received += [s.data for s in moved.addressable_shards]
    return received, crossed


# ---- whole-tree moves in one operation ---------------------------------------------------
def _devices_key(sharding: Sharding) -> tuple[jax.Device, ...]:
    return tuple(_device_order(sharding))


@functools.lru_cache(maxsize=256)
def _copy_all_fn(outs: tuple[NamedSharding, ...], mids: tuple[NamedSharding | None, ...]):
    """One program: a fresh copy of every argument laid out as `outs` (on the arguments' devices), each
    through its `mid` stop when it has one (see `_reshard_fn`)."""

    def f(*xs):
        return tuple(jnp.copy(x if mid is None else jax.lax.with_sharding_constraint(x, mid))
                     for x, mid in zip(xs, mids))

    return jax.jit(f, out_shardings=outs)


def _copy_all(leaves: list[jax.Array], outs: list[NamedSharding]) -> tuple[jax.Array, ...]:
    mids = []
    for x, out in zip(leaves, outs):
        shape = tuple(x.shape)
        src_shard = tuple(x.sharding.shard_shape(shape))
        src_grid = tuple(n // b if b else 1 for n, b in zip(shape, src_shard))
        mids.append(_mid_sharding(out, shape, src_grid))
    return _copy_all_fn(tuple(outs), tuple(mids))(*leaves)


def _same_devices(leaves: list[jax.Array], targets: list[NamedSharding]) -> bool:
    keys = {_devices_key(x.sharding) for x in leaves} | {_devices_key(t) for t in targets}
    kinds = {x.sharding.memory_kind for x in leaves} | {t.memory_kind for t in targets}
    return len(keys) == 1 and len(kinds) == 1


def _congruent_mesh_target(leaves: list[jax.Array], targets: list[NamedSharding]) -> tuple | None:
    """(source devices, target mesh shape) when every leaf comes from the same ordered devices and goes
    to meshes of one shape over as many other devices, in one process with one memory kind; else None."""
    if jax.process_count() > 1:
        return None
    srcs = {_devices_key(x.sharding) for x in leaves}
    shapes = {t.mesh.devices.shape for t in targets}
    kinds = {x.sharding.memory_kind for x in leaves} | {t.memory_kind for t in targets}
    if len(srcs) != 1 or len(shapes) != 1 or len(kinds) != 1:
        return None
    (src,), (shape,) = srcs, shapes
    if len(src) != math.prod(shape):
        return None
    return src, shape


def _move_whole_tree(
    leaves: list[jax.Array], targets: list[NamedSharding], chunk_bytes: int | None, stats: ReallocStats
) -> list[jax.Array] | None:
    """The two one-operation moves of the module docstring, dispatched without waiting; None when neither
    applies."""
    if _same_devices(leaves, targets):
        stats.rounds, stats.chunks = 1, 1
        return list(_copy_all(leaves, targets))
    congruent = _congruent_mesh_target(leaves, targets)
    if congruent is None:
        return None
    src, shape = congruent
    tgt = _devices_key(targets[0])
    inters = []
    for x, t in zip(leaves, targets):
        mesh = Mesh(np.array(src, dtype=object).reshape(shape), t.mesh.axis_names, axis_types=t.mesh.axis_types)
        inters.append(NamedSharding(mesh, t.spec, memory_kind=t.memory_kind))
        shard_bytes = math.prod(t.shard_shape(tuple(x.shape))) * x.dtype.itemsize
        stats.bytes_copied += shard_bytes * sum(a != b for a, b in zip(src, tgt))
    # The staged copy occupies the source devices until its device_put is done: in chunks of `chunk_bytes`,
    # each waited for before the next is staged (a model within one chunk moves without any wait).
    out: list[jax.Array] = []
    start = 0
    while start < len(leaves):
        end, size = start, 0
        while end < len(leaves) and (end == start or chunk_bytes is None or size + leaves[end].nbytes <= chunk_bytes):
            size += leaves[end].nbytes
            end += 1
        if out:
            jax.block_until_ready(out[-1])
        out += jax.device_put(list(_copy_all(leaves[start:end], inters[start:end])), list(targets[start:end]))
        stats.chunks += 1
        stats.rounds += 1
        start = end
    return out


# ---- public API -------------------------------------------------------------------------
def reallocate(
    tree: Any,
    target: Any,
    *,
    free_source: bool = False,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    block: bool = True,
) -> tuple[Any, ReallocStats]:
    """Move every array of `tree` to the matching NamedSharding of `target`, device to device.

    `target` has the structure of `tree` (e.g. from `layout.param_shardings`) or
    is one NamedSharding for all leaves. With `free_source` the source arrays are
    deleted (donated where possible; when source and target are identical the
    buffers are handed over instead), so a move never holds two full copies.
    Without it the result never shares buffers with the source. With `block`
    (the default) it returns when the result is ready; without, a move that is
    one operation (module docstring) returns as soon as it is dispatched, the
    others still wait between chunks. `stats.seconds` is the wall time spent here.
    """
    t0 = time.perf_counter()
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if isinstance(target, Sharding):
        targets = [target] * len(leaves)
    else:
        targets = jax.tree_util.tree_leaves(target, is_leaf=lambda s: isinstance(s, Sharding))
    if len(targets) != len(leaves):
        raise ValueError(f"target has {len(targets)} shardings for {len(leaves)} arrays; build it from the same tree")
    for i, (x, t) in enumerate(zip(leaves, targets)):
        if not isinstance(x, jax.Array):
            raise TypeError(f"leaf {i} is {type(x).__name__}, not a jax.Array; place the tree on devices first")
        if not isinstance(t, NamedSharding):
            raise TypeError(f"target {i} is {type(t).__name__}; reallocation targets must be NamedShardings")

    stats = ReallocStats()
    if leaves:
        whole = _move_whole_tree(leaves, targets, chunk_bytes, stats)
        if whole is not None:
            if block or free_source:
                jax.block_until_ready(whole)
            if free_source:
                for x in leaves:
                    if not x.is_deleted():
                        x.delete()
            stats.bytes = tree_bytes(leaves)
            stats.leaves = len(whole)
            stats.seconds = time.perf_counter() - t0
            return jax.tree_util.tree_unflatten(treedef, whole), stats
    out: list[jax.Array | None] = [None] * len(leaves)
    pending: list[tuple[int, _LeafMove]] = []
    pending_bytes = 0

    def flush() -> None:
        """Step (b) for the chunk, one device_put per view; then assemble, wait, free."""
        nonlocal pending, pending_bytes
        if not pending:
            return
        crossed = False
        for i, m in pending:
            shards = m.shards
            if shards is None:
                shards = []
                for view, dest in zip(m.views, m.dests):
                    received, cross = _put(view, dest, m.may_alias)
                    shards += received
                    crossed |= cross
            out[i] = jax.make_array_from_single_device_arrays(leaves[i].shape, targets[i], shards,
                                                              dtype=leaves[i].dtype)
        jax.block_until_ready([out[i] for i, _ in pending])
        if crossed:  # the same on every process: it depends only on the device assignment
            barrier("reallocate")
        for _, m in pending:
            if m.delete is not None and not m.delete.is_deleted():
                m.delete.delete()
        stats.chunks += 1
        pending, pending_bytes = [], 0

    for i, (x, t) in enumerate(zip(leaves, targets)):
        move, s = _start_leaf(x, t, free_source)
        stats += s
        pending.append((i, move))
        pending_bytes += s.bytes
        if chunk_bytes is not None and pending_bytes >= chunk_bytes:
            flush()
    flush()
    stats.leaves = len(out)
    stats.seconds = time.perf_counter() - t0
    return jax.tree_util.tree_unflatten(treedef, out), stats


def move_where_needed(
    tree: Any, target: Any, *, free_source: bool = False, block: bool = True
) -> tuple[Any, ReallocStats]:
    """`reallocate` only the leaves not already laid out as `target` says (others are returned as they
    are, sharing buffers). Host values (numpy, Python scalars, uncommitted arrays) are put on the
    target directly: they have no device layout to move from."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets = jax.tree_util.tree_leaves(target, is_leaf=lambda s: isinstance(s, Sharding))
    if len(targets) != len(leaves):
        raise ValueError(f"target has {len(targets)} shardings for {len(leaves)} arrays; build it from the same tree")
    todo = []
    for i, (x, t) in enumerate(zip(leaves, targets)):
        if not isinstance(x, jax.Array) or not x.committed:
            leaves[i] = put_host(x, t)
        elif not (x.sharding.is_equivalent_to(t, x.ndim) and x.sharding.memory_kind == t.memory_kind):
            todo.append(i)
    stats = ReallocStats()
    if todo:
        moved, stats = reallocate([leaves[i] for i in todo], [targets[i] for i in todo], free_source=free_source,
                                  block=block)
        for i, x in zip(todo, moved):
            leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves), stats


def put_host(x: Any, sharding: Sharding) -> jax.Array:
    """A host value (numpy, Python scalar, uncommitted array) placed on `sharding`. Every process passes
    the same global value; each builds only the shards of its own devices (a plain device_put onto
    devices of several processes is refused in multi-process runs)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put_host(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    if sharding.is_fully_addressable:
        return jax.device_put(x if isinstance(x, jax.Array) else np.asarray(x), sharding)
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index], dtype=value.dtype)


def _move_memory(tree: Any, memory_kind: str, free_source: bool) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    targets = [x.sharding.with_memory_kind(memory_kind) for x in leaves]
    moved = jax.device_put(leaves, targets)
    if free_source:
        jax.block_until_ready(moved)
        for x in leaves:
            if not x.is_deleted():
                x.delete()
    return jax.tree_util.tree_unflatten(treedef, moved)


def host_memory_kind(device: jax.Device) -> str | None:
    """Where offloaded arrays live on `device`'s platform: pinned host memory (fast DMA) where the
    platform has it, plain host memory otherwise, None where the platform has no host memory space."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def is_offloaded(tree: Any) -> bool:
    """Whether the arrays of `tree` live in host memory (see `offload`)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return bool(leaves) and all(x.sharding.memory_kind not in (None, "device") for x in leaves)


def offload(tree: Any, *, free_source: bool = True) -> Any:
    """Move an idle frozen model to host memory (pinned where the platform has it), same sharding,
    freeing device memory. A device-to-host DMA per shard: no trip through numpy."""
    leaves = jax.tree_util.tree_leaves(tree)
    kind = host_memory_kind(next(iter(leaves[0].sharding.device_set))) if leaves else None
    if kind is None:
        return tree
    return _move_memory(tree, kind, free_source)


def reload(tree: Any, *, free_source: bool = True) -> Any:
    """Bring an offloaded tree back to device memory, same sharding."""
    return _move_memory(tree, "device", free_source)


def tree_bytes(tree: Any) -> int:
    """Global bytes of the arrays of `tree` (each leaf counted once)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
