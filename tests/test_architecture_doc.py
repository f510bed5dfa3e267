"""The worked examples of docs/architecture.md run as written (a doc example that rots misleads)."""

from __future__ import annotations

import re
from pathlib import Path

from jaxrlhf.algorithms.rloo import RLOO
from jaxrlhf.models.config import PRESETS
from jaxrlhf.planner import plan as planlib
from jaxrlhf.testing.graphs import ppo_graph

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _example(heading: str) -> str:
    """The first python code block after `heading`."""
    text = DOC.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_strategy_example_builds_a_valid_plan():
    namespace = {
        "register_strategy": lambda name: (lambda fn: fn),  # keep the global registry unchanged
        "DeviceGroup": planlib.DeviceGroup, "Placement": planlib.Placement, "Layout": planlib.Layout,
        "ExecutionPlan": planlib.ExecutionPlan,
    }
    exec(_example("### A new placement strategy"), namespace)
    graph = ppo_graph(reward_model=True)
    models = {r: PRESETS["tiny"] for r in graph.roles}
    plan = namespace["actor_alone"](8, models, graph, batch_size=16)
    planlib.validate(plan, graph, models, devices=8)
    assert {plan.calls[c.name].group for c in graph.calls if c.role == "actor"} == {"a"}
    assert {plan.calls[c.name].group for c in graph.calls if c.role != "actor"} == {"b"}


def test_algorithm_example_is_the_real_class():
    code = _example("### A new algorithm")
    for attr, value in re.findall(r"^\s+(\w+) = (\S+)", code, re.M):
        assert repr(getattr(RLOO, attr)) == value.replace('"', "'"), attr


def test_correction_example_weighs_through_the_registry():
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.algorithms.correction import ROLLOUT_CORRECTIONS, Corrected, Correction, correction_weights

    namespace = {"register_correction": lambda name: (lambda fn: fn), "jnp": jnp, "Corrected": Corrected}
    exec(_example("### A new rollout correction"), namespace)
    with ROLLOUT_CORRECTIONS.temporarily("clipped", namespace["clipped"]):
        weights, _, stats = correction_weights(Correction("clipped"), jnp.log(jnp.array([[4.0, 0.1, 1.0]])),
                                               jnp.zeros((1, 3)), jnp.ones((1, 3), bool))
    np.testing.assert_allclose(weights, [[2.0, 0.5, 1.0]], rtol=1e-6)  # tis_cap 2: clipped into [1/2, 2]
    assert float(stats["correction/masked_fraction"]) == 0.0
