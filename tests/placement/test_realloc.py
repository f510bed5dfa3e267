"""Reallocation between placements: bit-identical, no host bytes, nothing leaked."""

import contextlib
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model
from jaxrlhf.placement.layout import make_mesh, param_shardings
from jaxrlhf.planner.plan import DeviceGroup, Layout
from jaxrlhf.transfer.realloc import offload, reallocate, reload, tree_bytes


@contextlib.contextmanager
def no_host_transfers():
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        yield


@pytest.fixture(scope="module")
def host_params():
    """Tiny model parameters (nnx State with logical axes) as host numpy values, plus a scalar."""
    state = nnx.state(build_model(preset("tiny-qwen2"), seed=3), nnx.Param)
    return jax.tree_util.tree_map(np.asarray, state)


def place(tree, group: DeviceGroup, layout: Layout):
    mesh = make_mesh(group, layout)
    return jax.device_put(tree, param_shardings(tree, mesh)), param_shardings(tree, mesh)


def shardings_on(tree, group, layout):
    return param_shardings(tree, make_mesh(group, layout))


G = DeviceGroup
MATRIX = {
    "fsdp8 -> tensor2 x data4, same devices": (G("a", 0, 8), Layout(fsdp=8), G("b", 0, 8), Layout(data=4, tensor=2)),
    "fsdp4 -> tensor2 x data2, disjoint": (G("a", 0, 4), Layout(fsdp=4), G("b", 4, 4), Layout(data=2, tensor=2)),
    "tensor4 -> fsdp2, overlapping": (G("a", 0, 4), Layout(tensor=4), G("b", 2, 2), Layout(fsdp=2)),
    "4 -> 2 devices, disjoint": (G("a", 4, 4), Layout(fsdp=2, tensor=2), G("b", 0, 2), Layout(tensor=2)),
    "2 -> 4 devices, more blocks than sources": (G("a", 0, 2), Layout(fsdp=2), G("b", 4, 4), Layout(fsdp=4)),
    "2 -> 8, fsdp4 x tensor2": (G("a", 6, 2), Layout(tensor=2), G("b", 0, 8), Layout(fsdp=4, tensor=2)),
    "1 -> 8, data parallel": (G("a", 3, 1), Layout(), G("b", 0, 8), Layout(data=8)),
    "identical": (G("a", 0, 4), Layout(fsdp=4), G("b", 0, 4), Layout(fsdp=4)),
    # Pipeline stages split the stacked layers only: staged <-> unstaged moves them between stage blocks.
    "stage2 x data2 x fsdp2 -> tensor2 x data4, same devices": (
        G("a", 0, 8), Layout(stage=2, data=2, fsdp=2), G("b", 0, 8), Layout(data=4, tensor=2)),
    "fsdp4 -> stage2 x tensor2, disjoint": (G("a", 0, 4), Layout(fsdp=4), G("b", 4, 4), Layout(stage=2, tensor=2)),
    "stage2 x fsdp4 -> tensor2, 8 -> 2 devices": (G("a", 0, 8), Layout(stage=2, fsdp=4), G("b", 2, 2), Layout(tensor=2)),
}


def assert_same(result, expected_host, target):
    for got, want, sh in zip(
        jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(expected_host), jax.tree_util.tree_leaves(target)
    ):
        assert got.sharding == sh
        np.testing.assert_array_equal(np.asarray(got), want)  # bit-identical


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MATRIX))
def test_reallocation_matrix_bit_identical_without_host(case, host_params):
    ga, la, gb, lb = MATRIX[case]
    src, _ = place(host_params, ga, la)
    target = shardings_on(host_params, gb, lb)
    jax.block_until_ready(src)
    with no_host_transfers():
        out, stats = reallocate(src, target)
    assert stats.bytes == tree_bytes(src) and stats.leaves == len(jax.tree_util.tree_leaves(src))
    if case == "identical":
        assert stats.bytes_copied == 0
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(src))
    assert_same(out, host_params, target)
    assert_same(src, host_params, shardings_on(host_params, ga, la))  # source untouched
    if "stage" in case:  # the staged side really splits the stacked layers over its stages
        staged = src if la.stage > 1 else out
        assert staged["model"]["layers"]["mlp"]["up"].sharding.spec[0] == "stage"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp4 -> tensor2 x data2, disjoint", "2 -> 4 devices, more blocks than sources",
                                  "identical"])
def test_free_source_deletes_or_hands_over(case, host_params):
    ga, la, gb, lb = MATRIX[case]
    src, _ = place(host_params, ga, la)
    target = shardings_on(host_params, gb, lb)
    with no_host_transfers():
        out, _ = reallocate(src, target, free_source=True, chunk_bytes=4096)
    if case != "identical":
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(src))
    assert_same(out, host_params, target)


@pytest.mark.slow
def test_reallocate_and_drop_leaves_nothing_behind(host_params):
    ga, la, gb, lb = MATRIX["fsdp4 -> tensor2 x data2, disjoint"]
    src, _ = place(host_params, ga, la)
    target = shardings_on(host_params, gb, lb)
    out, _ = reallocate(src, target)  # warm the compile caches
    del out
    gc.collect()
    baseline = {id(x) for x in jax.live_arrays()}
    out, stats = reallocate(src, target, chunk_bytes=1024)
    assert stats.chunks > 1
    jax.block_until_ready(out)
    del out
    gc.collect()
    assert {id(x) for x in jax.live_arrays()} == baseline
    # a move (free_source) leaves only the result, which then goes too
    out, _ = reallocate(src, target, free_source=True)
    del src, out
    gc.collect()
    assert len(jax.live_arrays()) == len(baseline) - len(jax.tree_util.tree_leaves(host_params))


def test_offload_and_reload(host_params):
    src, shardings = place(host_params, G("a", 0, 4), Layout(fsdp=2, tensor=2))
    host = offload(src)
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree_util.tree_leaves(host))
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(src))
    back = reload(host)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(host))
    assert_same(back, host_params, shardings)


def test_target_mismatch_errors(host_params):
    src, _ = place(host_params, G("a", 0, 2), Layout(fsdp=2))
    with pytest.raises(ValueError, match="shardings for"):
        reallocate(src, [NamedSharding(make_mesh(G("b", 0, 2), Layout(fsdp=2)), P())])
    with pytest.raises(TypeError, match="not a jax.Array"):
        reallocate({"x": np.ones(3)}, {"x": NamedSharding(make_mesh(G("b", 0, 2), Layout(fsdp=2)), P())})


def test_single_sharding_for_all_leaves():
    mesh = make_mesh(G("a", 0, 4), Layout(fsdp=4))
    tree = {"a": jnp.arange(8.0), "b": jnp.ones((4, 2))}
    tree = jax.device_put(tree, NamedSharding(mesh, P("fsdp")))
    target = NamedSharding(make_mesh(G("b", 4, 4), Layout(data=4)), P())
    with no_host_transfers():
        out, _ = reallocate(tree, target)
    np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(8.0))
    assert out["b"].sharding == target
