"""`transfer.realloc` on small hand-made arrays over the 8 simulated CPU devices: every kind of move
(same devices, as many other devices, fewer or more devices), each value exact and each result laid
out as its target says, with no byte through host; `move_where_needed`, `put_host`, offload.

tests/placement/test_realloc.py moves a whole model between plan layouts (slow tier); these are
the fast, hand-checked cases of the module's own paths."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.transfer.realloc import (
    ReallocStats,
    host_memory_kind,
    is_offloaded,
    move_where_needed,
    offload,
    put_host,
    reallocate,
    reload,
    tree_bytes,
)


@contextlib.contextmanager
def no_host_transfers():
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        yield


def sharding(first: int, shape: tuple[int, ...], names: tuple[str, ...], spec: P) -> NamedSharding:
    """`spec` over a mesh of `shape` on the consecutive devices from `first`."""
    n = int(np.prod(shape))
    devs = np.array(jax.devices()[first:first + n], dtype=object).reshape(shape)
    return NamedSharding(Mesh(devs, names), spec)


X = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) * 0.5 - 3.25  # 192 bytes
I = np.arange(16, dtype=np.int32).reshape(4, 4) * -7  # 64 bytes
B = (np.arange(8, dtype=np.float32) / 3).astype(jnp.bfloat16)  # 16 bytes, not exactly float32


def tree_on(s: NamedSharding, s_vec: NamedSharding):
    return {"x": jax.device_put(X, s), "i": jax.device_put(I, s), "b": jax.device_put(B, s_vec)}


def check(out, want, targets) -> None:
    for name in want:
        assert out[name].sharding == targets[name], name
        assert out[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(np.asarray(out[name]), want[name])  # exact, bit for bit


WANT = {"x": X, "i": I, "b": B}


def shards_of(a: jax.Array) -> dict[int, np.ndarray]:
    return {s.device.id: np.asarray(s.data) for s in a.addressable_shards}


def test_same_devices_other_layout_is_one_program():
    """Rows over 4 devices -> columns over the same 4: one jitted copy of every leaf."""
    src = tree_on(sharding(0, (4,), ("a",), P("a")), sharding(0, (4,), ("a",), P("a")))
    cols = sharding(0, (2, 2), ("p", "q"), P(None, ("p", "q")))
    t = {"x": sharding(0, (2, 2), ("p", "q"), P(None, "p")), "i": cols, "b": sharding(0, (2, 2), ("p", "q"), P("q"))}
    with no_host_transfers():
        out, stats = reallocate(src, t)
    check(out, WANT, t)
    assert (stats.rounds, stats.chunks, stats.leaves, stats.bytes) == (1, 1, 3, 192 + 64 + 16)
    # x's columns split over p (2 ways) and replicated over q: devices 0,1 hold columns 0-2, devices 2,3 3-5
    got = shards_of(out["x"])
    for d in (0, 1):
        np.testing.assert_array_equal(got[d], X[:, :3])
    for d in (2, 3):
        np.testing.assert_array_equal(got[d], X[:, 3:])
    assert not any(a.is_deleted() for a in src.values())  # the source is kept without free_source


def test_as_many_other_devices_copies_each_shard_once():
    """4 devices -> the other 4: reshard on the source, then one device-to-device copy per position."""
    src = tree_on(sharding(0, (4,), ("a",), P("a")), sharding(0, (4,), ("a",), P("a")))
    t = {"x": sharding(4, (2, 2), ("p", "q"), P("q", "p")), "i": sharding(4, (4,), ("a",), P(None, "a")),
         "b": sharding(4, (4,), ("a",), P())}
    with no_host_transfers():
        out, stats = reallocate(src, t)
    check(out, WANT, t)
    # every position changes device; per device: x 192/4, i 64/4, b replicated 16
    assert stats.bytes_copied == 4 * (48 + 16 + 16)
    assert {d.id for d in out["x"].sharding.device_set} == {4, 5, 6, 7}
    got = shards_of(out["x"])  # mesh [[4, 5], [6, 7]]: rows by q, columns by p
    np.testing.assert_array_equal(got[4], X[:4, :3])
    np.testing.assert_array_equal(got[5], X[4:, :3])
    np.testing.assert_array_equal(got[6], X[:4, 3:])
    np.testing.assert_array_equal(got[7], X[4:, 3:])


@pytest.mark.parametrize("src_first, src_n, tgt_first, tgt_n", [
    (0, 2, 4, 4),  # more target blocks than source devices: moved in rounds
    (0, 4, 6, 2),  # fewer devices
    (2, 1, 0, 8),  # one device to all eight, overlapping
])
def test_to_another_device_count(src_first, src_n, tgt_first, tgt_n):
    src_s = sharding(src_first, (src_n,), ("a",), P("a"))
    src = tree_on(src_s, src_s)
    t_rows = sharding(tgt_first, (tgt_n,), ("a",), P("a"))
    t = {"x": t_rows, "i": sharding(tgt_first, (tgt_n,), ("a",), P()), "b": t_rows}
    with no_host_transfers():
        out, stats = reallocate(src, t)
    check(out, WANT, t)
    if tgt_n > src_n:
        assert stats.rounds >= tgt_n // src_n  # each source device holds one target block per round
    got = shards_of(out["x"])
    rows = 8 // tgt_n
    for k in range(tgt_n):
        np.testing.assert_array_equal(got[tgt_first + k], X[k * rows:(k + 1) * rows])
    for shard in out["i"].addressable_shards:  # replicated: the whole array on every target device
        np.testing.assert_array_equal(np.asarray(shard.data), I)


@pytest.mark.parametrize("tgt_first", [0, 4])  # same devices (buffers handed over) and other devices
def test_free_source_deletes_the_source(tgt_first):
    s = sharding(0, (4,), ("a",), P("a"))
    src = tree_on(s, s)
    t = {k: sharding(tgt_first, (4,), ("a",), P("a")) for k in WANT}
    with no_host_transfers():
        out, _ = reallocate(src, t, free_source=True, chunk_bytes=64)
    assert all(a.is_deleted() for a in src.values())
    check(out, WANT, t)


def test_one_target_sharding_for_every_leaf_and_unblocked_moves():
    s = sharding(0, (2,), ("a",), P())
    src = tree_on(s, s)
    target = sharding(4, (4,), ("a",), P())
    out, stats = reallocate(src, target, block=False)
    jax.block_until_ready(out)
    check(out, WANT, dict.fromkeys(WANT, target))
    assert stats.leaves == 3 and stats.seconds >= 0


def test_move_where_needed_moves_only_what_is_elsewhere():
    here = sharding(0, (4,), ("a",), P("a"))
    there = sharding(4, (4,), ("a",), P("a"))
    placed = jax.device_put(X, here)
    elsewhere = jax.device_put(I, sharding(0, (2,), ("a",), P("a")))
    tree = {"placed": placed, "elsewhere": elsewhere, "host": B, "scalar": 2.5}
    targets = {"placed": here, "elsewhere": there, "host": there, "scalar": sharding(4, (4,), ("a",), P())}
    out, stats = move_where_needed(tree, targets)
    assert out["placed"] is placed  # already laid out as asked: returned as it is, same buffers
    assert stats.leaves == 1 and stats.bytes == 64  # only `elsewhere` was reallocated
    check({k: out[k] for k in ("elsewhere", "host")}, {"elsewhere": I, "host": B}, targets)
    assert out["scalar"].sharding == targets["scalar"] and float(out["scalar"]) == 2.5


def test_put_host_places_a_host_value_exactly():
    t = sharding(2, (2, 2), ("p", "q"), P("p", "q"))
    a = put_host(X, t)
    assert a.sharding == t
    np.testing.assert_array_equal(np.asarray(a), X)
    np.testing.assert_array_equal(shards_of(a)[5], X[4:, 3:])  # mesh [[2, 3], [4, 5]]
    key = put_host(jax.random.key(3), sharding(0, (2,), ("a",), P()))
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(key)), np.asarray(jax.random.key_data(jax.random.key(3))))


def test_offload_and_reload_keep_values_and_layout():
    s = sharding(0, (2, 2), ("p", "q"), P("p", "q"))
    src = {"x": jax.device_put(X, s), "i": jax.device_put(I, s)}
    kind = host_memory_kind(jax.devices()[0])
    assert kind == "pinned_host"  # XLA:CPU has pinned host memory
    assert not is_offloaded(src) and not is_offloaded({})
    host = offload(src)
    assert is_offloaded(host) and all(a.is_deleted() for a in src.values())
    for k, want in (("x", X), ("i", I)):
        assert host[k].sharding == s.with_memory_kind(kind)
        np.testing.assert_array_equal(np.asarray(host[k]), want)
    back = reload(host, free_source=False)
    assert not is_offloaded(back) and not any(a.is_deleted() for a in host.values())
    check(back, {"x": X, "i": I}, {"x": s.with_memory_kind("device"), "i": s.with_memory_kind("device")})


def test_tree_bytes_and_stats():
    assert tree_bytes({"x": jnp.asarray(X), "l": [jnp.asarray(I), jnp.asarray(B)]}) == 192 + 64 + 16
    total = ReallocStats(bytes=10, bytes_copied=4, seconds=0.5, leaves=1, chunks=1, rounds=2)
    total += ReallocStats(bytes=5, bytes_copied=1, seconds=0.25, leaves=2, chunks=1, rounds=1)
    assert total.to_dict() == {"bytes": 15, "bytes_copied": 5, "seconds": 0.75, "leaves": 3, "chunks": 2, "rounds": 3}
