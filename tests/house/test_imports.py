"""Imports of segpack/ and train/ (none inside a function, no cycle) and the size of the code.

Rules of the imports (issue 10):
- An import inside a function is allowed only for a truly optional dependency (matplotlib, the
  private cuDNN module), and its line says why: `# optional: <reason>`.
- The module-level imports of segpack/ and train/ (absolute `segpack.*` / `train.*` imports,
  including those under a module-level `if` or `try`, such as `if TYPE_CHECKING:`) form no cycle.
  An edge goes to the module imported: `from segpack.attention import pallas` is an edge to
  `segpack.attention.pallas`, `from segpack.attention.checks import X` to
  `segpack.attention.checks` (a package's `__init__` running first is not counted).

Floors (`FLOORS`, lowest first; docs/architecture.md, "Floors"): a module imports modules of its
own floor or of a lower one, never of a higher one. The library (segpack/) never imports the
trainer (train/), which sits on the top floor with configs/.

Rules of size, for segpack/, train/ and configs/:
- A module holds at most 450 lines (`MAX_MODULE_LINES`), a module of train/ at most 400
  (`MAX_TRAIN_MODULE_LINES`).
- A function or method holds at most 80 lines of code (`MAX_FUNCTION_LINES`): the lines of its
  span (the `def` line to its last line, nested functions included) that are not blank, not
  only a comment, and not inside its docstring.
- `segpack.data.packed.pack_dataset` takes at most 12 parameters
  (`MAX_PACK_DATASET_PARAMETERS`) and no `**kwargs`.

The checks are parsed from the source with `ast` (comments found with `tokenize`); nothing is
imported.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import pytest
from support import paths

REPO = paths.REPO
PACKAGES = ("segpack", "train", "configs")
SIZED_PACKAGES = ("segpack", "train", "configs")
REASON = re.compile(r"#\s*optional:\s*\S")
MAX_MODULE_LINES = 450
MAX_TRAIN_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_PACK_DATASET_PARAMETERS = 12
# The floors of the house, lowest first: a module's floor is that of its longest prefix here.
FLOORS = (
    ("segpack.errors",),
    ("segpack.files", "segpack.mesh", "segpack.loss", "segpack.interop", "segpack.segments"),
    ("segpack.remote_files",),
    ("segpack.shards", "segpack.attention"),
    ("segpack.packing", "segpack.text"),
    ("segpack.data", "segpack"),
    ("segpack.bench",),
    # the commands (tokenize_baseline among them: `segpack tokenize` as it ran before, the
    # tokenize benchmark's baseline, run as a command)
    ("segpack.cli", "segpack.__main__"),
    # configs declare the keys (and the model's architecture); the trainer reads them
    ("configs",),
    # the decoder wing: the model, its rotary embeddings and layout on the mesh, every token's
    # loss, the LoRA layer and quantizer its projections use
    ("train.model",),
    # the trainer: its loop, objectives, state, data, checkpoints; the wings a run starts with
    # (Hugging Face import, adapters, preferences with their scoring command) and a finished
    # run read back (checkpoint, config, tokenizer, chat template), the rollout engine (the
    # completions and log-probs RL and evaluation train and score on), RL on its own samples
    ("train", "train.hf", "train.adapters", "train.preference", "train.runs", "train.rollout",
     "train.rl"),
    # what reads finished runs: the sampler, the export to a Hugging Face or PEFT directory
    ("train.sample", "train.export"),
    ("train.bench",),
)
# The most modules (`.py` files but `__init__.py`, which only re-exports) one folder may hold.
MAX_FOLDER_MODULES = 20


def module_files(packages: tuple[str, ...] = PACKAGES) -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of `packages`."""
  out = {}
  for package in packages:
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


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
  files = module_files(packages)
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


def module_lines(source: str) -> int:
  """Lines of a module, as an editor numbers them (a last line without a newline counts)."""
  return len(source.splitlines())


