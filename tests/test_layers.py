"""The package's layers only point down, and its modules import each other without cycles.

Every module under ``dpmuon_jax/`` is parsed with :mod:`ast`; each import of a
package module, at any level (inside functions and ``TYPE_CHECKING`` blocks
too, relative ones resolved), is an edge of the module graph. A module may
import only from its own layer or lower ones, ``privacy`` and ``linalg`` (the
two halves of layer 1) never import each other, and the graph has no cycles
(Tarjan's strongly connected components; a package ``__init__`` importing its
own submodules is a re-export and is left out of the cycle check).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "dpmuon_jax"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Module-path prefix -> layer, bottom to top; the longest matching prefix wins.
LAYERS: dict[str, int] = {
    "dpmuon_jax.checks": 0,
    "dpmuon_jax.extras": 0,
    "dpmuon_jax.help_format": 0,
    "dpmuon_jax.privacy": 1,
    "dpmuon_jax.linalg": 1,
    "dpmuon_jax.transforms": 2,
    "dpmuon_jax.optimizers": 3,
    "dpmuon_jax.models": 4,
    "dpmuon_jax.data": 4,
    "dpmuon_jax.text": 4,
    "dpmuon_jax.text.train": 5,
    "dpmuon_jax.distributed": 5,
    "dpmuon_jax.training": 5,
    "dpmuon_jax.analysis": 6,
    "dpmuon_jax.audit": 6,
    "dpmuon_jax.cli": 7,
    "dpmuon_jax": 7,  # the top-level re-exports: importable only from the top
}

# The top-level package re-exports the public API from every layer.
EXEMPT = frozenset({"dpmuon_jax"})

# Same layer, but neither may import the other.
SEPARATE = (("dpmuon_jax.privacy", "dpmuon_jax.linalg"),)

# Known edges still to remove, (importer, imported); keep this empty.
TEMPORARY_ALLOWED: frozenset[tuple[str, str]] = frozenset()

Graph = Mapping[str, Iterable[str]]


def _within(module: str, prefix: str) -> bool:
  return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str, layers: Mapping[str, int] = LAYERS) -> int:
  """The layer of the longest prefix of ``module`` in ``layers``."""
  matches = [prefix for prefix in layers if _within(module, prefix)]
  if not matches:
    raise KeyError(f"{module} is in no layer; add its prefix to LAYERS in tests/test_layers.py.")
  return layers[max(matches, key=len)]


def module_name(path: Path, root: Path = ROOT, package: str = PACKAGE) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join([package, *parts])


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
  """The package modules one import statement refers to."""
  if isinstance(node, ast.Import):
    names = [alias.name for alias in node.names]
    return {_closest_module(name, known) for name in names if _within(name, PACKAGE)}
  assert isinstance(node, ast.ImportFrom)
  if node.level:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    source = ".".join(base + ([node.module] if node.module else []))
  else:
    source = node.module or ""
  if not _within(source, PACKAGE):
    return set()
  found = set()
  for alias in node.names:
    candidate = f"{source}.{alias.name}"
    # ``from package import submodule`` imports the submodule; a name is from ``source``.
    found.add(candidate if candidate in known else _closest_module(source, known))
  return found


def _closest_module(name: str, known: set[str]) -> str:
  """``name`` or its longest prefix that is a module (``a.b.func`` -> ``a.b``)."""
  parts = name.split(".")
  while len(parts) > 1 and ".".join(parts) not in known:
    parts.pop()
  return ".".join(parts)


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
  """module -> the package modules it imports (anywhere in its source)."""
  paths = {module_name(path, root, package): path for path in sorted(root.rglob("*.py"))}
  known = set(paths)
  graph: dict[str, set[str]] = {}
  for module, path in paths.items():
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    edges: set[str] = set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        edges |= _imported(node, module, is_package, known)
    edges.discard(module)
    graph[module] = edges
  return graph


def layer_violations(
    graph: Graph,
    layers: Mapping[str, int] = LAYERS,
    exempt: Iterable[str] = EXEMPT,
    separate: Iterable[tuple[str, str]] = SEPARATE,
    allowed: Iterable[tuple[str, str]] = (),
) -> list[str]:
  """One line per import of a higher layer or across a separated pair."""
  exempt, allowed = set(exempt), set(allowed)
  problems = []
  for module in sorted(graph):
    if module in exempt:
      continue
    for target in sorted(graph[module]):
      if (module, target) in allowed:
        continue
      low, high = layer_of(module, layers), layer_of(target, layers)
      if high > low:
        problems.append(f"{module} (layer {low}) imports {target} (layer {high})")
      for a, b in separate:
        if (_within(module, a) and _within(target, b)) or (
            _within(module, b) and _within(target, a)):
          problems.append(f"{module} imports {target}: {a} and {b} must not import each other")
  return problems


def _without_reexports(graph: Graph, packages: Iterable[str]) -> dict[str, set[str]]:
  """Drops a package ``__init__``'s edges to its own submodules."""
  packages = set(packages)
  return {
      module: {t for t in targets if not (module in packages and _within(t, module))}
      for module, targets in graph.items()
  }


