"""The package's layering (scripts/check_layers.py): no import circle, no import from a layer above."""

import pathlib
import runpy
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _checker():
    return types.SimpleNamespace(**runpy.run_path(str(ROOT / "scripts" / "check_layers.py")))


def test_the_package_has_no_circle_and_no_upward_import():
    assert _checker().violations() == []


def test_the_checker_finds_circles_and_upward_imports(tmp_path):
    check = _checker()
    # a -> b -> c -> a is one circle; d -> e alone is none
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set()}
    assert check.cycles(graph) == [["a", "b", "c"]]
    # the layer order: the planner sits below the algorithms, the executor below the config
    assert check.layer_of("jaxrlhf.planner.search") > check.layer_of("jaxrlhf.algorithms.ppo")
    assert check.layer_of("jaxrlhf.placement.executor") > check.layer_of("jaxrlhf.config")
    assert check.layer_of("jaxrlhf.placement.calls") > check.layer_of("jaxrlhf.placement.executor")
    # lazy imports count, TYPE_CHECKING ones do not
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxrlhf.config import Config\n"
                   "def f():\n    from jaxrlhf.algorithms import base\n    import jax\n")
    known = {"jaxrlhf.config", "jaxrlhf.algorithms", "jaxrlhf.algorithms.base"}
    assert check.imports(src, known, "jaxrlhf.planner") == ({"jaxrlhf.algorithms.base"}, {"jax", "typing"})