def _docstring_lines(node: ast.AST) -> set[int]:
  """The line numbers of the docstring of a function, class or module node (empty: none)."""
  body = getattr(node, "body", None) or [None]
  first = body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    return set(range(first.lineno, first.end_lineno + 1))
  return set()


def function_code_lines(source: str) -> list[tuple[str, int, int]]:
  """`(qualified name, def line, lines of code)` of every function and method of `source`.

  The lines of code are the lines of the function's span that are not blank, not only a comment
  and not inside its docstring (a `#` line inside a string is code).
  """
  lines = source.splitlines()
  comment_only = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                  if tok.type == tokenize.COMMENT
                  and not lines[tok.start[0] - 1][:tok.start[1]].strip()}
  out = []

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        skip = _docstring_lines(child) | comment_only
        count = sum(1 for n in range(child.lineno, child.end_lineno + 1)
                    if n not in skip and lines[n - 1].strip())
        out.append((prefix + child.name, child.lineno, count))
        visit(child, f"{prefix}{child.name}.")
      elif isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")
      else:
        visit(child, prefix)

  visit(ast.parse(source), "")
  return out


def function_parameters(source: str, name: str) -> tuple[int, bool]:
  """`(parameters, takes **kwargs)` of the module-level function `name` of `source`.

  The parameters are the named ones (positional, keyword-only) and `*args`; `**kwargs` is
  reported apart.
  """
  for node in ast.parse(source).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
      a = node.args
      count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
      return count, a.kwarg is not None
  raise LookupError(f"no module-level function {name!r}")


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


def test_module_lines_counts_blank_and_comment_lines():
  assert module_lines("import os\n\n# a comment\nx = 1\n") == 4
  assert module_lines("x = 1\ny = 2") == 2  # no newline at the end
  assert module_lines("x = 1\n" * (MAX_MODULE_LINES + 1)) > MAX_MODULE_LINES


def test_function_code_lines_skip_blanks_comments_and_the_docstring_only():
  source = ("def f(a,\n"            # 1: code
            "      b):\n"           # 2: code
            "  \"\"\"Doc.\n"          # 3: docstring
            "\n"                    # 4: docstring (blank too)
            "  More.\"\"\"\n"         # 5: docstring
            "  # a comment\n"       # 6: comment only
            "\n"                    # 7: blank
            "  x = a  # trailing\n"  # 8: code
            "  s = \"\"\"\n"          # 9: code
            "# in a string\n"       # 10: code (a string, not a comment)
            "\"\"\"\n"                # 11: code
            "  def g():\n"          # 12: code (f's and g's)
            "    \"\"\"G's doc.\"\"\"\n"  # 13: g's docstring, code of f
            "    return b\n"        # 14: code
            "  return x, s, g\n"    # 15: code
            "\n"
            "class C:\n"
            "  @property\n"
            "  def m(self):\n"
            "    return 1\n")
  assert function_code_lines(source) == [("f", 1, 10), ("f.g", 12, 2), ("C.m", 19, 2)]


def test_function_parameters_counts_named_ones_and_star_args_and_flags_kwargs():
  source = ("def other(a, b, c, d): pass\n"
            "def pack(source, /, x, *args, seq_len, seed=0, **deprecated):\n  pass\n"
            "class K:\n  def pack(self): pass\n")
  assert function_parameters(source, "pack") == (5, True)
  assert function_parameters("def pack(a, *, b=1):\n  pass\n", "pack") == (2, False)
  with pytest.raises(LookupError):
    function_parameters("class K:\n  def pack(self): pass\n", "pack")


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
  assert len(graph) > 50 and graph["train.model.decoder"] >= {"segpack.attention"}  # the graph is real
  cycle = find_cycle(graph)
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(module_files(SIZED_PACKAGES)))
def test_module_is_not_too_long(module):
  path = module_files(SIZED_PACKAGES)[module]
  n = module_lines(path.read_text())
  cap = module_line_cap(module)
  assert n <= cap, f"{path.relative_to(REPO)}: {n} lines, over {cap}: split it along its concerns"