def cycles(graph: Graph) -> list[list[str]]:
  """The strongly connected components with a cycle (Tarjan), each sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []
  counter = 0
  nodes = set(graph) | {t for targets in graph.values() for t in targets}

  def successors(node: str) -> list[str]:
    return sorted(graph.get(node, ()))

  for start in sorted(nodes):
    if start in index:
      continue
    # Iterative Tarjan: (node, iterator over its successors).
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    work = [(start, iter(successors(start)))]
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(successors(child))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        parent = work[-1][0]
        low[parent] = min(low[parent], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1 or node in graph.get(node, ()):
          found.append(sorted(component))
  return sorted(found)


def _packages(root: Path = ROOT) -> set[str]:
  return {module_name(path, root) for path in root.rglob("__init__.py")}


# ------------------------------------------------------------------------------ the checks


def test_every_module_has_a_layer():
  unplaced = []
  for module in import_graph():
    try:
      layer_of(module)
    except KeyError as error:
      unplaced.append(str(error))
  assert not unplaced, "\n".join(unplaced)


def test_layers_only_point_down():
  problems = layer_violations(import_graph(), allowed=TEMPORARY_ALLOWED)
  assert not problems, "Imports against the layering:\n  " + "\n  ".join(problems)


def test_no_import_cycles():
  graph = _without_reexports(import_graph(), _packages())
  found = cycles(graph)
  assert not found, "Import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


def test_temporary_allow_list_is_still_needed():
  graph = import_graph()
  stale = [edge for edge in TEMPORARY_ALLOWED if edge[1] not in graph.get(edge[0], ())]
  assert not stale, f"Remove these from TEMPORARY_ALLOWED, the imports are gone: {stale}"


# ------------------------------------------------------------------------ the checker itself


def test_checker_flags_an_upward_import_and_a_separated_pair():
  fake = {
      "dpmuon_jax.privacy.query": {"dpmuon_jax.transforms.routing", "dpmuon_jax.checks"},
      "dpmuon_jax.transforms.routing": {"dpmuon_jax.linalg.scaling"},
      "dpmuon_jax.linalg.scaling": {"dpmuon_jax.privacy.keys"},
      "dpmuon_jax.privacy.keys": set(),
      "dpmuon_jax.checks": set(),
      "dpmuon_jax": {"dpmuon_jax.cli"},
  }
  problems = layer_violations(fake)
  assert problems == [
      "dpmuon_jax.linalg.scaling imports dpmuon_jax.privacy.keys: dpmuon_jax.privacy and "
      "dpmuon_jax.linalg must not import each other",
      "dpmuon_jax.privacy.query (layer 1) imports dpmuon_jax.transforms.routing (layer 2)",
  ]
  allowed = {("dpmuon_jax.privacy.query", "dpmuon_jax.transforms.routing"),
             ("dpmuon_jax.linalg.scaling", "dpmuon_jax.privacy.keys")}
  assert layer_violations(fake, allowed=allowed) == []
  assert layer_of("dpmuon_jax.text.train") == 5 and layer_of("dpmuon_jax.text.gpt2") == 4
  assert layer_of("dpmuon_jax.optimizers.muon") == 3


def test_checker_finds_a_cycle_and_ignores_reexports():
  fake = {
      "dpmuon_jax.a": {"dpmuon_jax.b"},
      "dpmuon_jax.b": {"dpmuon_jax.c"},
      "dpmuon_jax.c": {"dpmuon_jax.a", "dpmuon_jax.d"},
      "dpmuon_jax.d": set(),
      "dpmuon_jax.e": {"dpmuon_jax.e"},
  }
  assert cycles(fake) == [["dpmuon_jax.a", "dpmuon_jax.b", "dpmuon_jax.c"], ["dpmuon_jax.e"]]
  assert cycles({"x": {"y"}, "y": set()}) == []
  package = {"dpmuon_jax.p": {"dpmuon_jax.p.m"}, "dpmuon_jax.p.m": {"dpmuon_jax.p"}}
  assert cycles(package) == [["dpmuon_jax.p", "dpmuon_jax.p.m"]]
  assert cycles(_without_reexports(package, {"dpmuon_jax.p"})) == []


def test_checker_reads_imports_at_any_level(tmp_path):
  root = tmp_path / "pkg"
  (root / "sub").mkdir(parents=True)
  (root / "__init__.py").write_text("")
  (root / "low.py").write_text("X = 1\n")
  (root / "sub" / "__init__.py").write_text("from . import mod\n")
  (root / "sub" / "mod.py").write_text(
      "def f():\n  from ..low import X\n  import dpmuon_jax.checks\n  return X\n")
  graph = import_graph(root, "dpmuon_jax")
  assert graph["dpmuon_jax.sub"] == {"dpmuon_jax.sub.mod"}
  assert graph["dpmuon_jax.sub.mod"] == {"dpmuon_jax.low", "dpmuon_jax"}
