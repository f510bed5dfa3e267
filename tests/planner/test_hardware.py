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
    path = str(tmp_path / "cpu.yaml")
    p.save(path)
    assert get_profile(path) == p
