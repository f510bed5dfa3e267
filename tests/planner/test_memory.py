import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.memory import (
    layer_live_bytes,
    optimizer_per_device,
    params_per_device,
    plan_memory,
    working_set,
)
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
from jaxrlhf.planner.simulator import estimate_plan
from jaxrlhf.planner.workload import Workload
from jaxrlhf.testing.graphs import ppo_graph

PPO_GRAPH = ppo_graph()

SMALL = preset("small")


def _compiled_peak(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


@pytest.fixture(scope="module")
def small_model():
    graphdef, params = nnx.split(build_model(SMALL, "lm"), nnx.Param)

    def fwd(params, tok, pos, mask):
        return nnx.merge(graphdef, params)(tok, pos, mask)[0]

    return params, fwd


def _batch(b: int, t: int):
    return jnp.zeros((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), bool)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [8])
def test_train_step_memory_within_20_percent_of_xla(small_model, batch):
    params, fwd = small_model
    opt = optax.adamw(1e-4)

    def step(params, state, tok, pos, mask):
        grads = jax.grad(lambda p: -jax.nn.log_softmax(fwd(p, tok, pos, mask)).mean())(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    args = (params, opt.init(params), *_batch(batch, 128))
    measured = _compiled_peak(jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile())
    wl = Workload(batch_size=batch, prompt_len=64, gen_len=64, minibatches=1, remat=False, adam_master_fp32=False)
    call = CallSpec("actor.train", "actor", "train")
    estimate = (params_per_device(SMALL, "lm", Layout()) + optimizer_per_device(SMALL, "lm", Layout(), wl)
                + sum(working_set(call, SMALL, Layout(), wl).values()))
    assert estimate == pytest.approx(measured, rel=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [8, 32])
def test_forward_memory_within_20_percent_of_xla(small_model, batch):
    params, fwd = small_model
    measured = _compiled_peak(jax.jit(fwd).lower(params, *_batch(batch, 128)).compile())
    wl = Workload(batch_size=batch, prompt_len=64, gen_len=64, minibatches=1)
    call = CallSpec("ref.inference", "ref", "inference")
    estimate = params_per_device(SMALL, "lm", Layout()) + sum(working_set(call, SMALL, Layout(), wl).values())
    assert estimate == pytest.approx(measured, rel=0.2)


def test_sharding_divides_parameter_and_optimizer_bytes():
    wl = Workload()
    cfg = preset("llama2-7b")
    assert params_per_device(cfg, "lm", Layout(fsdp=8)) == pytest.approx(params_per_device(cfg, "lm", Layout()) / 8)
    assert params_per_device(cfg, "lm", Layout(data=8)) == params_per_device(cfg, "lm", Layout())
    # bf16 params with an fp32 master: m + v (2 x 2 bytes) + master (4 bytes) per parameter.
    assert optimizer_per_device(cfg, "lm", Layout(), wl) == 12 * cfg.num_params()


def test_remat_saves_activation_memory():
    cfg = preset("llama2-7b")
    call = CallSpec("actor.train", "actor", "train")
    full = working_set(call, cfg, Layout(fsdp=8), Workload(batch_size=64, remat=False))["activations"]
    remat = working_set(call, cfg, Layout(fsdp=8), Workload(batch_size=64, remat=True))["activations"]
    assert remat < full / 4


def test_logit_chunks_keep_one_chunk_of_logits():
    """`algorithm.logit_chunk_tokens`: a log-prob call's float32 logits count one chunk of positions a device
    (three copies in a train call: logits, softmax, gradient), the runtime's split (`models.logit_sizes`); an
    inference call's peak is the larger of a layer's and the logits' (the head runs after the layers)."""
    cfg = preset("qwen2-7b")
    # without remat no layer is recomputed: the head's phase of the backward sets the peak (`working_set`)
    wl = Workload(batch_size=64, prompt_len=512, gen_len=8192, minibatches=1, remat="none")
    layout = Layout(fsdp=8)  # 8 rows x 8192 response positions a device
    train = CallSpec("actor.train", "actor", "train")
    whole, chunked = (working_set(train, cfg, layout, dataclasses.replace(wl, logit_chunk=c))["activations"]
                      for c in (None, 4096))
    assert (whole - chunked) / ((8 * 8192 - 4096) * cfg.vocab_size * 4) == pytest.approx(3)
    tiny, rows = (working_set(train, cfg, layout, dataclasses.replace(wl, logit_chunk=c))["activations"]
                  for c in (1, 8))
    assert tiny == rows  # a budget below a device's rows: one position a row
    short = Workload(batch_size=512, prompt_len=64, gen_len=512, minibatches=1)  # 64 rows x 512 positions a device
    infer = CallSpec("ref.inference", "ref", "inference")
    whole, chunked = (working_set(infer, cfg, layout, dataclasses.replace(short, logit_chunk=c))["activations"]
                      for c in (None, 4096))
    layer = layer_live_bytes(cfg, 64 * 576, 576, 1)
    assert whole == 64 * 512 * cfg.vocab_size * 4 > layer  # the logits outweigh a layer
    assert chunked == max(layer, 4096 * cfg.vocab_size * 4) == layer  # one chunk's do not


def _colocated(n: int, layout: Layout) -> ExecutionPlan:
    return ExecutionPlan("colocated", n, {"all": DeviceGroup("all", 0, n)},
                         {c: Placement("all", layout) for c in PPO_GRAPH.names})


def test_over_capacity_plan_is_infeasible_with_reason():
    models = {r: preset("llama2-70b") for r in ("actor", "critic", "ref", "reward")}
    est = estimate_plan(_colocated(8, Layout(fsdp=8)), PPO_GRAPH, models, Workload(), get_profile("h100"))
    assert not est.feasible and est.step_s is None
    assert "out of memory on device" in est.reason and "GiB" in est.reason


def test_frozen_models_are_offloaded_when_that_makes_a_plan_fit():
    hw = get_profile("h100")
    models = {r: preset("llama2-13b") for r in ("actor", "critic", "ref", "reward")}
    wl = Workload(batch_size=128, gen_len=128)
    mem = plan_memory(_colocated(16, Layout(fsdp=16)), PPO_GRAPH, models, wl, hw)
    roomy = plan_memory(_colocated(16, Layout(fsdp=16)), PPO_GRAPH, models, wl,
                        hw.__class__(**{**hw.to_dict(), "hbm_capacity": 10 * hw.hbm_capacity}))
    assert roomy.offloaded == ()
    tight = hw.__class__(**{**hw.to_dict(), "hbm_capacity": roomy.max_peak / 0.9 * 0.97})
    mem = plan_memory(_colocated(16, Layout(fsdp=16)), PPO_GRAPH, models, wl, tight)
    assert mem.feasible and set(mem.offloaded) <= {"ref", "reward"} and mem.offloaded
    est = estimate_plan(_colocated(16, Layout(fsdp=16)), PPO_GRAPH, models, wl, tight)
    assert est.reloads and all(c.split(".")[0] in mem.offloaded for c in est.reloads)


def test_optimizer_state_waits_in_host_memory_only_where_frozen_offload_does_not_fit():
    """`plan.offload_optimizer`, by hand: a parked optimizer state leaves the resident bytes and joins its own
    train call's working set (the update runs on device), so it frees memory for every other call there.
    The memory model parks one only when allowed and when offloading the frozen roles is not enough; the
    estimate then prices the state's two trips over the host link in the train call."""
    hw = get_profile("h100")
    models = {r: preset("llama2-13b") for r in ("actor", "critic", "ref", "reward")}
    wl = Workload(batch_size=128, gen_len=1024)  # fixed knobs (one micro-batch, full remat)
    plan = dataclasses.replace(_colocated(16, Layout(fsdp=16)), offload_roles=("ref", "reward"))
    base = plan_memory(plan, PPO_GRAPH, models, wl, hw)
    layout = Layout(fsdp=16)
    params = {r: params_per_device(models[r], PPO_GRAPH.head(r), layout) for r in ("actor", "critic")}
    state = {r: optimizer_per_device(models[r], PPO_GRAPH.head(r), layout, wl, r) for r in ("actor", "critic")}
    work = {c.name: sum(working_set(c, models[c.role], layout, wl).values()) for c in PPO_GRAPH.calls}
    resident = sum(params.values()) + sum(state.values())
    assert base.resident.max() == pytest.approx(resident)
    assert base.call_bytes["actor.generate"] == pytest.approx(resident + work["actor.generate"])

    # the plan parks the actor's state: it is resident no more, and back on device for actor.train only
    parked = plan_memory(dataclasses.replace(plan, offload_optimizer=("actor",)), PPO_GRAPH, models, wl, hw)
    assert parked.offloaded_optimizers == ("actor",)
    assert parked.resident.max() == pytest.approx(resident - state["actor"])
    assert parked.call_bytes["actor.generate"] == pytest.approx(resident - state["actor"] + work["actor.generate"])
    assert parked.call_bytes["actor.train"] == pytest.approx(base.call_bytes["actor.train"])

    # a device just too small for the generate call's peak: frozen offload is not enough, parking is
    gen_peak = base.call_bytes["actor.generate"]
    assert gen_peak > max(v for c, v in base.call_bytes.items() if c != "actor.generate")
    tight = hw.__class__(**{**hw.to_dict(), "hbm_capacity": (gen_peak - 1e6) / hw.usable_memory * hw.hbm_capacity})
    unparked = plan_memory(plan, PPO_GRAPH, models, wl, tight)
    assert not unparked.feasible and unparked.parkable  # the generate call overflows beside both states
    fitted = plan_memory(plan, PPO_GRAPH, models, wl, tight, offload_optimizers=True)
    assert fitted.feasible and len(fitted.offloaded_optimizers) == 1
    est = estimate_plan(plan, PPO_GRAPH, models, wl, tight)
    assert est.feasible and est.memory.offloaded_optimizers == fitted.offloaded_optimizers
    role = fitted.offloaded_optimizers[0]
    assert est.reloads[f"{role}.train"] == pytest.approx(2 * state[role] / tight.host_bandwidth)
