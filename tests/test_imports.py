"""Imports of segpack/ and train/: none inside a function, and no cycle between modules.

Rules (issue 10):
- An import inside a function is allowed only for a truly optional dependency (matplotlib, the
  private cuDNN module), and its line says why: `# optional: <reason>`.
- The module-level imports of segpack/ and train/ (absolute `segpack.*` / `train.*` imports,
  including those under a module-level `if` or `try`, such as `if TYPE_CHECKING:`) form no cycle.
  An edge goes to the module imported: `from segpack.attention import pallas` is an edge to
  `segpack.attention.pallas`, `from segpack.attention.checks import X` to
  `segpack.attention.checks` (a package's `__init__` running first is not counted).

The checks are parsed from the source with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("segpack", "train")
REASON = re.compile(r"#\s*optional:\s*\S")


def module_files() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of `PACKAGES`."""
  out = {}
  for package in PACKAGES:
    for path in sorted((REPO / package).rglob("*.py")):
      parts = list(path.relative_to(REPO).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def function_level_imports(source: str) -> list[tuple[int, str]]:
  """`(line number, line)` of every import inside a function that has no `# optional:` reason."""
  lines = source.splitlines()
  found = {}
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    for inner in ast.walk(node):
      if isinstance(inner, (ast.Import, ast.ImportFrom)):
        span = lines[inner.lineno - 1:inner.end_lineno]
        if not any(REASON.search(line) for line in span):
          found[inner.lineno] = lines[inner.lineno - 1].strip()
  return sorted(found.items())


def _module_level_nodes(body: list[ast.stmt]):
  """The statements of a module body, descending into `if`/`try`/`with`, not into defs."""
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    yield node
    for field in ("body", "orelse", "finalbody"):
      yield from _module_level_nodes(getattr(node, field, []) or [])
    for handler in getattr(node, "handlers", []) or []:
      yield from _module_level_nodes(handler.body)


def module_imports(source: str, module: str, *, is_package: bool,
                   known: set[str]) -> set[str]:
  """The modules of `known` that `module` imports at module level."""
  package = module if is_package else module.rpartition(".")[0]
  out = set()
  for node in _module_level_nodes(ast.parse(source).body):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                 for a in node.names]
    else:
      continue
    out.update(t for t in targets if t in known and t != module)
  return out


def import_graph() -> dict[str, set[str]]:
  files = module_files()
  known = set(files)
  return {name: module_imports(path.read_text(), name, is_package=path.name == "__init__.py",
                               known=known)
          for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as `[a, b, ..., a]`, or None (iterative depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  for root in sorted(graph):
    if state.get(root):
      continue
    path, stack = [root], [iter(sorted(graph[root]))]
    state[root] = 1
    while stack:
      nxt = next(stack[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        stack.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif not state.get(nxt):
        state[nxt] = 1
        path.append(nxt)
        stack.append(iter(sorted(graph.get(nxt, ()))))
  return None


# The checks on small inputs (they must catch what they are for).

def test_function_level_import_is_found_unless_it_gives_a_reason():
  source = ("import os\n\n"
            "def f():\n  import json\n  return json\n\n"
            "def g():\n  import matplotlib  # optional: the [plot] extra\n\n"
            "class C:\n  def m(self):\n    from segpack import (\n        files)\n")
  assert function_level_imports(source) == [(4, "import json"), (12, "from segpack import (")]


def test_module_imports_resolve_submodules_relative_and_guarded_imports():
  known = {"segpack", "segpack.attention", "segpack.attention.pallas",
           "segpack.attention.checks", "segpack.files", "train.model"}
  source = ("from typing import TYPE_CHECKING\n"
            "from segpack.attention import pallas, segment_attention\n"
            "from . import checks\n"
            "import numpy\n"
            "if TYPE_CHECKING:\n  from segpack.files import atomic_write_bytes\n"
            "try:\n  import train.model\nexcept ImportError:\n  pass\n"
            "def f():\n  from segpack import mesh\n")
  got = module_imports(source, "segpack.attention.dispatch", is_package=False, known=known)
  assert got == {"segpack.attention.pallas", "segpack.attention", "segpack.attention.checks",
                 "segpack.files", "train.model"}


def test_find_cycle_finds_one_and_accepts_a_dag():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
  cycle = find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
  assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}


# The rules on the project.

@pytest.mark.parametrize("module", sorted(module_files()))
def test_no_import_inside_a_function(module):
  path = module_files()[module]
  offenders = function_level_imports(path.read_text())
  assert not offenders, (
      f"{path.relative_to(REPO)}: imports inside functions (move them to the top of the module, "
      f"or mark a truly optional dependency `# optional: <reason>`): {offenders}")


def test_the_module_import_graph_has_no_cycle():
  graph = import_graph()
  assert len(graph) > 50 and graph["train.model"] >= {"segpack.attention"}  # the graph is real
  cycle = find_cycle(graph)
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
