import jax


def test_eight_simulated_devices(devices):
    assert len(devices) == 8
    assert all(d.platform == "cpu" for d in devices)
    assert jax.device_count() == 8
