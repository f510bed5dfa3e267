"""HF import straight onto a sharded placement (what multi-host runs use): same values as the plain
load, each parameter already laid out as asked, nothing on the default device."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxrlhf.models.config import preset
from jaxrlhf.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from jaxrlhf.models.transformer import build_model
from jaxrlhf.placement.layout import param_shardings


def test_load_places_each_parameter_on_its_sharding(tmp_path, devices):
    config = preset("tiny")
    save_hf_checkpoint(build_model(config, "lm", seed=3), config, tmp_path)
    mesh = Mesh(np.array(devices).reshape(1, 4, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    plain, _ = load_hf_checkpoint(tmp_path)
    placed, _ = load_hf_checkpoint(tmp_path, shardings=lambda state: param_shardings(state, mesh))
    want = nnx.to_flat_state(nnx.state(plain))
    got = dict(nnx.to_flat_state(nnx.state(placed)))
    expected = {p: s.get_value() for p, s in nnx.to_flat_state(param_shardings(nnx.state(plain), mesh))}
    for path, var in want:
        x = got[path].get_value()
        assert x.sharding.is_equivalent_to(expected[path], x.ndim), path
        np.testing.assert_array_equal(jax.device_get(x), jax.device_get(var.get_value()))
    assert any(len(got[p].get_value().sharding.device_set) == 8 for p, _ in want)