def module_line_cap(module: str) -> int:
  """The most lines `module` may hold: `MAX_TRAIN_MODULE_LINES` in the trainer, else
  `MAX_MODULE_LINES`."""
  return MAX_TRAIN_MODULE_LINES if module.split(".")[0] == "train" else MAX_MODULE_LINES


def test_the_trainer_has_the_lower_line_cap():
  assert module_line_cap("train.model.decoder") == MAX_TRAIN_MODULE_LINES < MAX_MODULE_LINES
  assert module_line_cap("segpack.data.packed") == module_line_cap("configs.packed") == 450


@pytest.mark.parametrize("module", sorted(module_files(SIZED_PACKAGES)))
def test_no_function_is_too_long(module):
  path = module_files(SIZED_PACKAGES)[module]
  offenders = [(name, line, n) for name, line, n in function_code_lines(path.read_text())
               if n > MAX_FUNCTION_LINES]
  assert not offenders, (
      f"{path.relative_to(REPO)}: functions over {MAX_FUNCTION_LINES} lines of code "
      f"(name, line, lines of code): {offenders}")


def test_pack_dataset_takes_few_parameters_and_no_kwargs():
  path = REPO / "segpack" / "data" / "packed.py"
  count, kwargs = function_parameters(path.read_text(), "pack_dataset")
  assert count <= MAX_PACK_DATASET_PARAMETERS and not kwargs, (
      f"{path.relative_to(REPO)}: pack_dataset takes {count} parameters"
      f"{' and **kwargs' if kwargs else ''}; at most {MAX_PACK_DATASET_PARAMETERS} and no "
      f"**kwargs (group related options into an options object)")


def floor_of(module: str) -> int:
  """The floor of `module`: that of the longest prefix of its name in `FLOORS`."""
  best, floor = -1, None
  for level, prefixes in enumerate(FLOORS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
        best, floor = len(prefix), level
  if floor is None:
    raise AssertionError(f"{module} is on no floor of FLOORS")
  return floor


def test_floor_of_takes_the_longest_prefix():
  assert floor_of("segpack.errors") == 0 and floor_of("segpack.data.packed") == 5
  assert floor_of("segpack") == 5 and floor_of("train.model.decoder") == 9
  assert floor_of("segpack.packing.permutation") == 4 and floor_of("configs.packed") == 8
  assert floor_of("train.hf.weights") == 10 and floor_of("train.export.files") == 11


def test_no_module_imports_a_higher_floor():
  """Every import goes down the floors (or stays on one), e.g. `segpack.packing` never imports
  `segpack.data`, `segpack.bench` never imports `segpack.cli`."""
  graph = import_graph(packages=SIZED_PACKAGES)
  up = sorted(f"{a} (floor {floor_of(a)}) -> {b} (floor {floor_of(b)})"
              for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))
  assert not up, "imports up a floor:\n" + "\n".join(up)


def test_the_floor_check_sees_an_upward_import():
  """The negative controls: an import of the data floor from the packing floor is one, and so
  is a config importing the trainer (the arrow `configs.packed -> train.architecture` was)."""
  graph = {"segpack.packing.planner": {"segpack.data.options"},
           "configs.packed": {"train.model.decoder"}, "train.runs.saved": {"train.sample.decode"},
           "train.model.decoder": {"train.sharding"}}
  assert len([b for a, bs in graph.items() for b in bs if floor_of(b) > floor_of(a)]) == 4


def wing_floors(modules: list[str]) -> dict[str, set[int]]:
  """Wing (a sub-package: a folder of modules below a top package) -> the floors of the
  modules directly inside it. A top package's own modules (`segpack.errors`, `segpack.files`,
  ...) are the ground the floors stand on, not a wing."""
  out: dict[str, set[int]] = {}
  for module in modules:
    package = module.rpartition(".")[0]
    if "." in package:
      out.setdefault(package, set()).add(floor_of(module))
  return out


