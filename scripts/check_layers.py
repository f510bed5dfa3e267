"""Check the package's layering: no import circle, no import from a layer above, and the layer rules.

    python scripts/check_layers.py        # exit 0, or 1 with one line per violation

A step flows config -> algorithm graph -> plan -> executor -> placed call; the
imports go the other way round, downwards through LAYERS (top first): a module
may import from its own layer and from the layers below it, never from above.
Every `import` counts, also one inside a function (a lazy import is still a
dependency, and a circle through one is still a circle); only imports under
`if TYPE_CHECKING:` are left out, since they never run. On top of the order:

- the planner is JAX-free (no jax, flax or optax, also not through what it
  imports) and never imports an algorithm;
- models see placement only through `models.axes` and `models.pipeline`:
  placement imports nothing else from models, and models import no placement;
- the executor and placed calls know no RL: placement imports no algorithm,
  rollout, environment, reward, data or config module.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "jaxrlhf"

# Top first. A module belongs to the first layer with a pattern that matches its dotted name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry points", ("jaxrlhf.train", "jaxrlhf.plan", "jaxrlhf.eval", "jaxrlhf.generate", "jaxrlhf.profile",
                      "jaxrlhf.config_reference", "jaxrlhf.sandbox", "jaxrlhf")),
    ("run assembly", ("jaxrlhf.run", "jaxrlhf.run.*",
                      "jaxrlhf.checkpoint", "jaxrlhf.metrics", "jaxrlhf.errors", "jaxrlhf.distributed",
                      "jaxrlhf.testing", "jaxrlhf.testing.*")),
    ("config", ("jaxrlhf.config",)),
    ("algorithms", ("jaxrlhf.algorithms", "jaxrlhf.algorithms.*")),
    ("rollouts", ("jaxrlhf.rollouts", "jaxrlhf.rollouts.*")),
    ("environments", ("jaxrlhf.environments", "jaxrlhf.environments.*")),
    ("rewards", ("jaxrlhf.rewards", "jaxrlhf.rewards.*")),
    ("data", ("jaxrlhf.data", "jaxrlhf.data.*")),
    ("executor", ("jaxrlhf.placement.executor", "jaxrlhf.placement.timeline")),
    ("placed call", ("jaxrlhf.placement", "jaxrlhf.placement.*")),
    ("planner", ("jaxrlhf.planner", "jaxrlhf.planner.*")),
    ("models", ("jaxrlhf.models", "jaxrlhf.models.*")),
    ("transfer", ("jaxrlhf.transfer", "jaxrlhf.transfer.*")),
    ("foundation", ("jaxrlhf.graph", "jaxrlhf.registry", "jaxrlhf.yaml_input", "jaxrlhf.config_schema",
                    "jaxrlhf.jax_private")),
]
JAX_PACKAGES = ("jax", "jaxlib", "flax", "optax")
MODELS_SEEN_BY_PLACEMENT = ("jaxrlhf.models.axes", "jaxrlhf.models.pipeline", "jaxrlhf.models.config")
NOT_RL = ("jaxrlhf.algorithms", "jaxrlhf.rollouts", "jaxrlhf.environments", "jaxrlhf.rewards", "jaxrlhf.data", "jaxrlhf.config")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports(path: pathlib.Path, known: set[str], package: str) -> tuple[set[str], set[str]]:
    """(jaxrlhf modules, top-level third-party packages) that `path` imports outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    ours: set[str] = set()
    others: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                while name not in known and "." in name:  # `import jaxrlhf.x.y` of an attribute
                    name = name.rsplit(".", 1)[0]
                ours.add(name)
            else:
                others.add(name.split(".")[0])
    return ours, others


def layer_of(module: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    raise SystemExit(f"check_layers: {module} is in no layer; add it to LAYERS in {__file__}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations() -> list[str]:
    mods = modules()
    known = set(mods)
    graph: dict[str, set[str]] = {}
    third_party: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        ours, others = imports(path, known, package)
        graph[name] = ours - {name}
        third_party[name] = others
    out = []
    for component in cycles(graph):
        out.append(f"import circle: {' <-> '.join(component)}")
    for name in sorted(graph):
        mine = layer_of(name)
        for dep in sorted(graph[name]):
            theirs = layer_of(dep)
            if theirs < mine:
                out.append(f"upward import: {name} ({LAYERS[mine][0]}) imports {dep} ({LAYERS[theirs][0]})")
        if _is(name, "jaxrlhf.planner"):
            jax_used = sorted(third_party[name] & set(JAX_PACKAGES))
            if jax_used:
                out.append(f"planner imports JAX: {name} imports {', '.join(jax_used)}")
        if _is(name, "jaxrlhf.placement"):
            for dep in sorted(graph[name]):
                if _is(dep, "jaxrlhf.models") and dep not in MODELS_SEEN_BY_PLACEMENT:
                    out.append(f"placement sees a model's insides: {name} imports {dep} (only "
                               f"{', '.join(MODELS_SEEN_BY_PLACEMENT)})")
                if any(_is(dep, p) for p in NOT_RL):
                    out.append(f"executor knows RL: {name} imports {dep}")
        if _is(name, "jaxrlhf.models"):
            for dep in sorted(graph[name]):
                if _is(dep, "jaxrlhf.placement"):
                    out.append(f"models import placement: {name} imports {dep}")
    out += planner_loads_jax([m for m in mods if _is(m, "jaxrlhf.planner")])
    return out


def planner_loads_jax(planner_modules: list[str]) -> list[str]:
    """Importing every planner module in a fresh interpreter loads no JAX (also not indirectly)."""
    code = (f"import sys\nfor m in {planner_modules!r}:\n    __import__(m)\n"
            f"print(','.join(sorted(p for p in {JAX_PACKAGES!r} if p in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if proc.returncode:
        return [f"importing the planner failed: {proc.stderr.strip().splitlines()[-1]}"]
    loaded = proc.stdout.strip()
    return [f"planner loads JAX when imported: {loaded}"] if loaded else []


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    if found:
        print(f"check_layers: {len(found)} violation(s); the rules are in {pathlib.Path(__file__).name}'s docstring")
        return 1
    print(f"check_layers: {len(modules())} modules, no circle, no upward import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
