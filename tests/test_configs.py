"""The realistic configs shipped in configs/ plan abstractly: model dimensions only,
no weights, no devices of that kind, no data."""

import glob
import os

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.algorithms import build_algorithm
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.memory import plan_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# config file -> (devices in the cluster it targets, devices per host)
CLUSTERS = {
    "llama3-8b-gsm8k-8xh100.yaml": (8, 8),
    "qwen2-1.5b-tpu-v5e-16.yaml": (16, 4),
}


def test_every_shipped_config_is_covered():
    shipped = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))}
    assert shipped - {"quickstart.yaml"} == set(CLUSTERS)


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_realistic_config_plans_without_weights(name):
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", name))
    devices, per_host = CLUSTERS[name]
    algorithm = build_algorithm(cfg)
    graph = algorithm.graph()
    models = train.role_configs(cfg, graph.roles)
    plan = train.plan_for(cfg, algorithm, models, devices, devices_per_host=per_host)
    assert set(plan.calls) == set(graph.names)
    assert plan.num_devices == devices
    # The plan fits in the memory of the hardware it names, for the workload the runtime will run.
    report = plan_memory(plan, graph, models, algorithm.workload(), get_profile(cfg.plan.hardware))
    assert report.feasible, report.reason
    assert report.peak.max() <= report.capacity