def test_every_wing_is_on_one_floor():
  """A package's own modules share one floor (a wing whose modules stand on two floors, as
  `train.hf` did with its import and export, is two wings); sub-packages are wings of their own."""
  modules = [m for m in module_files(SIZED_PACKAGES)
             if not module_files(SIZED_PACKAGES)[m].name == "__init__.py"]
  floors = wing_floors(modules)
  assert floors["train.model"] == {9} and floors["train.export"] == {11}  # the walk is real
  split = {p: sorted(f) for p, f in floors.items() if len(f) > 1}
  assert not split, f"wings on several floors (give each part its own wing): {split}"


def test_the_wing_check_sees_a_wing_on_two_floors():
  """The negative control: `train.hf` as it was, its import on the trainer's floor and its
  export on the floor of what reads finished runs."""
  floors = wing_floors(["train.hf.weights", "train.sample.command", "train.runs.saved",
                        "segpack.errors", "segpack.cli.main"])
  assert floors == {"train.hf": {10}, "train.sample": {11}, "train.runs": {10},
                    "segpack.cli": {7}}
  global FLOORS
  before = FLOORS
  FLOORS = before + (("train.hf.export",),)
  try:
    assert wing_floors(["train.hf.weights", "train.hf.export"]) == {"train.hf": {10, 13}}
    FLOORS = before + (("segpack.bench.tokenize_baseline",),)  # as it stood before its move
    assert wing_floors(["segpack.bench.tokenize", "segpack.bench.tokenize_baseline"]) == {
        "segpack.bench": {6, 13}}
  finally:
    FLOORS = before


def folder_sizes(packages: tuple[str, ...] = SIZED_PACKAGES) -> dict[str, int]:
  """Folder (relative to the repository) -> the modules directly inside it."""
  sizes = {}
  for package in packages:
    for folder in [REPO / package, *(p for p in (REPO / package).rglob("*") if p.is_dir())]:
      count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
      if count:
        sizes[str(folder.relative_to(REPO))] = count
  return sizes


def test_no_folder_holds_too_many_modules():
  """A folder of over `MAX_FOLDER_MODULES` modules is a flat room that wants wings (train/ had
  33 before it was split into hf/, runs/, sample/ and bench/)."""
  sizes = folder_sizes()
  assert sizes["train"] >= 10 and sizes["train/hf"] >= 3  # the walk is real
  crowded = {f: n for f, n in sizes.items() if n > MAX_FOLDER_MODULES}
  assert not crowded, f"folders over {MAX_FOLDER_MODULES} modules (give them wings): {crowded}"


def architecture_listing() -> set[str]:
  """The module paths the Layout block of docs/architecture.md lists (indentation = folder)."""
  text = (REPO / "docs" / "architecture.md").read_text()
  block = text.split("## Layout", 1)[1].split("```", 2)[1]
  listed, folders = set(), []
  for line in block.splitlines():
    match = re.match(r"^( *)(\S+)", line)
    if not match or not match.group(2).endswith(("/", ".py")):
      continue
    folders = folders[:len(match.group(1)) // 2]
    if match.group(2).endswith("/"):
      folders.append(match.group(2).rstrip("/"))
    else:
      listed.add("/".join(folders + [match.group(2)]))
  return listed


def test_docs_architecture_has_a_line_for_every_module_and_none_stale():
  listed = architecture_listing()
  actual = {str(p.relative_to(REPO)) for package in SIZED_PACKAGES
            for p in (REPO / package).rglob("*.py")}
  missing = sorted(p for p in actual - listed if not p.endswith("__init__.py"))
  assert not missing, f"modules without a line in docs/architecture.md: {missing}"
  assert not listed - actual, f"stale lines: {sorted(listed - actual)}"
  assert "segpack/errors.py" in listed and "train/rollout/engine.py" in listed  # the parser reads it
