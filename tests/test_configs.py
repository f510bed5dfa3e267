"""Every config shipped in configs/ resolves and plans abstractly: model dimensions only,
no weights, no devices of that kind, no data. The realistic ones fit their hardware's memory."""

import glob
import os

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import build_algorithm
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.memory import plan_memory
from jaxrlhf.run import planning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# config file -> (devices in the cluster it targets, devices per host)
CLUSTERS = {
    "llama3-8b-gsm8k-8xh100.yaml": (8, 8),
    "qwen2-1.5b-tpu-v5e-16.yaml": (16, 4),
    "qwen2.5-0.5b-instruct-gsm8k-dapo.yaml": (1, 1),
    "qwen2.5-1.5b-instruct-calculator-tools.yaml": (1, 1),
    "hh-rlhf-dpo.yaml": (1, 1),
    "qwen3-30b-a3b-gsm8k-grpo.yaml": (16, 8),
}


SHIPPED = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_every_algorithm_has_a_config():
    from jaxrlhf.algorithms import ALGORITHMS

    names = {cfglib.load_config(os.path.join(ROOT, "configs", n)).algorithm.name for n in SHIPPED}
    assert names == set(ALGORITHMS)


@pytest.mark.parametrize("name", [n for n in SHIPPED if n not in CLUSTERS])
def test_bundled_config_plans_on_its_simulated_devices(name):
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", name))
    assert cfg.run.platform == "cpu" and cfg.run.devices == 2
    algorithm = build_algorithm(cfg)
    graph = algorithm.graph()
    plan = planning.plan_for(cfg, algorithm, planning.role_configs(cfg, graph.roles), cfg.run.devices)
    assert set(plan.calls) == set(graph.names)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_realistic_config_plans_without_weights(name, monkeypatch):
    # A search of 500 iterations (the default 16000 took 22 s for the 8 x H100 config, and ran into the
    # search's wall-clock cap on a loaded machine): any plan it returns must cover, size and fit as below
    from jaxrlhf.planner import search

    monkeypatch.setattr(search, "DEFAULT_ITERATIONS", 500)
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", name))
    devices, per_host = CLUSTERS[name]
    algorithm = build_algorithm(cfg)
    graph = algorithm.graph()
    models = planning.role_configs(cfg, graph.roles)
    plan = planning.plan_for(cfg, algorithm, models, devices, devices_per_host=per_host)
    assert set(plan.calls) == set(graph.names)
    assert plan.num_devices == devices
    # The plan fits in the memory of the hardware it names, for the workload the runtime will run: under the
    # memory knobs the plan carries (the planner's choice where the config leaves them unset)
    from jaxrlhf.planner.knobs import fixed_by

    report = plan_memory(plan, graph, models, fixed_by(plan, algorithm.workload()), get_profile(cfg.plan.hardware))
    assert report.feasible, report.reason
    assert report.peak.max() <= report.capacity


def test_a_run_plans_for_the_chip_it_is_on():
    """`train` hands plan choice the chip JAX runs on: its profile by name, and the memory its allocator
    may hand out (an H200 run planned as an H100 assumed 80 GB and offloaded the reference needlessly)."""
    gpu = cfglib.load_config(None, ["run.platform=gpu"])
    h200 = planning.Chip("gpu", "NVIDIA H200", memory=127 * 2**30)
    assert planning.hardware_name(gpu) == "h100"  # no chip known: the platform's profile
    assert planning.hardware_name(gpu, h200) == "h200"
    assert planning.hardware_name(gpu, planning.Chip("gpu", "NVIDIA A100-SXM4-80GB")) == "a100-80g"
    assert planning.hardware_name(gpu, planning.Chip("gpu", "NVIDIA GeForce RTX 4090")) == "h100"
    hw = planning.hardware_profile(gpu, chip=h200)
    assert hw.name == "h200" and hw.hbm_capacity == 127 * 2**30
    named = cfglib.load_config(None, ["run.platform=gpu", "plan.hardware=a100-80g"])
    assert planning.hardware_name(named, h200) == "a100-80g"  # plan.hardware wins; the memory is the chip's
    assert planning.hardware_profile(named, chip=h200).hbm_capacity == 127 * 2**30
    tpu = cfglib.load_config(None, ["run.platform=tpu"])
    assert [planning.hardware_name(tpu, planning.Chip("tpu", k)) for k in ("TPU v4", "TPU v5 lite", "TPU v5p")] \
        == ["tpu-v4", "tpu-v5e", "tpu-v5p"]
    cpu = cfglib.load_config(None, ["run.platform=cpu"])
    assert planning.hardware_profile(cpu, chip=planning.Chip("cpu", "cpu")) == get_profile("cpu")


