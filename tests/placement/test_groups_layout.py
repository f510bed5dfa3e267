"""The global device list, meshes and logical-axis rules."""

import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model
from jaxrlhf.placement import devices as device_list
from jaxrlhf.placement import layout
from jaxrlhf.planner.plan import DeviceGroup, Layout, PlanError


def test_global_devices_sorted_by_process_then_id(devices):
    devs = device_list.global_devices(list(reversed(devices)))
    assert [d.id for d in devs] == sorted(d.id for d in devices)
    assert device_list.devices_per_host() == 8


def test_make_mesh_axes_and_device_order(devices):
    mesh = layout.make_mesh(DeviceGroup("g", 2, 4), Layout(data=2, tensor=2))
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 1, "tensor": 2}
    assert [d.id for d in mesh.devices.flat] == [2, 3, 4, 5]  # tensor peers are neighbours
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 4
    piped = layout.make_mesh(DeviceGroup("g", 0, 8), Layout(fsdp=2, tensor=2, stage=2))
    assert dict(piped.shape) == {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}
    assert [d.id for d in piped.devices[1].flat] == [4, 5, 6, 7]  # a stage is a contiguous block
    with pytest.raises(PlanError, match="uses 8 devices but group 'g' has 4"):
        layout.make_mesh(DeviceGroup("g", 0, 4), Layout(fsdp=8))


def test_optimizer_state_split_over_data_on_its_largest_dividing_dimension():
    """ZeRO-1: optimizer state mirrors its parameter's spec and adds the data-parallel axes where they divide."""
    lay = Layout(data=4, fsdp=2, tensor=2)
    # [embed, heads] kernel P("fsdp", "tensor") of (64, 8): 32 x 4 per shard, data goes on embed
    assert layout.optimizer_spec(P("fsdp", "tensor"), (64, 8), lay) == P(("fsdp", "data"), "tensor")
    # the largest dimension per shard wins, even when another comes first
    assert layout.optimizer_spec(P(), (4, 64), lay) == P(None, "data")
    # a vector, and one no dimension of which data divides (stays as its parameter is)
    assert layout.optimizer_spec(P(), (64,), lay) == P("data")
    assert layout.optimizer_spec(P("fsdp"), (6, 3), lay) == P("fsdp")
    # no data axis, or a scalar: unchanged
    assert layout.optimizer_spec(P("fsdp"), (64,), Layout(fsdp=8)) == P("fsdp")
    assert layout.optimizer_spec(P(), (), lay) == P()
    # under expert parallelism the weights outside the experts split over expert too; the experts' own
    # state (already split over expert) only over data
    moe = Layout(data=2, expert=4)
    assert layout.optimizer_spec(P(), (64, 32), moe) == P(("data", "expert"))
    assert layout.optimizer_spec(P(None, "expert"), (16, 8, 32), moe) == P(None, "expert", "data")


def test_logical_to_spec_rules():
    rules = layout.DEFAULT_RULES
    lay = Layout(data=2, fsdp=2, tensor=2)
    # q kernel [embed, heads, head_dim]
    assert layout.logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), lay, rules.params) == P("fsdp", "tensor")
    # a mesh axis of size 1 is skipped
    assert layout.logical_to_spec(("embed", "heads"), (64, 4), Layout(fsdp=4), rules.params) == P("fsdp")
    # a dim the axis does not divide stays replicated
    assert layout.logical_to_spec(("embed", "kv_heads"), (64, 1), lay, rules.params) == P("fsdp")
    # activations: batch over data x fsdp, dropping what does not divide
    assert layout.logical_to_spec(("batch", "length", "embed"), (8, 5, 64), lay, rules.activations) == P(("data", "fsdp"))
    assert layout.logical_to_spec(("batch",), (2,), lay, rules.activations) == P("data")
    # an axis is never used twice in one spec
    table = {"a": ("tensor",), "b": ("tensor",)}
    assert layout.logical_to_spec(("a", "b"), (4, 4), lay, table) == P("tensor")


def test_rules_from_config_and_errors():
    r = layout.AxisRules.from_config({"params": {"embed": None}, "activations": {"batch": "data"}})
    assert r.params["embed"] == () and r.activations["batch"] == ("data",)
    flat = layout.AxisRules.from_config({"mlp": ["fsdp", "tensor"]})
    assert flat.params["mlp"] == ("fsdp", "tensor") == flat.activations["mlp"]
    assert layout.AxisRules.from_config(r.to_dict()) == r
    with pytest.raises(PlanError, match="'model' is not a mesh axis"):
        layout.AxisRules.from_config({"embed": "model"})


@pytest.fixture(scope="module")
def tiny_state():
    from flax import nnx

    return nnx.state(build_model(preset("tiny")), nnx.Param)


def test_param_shardings_follow_metadata(tiny_state):
    mesh = layout.make_mesh(DeviceGroup("g", 0, 8), Layout(fsdp=4, tensor=2))
    sh = layout.param_shardings(tiny_state, mesh)
    layer = sh["model"]["layers"]  # stacked: the leading layers axis is not sharded
    assert layer["attn"]["q"].value.spec == P(None, "fsdp", "tensor")
    assert layer["attn"]["o"].value.spec == P(None, "tensor", None, "fsdp")
    assert layer["mlp"]["down"].value.spec == P(None, "tensor", "fsdp")
    assert sh["model"]["embed"].value.spec == P("tensor", "fsdp")
    # structure matches the state, so it can drive device_put / jit directly
    assert jax.tree_util.tree_structure(sh) == jax.tree_util.tree_structure(tiny_state)
    specs = layout.param_specs(tiny_state, Layout(tensor=8))
    assert specs["model"]["layers"]["attn"]["k"].value == P()  # kv_heads=2 not divisible by 8


def test_activation_resolver_inside_constrain(devices):
    mesh = layout.make_mesh(DeviceGroup("g", 0, 4), Layout(data=2, tensor=2))
    resolve = layout.activation_resolver(mesh)
    assert resolve(("batch", "length", "mlp")).spec == P("data", None, "tensor")
    with ax.activation_sharding(resolve):
        out = jax.jit(lambda x: ax.constrain(x * 2, ("batch", "length", "mlp")))(jax.numpy.ones((4, 3, 8)))
    assert out.sharding.spec == P("data", None, "tensor")
