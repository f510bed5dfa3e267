import dataclasses

import pytest

from jaxrlhf.placement.calibrate import calibrate
from jaxrlhf.planner.hardware import PROFILES, HardwareProfile, get_profile, known_profiles


def test_every_profile_is_complete():
    assert {"h100", "h200", "a100-80g", "tpu-v4", "tpu-v5e", "tpu-v5p", "cpu"} <= set(PROFILES)
    for p in PROFILES.values():
        assert p.peak_flops("bfloat16") > 0 and p.peak_flops("float32") > 0
        assert p.hbm_bandwidth > 0 and p.hbm_capacity > 0 and p.devices_per_host >= 1
        assert p.intra_host_bandwidth > 0 and p.inter_host_bandwidth > 0


def test_lookup_by_name_alias_and_case():
    assert get_profile("H100") is PROFILES["h100"]
    assert get_profile("v5e") is PROFILES["tpu-v5e"]


def test_unknown_hardware_lists_known_profiles():
    with pytest.raises(KeyError) as e:
        get_profile("h900")
    for name in known_profiles():
        assert name in str(e.value)


def test_unknown_dtype_says_which_exist():
    with pytest.raises(KeyError, match="float32"):
        PROFILES["h100"].peak_flops("int4")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_profile_file_round_trip(tmp_path, suffix):
    p = dataclasses.replace(PROFILES["a100-80g"], name="mine", devices_per_host=4)
    path = str(tmp_path / f"p{suffix}")
    p.save(path)
    assert get_profile(path) == p


def test_profile_file_with_unknown_key_is_rejected():
    d = PROFILES["h100"].to_dict() | {"warp_speed": 9}
    with pytest.raises(ValueError, match="warp_speed"):
        HardwareProfile.from_dict(d)


def test_shared_host_caps_per_device_numbers():
    cpu = dataclasses.replace(PROFILES["cpu"], flops={"float32": 10.0, "bfloat16": 1.0}, host_flops=40.0)
    assert cpu.matmul_flops("float32", devices_on_host=1) == 10.0
    assert cpu.matmul_flops("float32", devices_on_host=8) == 5.0
    # Across hosts a device gets its share of the host's NICs.
    h = PROFILES["h100"]
    assert h.link_bandwidth(True, 8) < h.link_bandwidth(True, 1) <= h.link_bandwidth(False, 1)


def test_calibration_measures_local_devices(devices, tmp_path):
    p = calibrate(matmul_size=128, copy_mb=2, repeats=1)
    assert p.devices_per_host == len(devices)
    assert p.flops["float32"] > 1e6 and p.hbm_bandwidth > 1e6 and p.intra_host_bandwidth > 1e5
    assert p.host_flops is not None and p.matmul_efficiency == 1.0
    assert 0 < p.collective_latency < 1 and 0 < p.kernel_latency < 1
    path = str(tmp_path / "cpu.yaml")
    p.save(path)
    assert get_profile(path) == p


def test_tpu_profiles_know_their_torus_and_route_a_slice_over_ici():
    for name, links, dims in (("tpu-v4", 6, 3), ("tpu-v5e", 4, 2), ("tpu-v5p", 6, 3)):
        p = PROFILES[name]
        # tensor parallelism may span two hosts: their chips share the torus, as a GPU node's share NVLink
        assert (p.ici_links, p.torus_dims, p.devices_per_host, p.max_tensor) == (links, dims, 4, 8)
        # hosts of a slice are joined by the same ICI torus: crossing one shares no NIC
        assert p.link_bandwidth(True, devices_on_host=4) == p.link_bandwidth(False)
    h100 = PROFILES["h100"]
    assert (h100.ici_links, h100.torus_dims, h100.max_tensor) == (0, 0, 8)
    assert h100.link_bandwidth(True, devices_on_host=8) < h100.link_bandwidth(False)
    assert get_profile("v5e").to_dict()["torus_dims"] == 2