def test_a_plan_file_that_splits_minibatches_unevenly_is_warned_about(tmp_path, capsys):
    """Batch 8 in 2 minibatches on 8 devices: a plan file's 8-way FSDP train call gets 4 rows an update.
    It runs (XLA pads), but slowly, so the plan is taken with a warning naming the call and the fix;
    the colocated preset splits the minibatch 4 ways and draws none."""
    from jaxrlhf.planner.plan import Layout
    from jaxrlhf.planner.presets import build_plan

    sets = ["model.actor.preset=tiny", "data.batch_size=8", "algorithm.minibatches=2", "run.devices=8"]
    cfg = cfglib.load_config(None, sets)
    algorithm = build_algorithm(cfg)
    graph, models = algorithm.graph(), planning.role_configs(cfg, algorithm.graph().roles)
    plan = build_plan("colocated", 8, models, graph, batch_size=8)  # sized by the batch alone: 8-way
    assert plan.calls["actor.train"].layout == Layout(fsdp=8)
    plan.save(str(tmp_path / "plan.yaml"))
    planning.plan_for(cfglib.load_config(None, [*sets, f"plan.file={tmp_path / 'plan.yaml'}"]), algorithm, models, 8)
    out = capsys.readouterr().out
    assert "warning: actor.train: its minibatches of 4 rows split unevenly" in out and "data*fsdp = 8" in out
    planning.plan_for(cfglib.load_config(None, [*sets, "plan.strategy=colocated"]), algorithm, models, 8)
    assert "split unevenly" not in capsys.readouterr().out


def test_a_runs_layer_loop_is_decided_for_its_platform_and_the_plan_prices_it():
    """The llama3.2-1b preset's 16 layers run unrolled on a GPU and rolled on a CPU (`UNROLL_MAX_LAYERS`);
    `model.actor.unroll_layers` decides for the actor and the roles initialised from it, and the memory
    model reads the same decision (an unrolled forward's second copy of the layer weights)."""
    from jaxrlhf.algorithms import declare
    from jaxrlhf.planner.memory import working_set
    from jaxrlhf.planner.plan import Layout

    sets = ["algorithm.name=ppo", "model.actor.preset=llama3.2-1b"]
    gpu = planning.role_configs(cfglib.load_config(None, sets), ["actor", "critic", "ref"], "gpu")
    assert all(mc.unrolls_layers for mc in gpu.values())
    cpu = planning.role_configs(cfglib.load_config(None, [*sets, "run.platform=cpu"]), ["actor"])
    assert not cpu["actor"].unrolls_layers
    rolled = planning.role_configs(cfglib.load_config(None, [*sets, "model.actor.unroll_layers=false"]),
                                   ["actor", "critic", "ref"], "gpu")
    assert not any(mc.unrolls_layers for mc in rolled.values())
    algorithm = declare(cfglib.load_config(None, sets))
    call, wl = algorithm.graph()["ref.inference"], algorithm.workload()
    assert "layer_copies" in working_set(call, gpu["ref"], Layout(), wl)
    assert "layer_copies" not in working_set(call, rolled["ref"], Layout(), wl)
