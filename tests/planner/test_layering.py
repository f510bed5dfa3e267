"""The planner is JAX-free and algorithm-free: it plans any graph it is given, on a laptop."""

import subprocess
import sys


def test_planner_imports_neither_jax_nor_algorithms():
    code = (
        "import sys, jaxrlhf.planner.search, jaxrlhf.planner.presets, jaxrlhf.planner.simulator, jaxrlhf.graph\n"
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxrlhf.algorithms', "
        "'jaxrlhf.placement', 'flax'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