@pytest.mark.slow
def test_plans_on_a_tpu_slice_keep_tensor_parallelism_within_two_hosts():
    """GRPO with a 1B actor: on a v5litepod-8 (8 chips on one host) and on 16 and 32 chips of 4-chip hosts
    (v5e, v4) no call splits a layer over more than 8 chips (`TORUS_MAX_TENSOR`: two hosts of a slice, whose
    chips share its torus), and generation runs 8-way tensor parallel on each."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.algorithms import declare
    from jaxrlhf.planner.search import SearchSpace, search
    from jaxrlhf.run import planning

    cfg = cfglib.load_config(None, [
        "algorithm.name=grpo", "model.actor.preset=llama3.2-1b", "model.actor.remat=full", "data.batch_size=32",
        "algorithm.group_size=4", "data.max_prompt_len=512", "generation.max_new_tokens=512",
        "algorithm.minibatches=4"])
    algorithm = declare(cfg)
    graph, wl = algorithm.graph(), algorithm.workload()
    models = {r: m for r, m in planning.role_configs(cfg, graph.roles).items() if r in graph.roles}
    one_host = dataclasses.replace(PROFILES["tpu-v5e"], devices_per_host=8)
    for hw, n in ((one_host, 8), (PROFILES["tpu-v5e"], 16), (PROFILES["tpu-v4"], 32)):
        space = SearchSpace.build(graph, models, wl, n, hw)
        assert max(lay.tensor for c in graph.names for _, _, lay in space.slots(c)) == 8
        res = search(models, wl, hw, n, graph, iterations=2000, time_budget_s=60)
        plans = [res.best, *res.runners_up, *(p for p in res.presets.values() if not isinstance(p, str))]
        assert max(p.layout.tensor for est in plans for p in est.plan.calls.values()) <= 8
        assert res.best.plan.calls["actor.generate"].layout.tensor == 8, (hw.name, n)


def test_gpu_efficiencies_are_what_the_h200_measurements_give():
    """Every GPU profile prices calls at the fractions of its datasheet that jaxrlhf's runtime reached on one
    H200 (`scripts/calibrate_gpu_profiles.py` from docs/results/h200_validate_estimator.json): decode steps at
    one fraction of the bandwidth everywhere; train and inference calls at the kernels' matmul rate plus their
    memory-bound work, which weighs more on a chip with less bandwidth per FLOP (by hand for the H20 and the
    H100 here)."""
    import importlib.util
    import json
    import pathlib

    from jaxrlhf.planner.hardware import GPU_CALL_OVERHEAD, GPU_MATMUL_KERNEL, GPU_MEMORY_EFFICIENCY, PROFILES

    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("calibrate_gpu_profiles", root / "scripts" / "calibrate_gpu_profiles.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    factors = script.efficiencies(json.loads((root / "docs" / "results" / "h200_validate_estimator.json").read_text()))
    assert round(factors["matmul_kernel"], 3) == GPU_MATMUL_KERNEL
    assert round(factors["call_overhead"], 3) == GPU_CALL_OVERHEAD
    assert round(factors["memory_efficiency"], 3) == GPU_MEMORY_EFFICIENCY
    for name in ("h100", "h200", "h800", "h20", "a100-80g", "a800-80g"):
        assert PROFILES[name].memory_efficiency == GPU_MEMORY_EFFICIENCY
    # seconds per FLOP = matmuls at the kernels' rate + the memory-bound work's bytes (per FLOP, the H200's) at
    # this chip's bandwidth
    h200_bytes_per_flop = GPU_CALL_OVERHEAD / (989e12 * GPU_MATMUL_KERNEL) * (4.8e12 * GPU_MATMUL_KERNEL)
    for name, peak, bw in (("h200", 989e12, 4.8e12), ("h100", 989e12, 3.35e12), ("h20", 148e12, 4.0e12)):
        s_per_flop = 1 / (peak * GPU_MATMUL_KERNEL) + h200_bytes_per_flop / (bw * GPU_MATMUL_KERNEL)
        assert PROFILES[name].matmul_efficiency == pytest.approx(1 / (s_per_flop * peak), abs=5e-4)
    assert PROFILES["h200"].matmul_efficiency == 0.465  # the calibration point, as before the split
    assert PROFILES["h100"].matmul_efficiency < 0.465 < PROFILES["a100-80g"].matmul_efficiency < PROFILES["h20"].matmul_efficiency
