"""The tests are in the shape of the house: `tests/` mirrors the packages.

Rules:
- every package of the code (a folder with `__init__.py` under segpack/, train/, configs/) has
  a test folder holding at least one `test_*.py`: `segpack/<p>` -> `tests/<p>`, `train/<p>` ->
  `tests/train/<p>`, `configs` -> `tests/configs`, the `segpack` package's own modules ->
  `tests/core`;
- no test file lies at the top of `tests/` (only `conftest.py`); shared helpers live in
  `tests/support/`, which holds no tests, and no test module imports another test module;
- a test file is named by what it checks, not by the project's history (no issue, round or
  session in its name).
"""

import ast
import pathlib
import re

from support import paths

TESTS = paths.REPO / "tests"
CODE = ("segpack", "train", "configs")
HISTORY = re.compile(r"round\d|issue|silent_round|session|_r\d+\b|todo", re.I)


def folder_of(package: str) -> str:
  """The test folder of a dotted package name (`segpack.data` -> `data`)."""
  parts = package.split(".")
  if parts == ["segpack"]:
    return "core"
  return "/".join(parts[1:]) if parts[0] == "segpack" else "/".join(parts)


def code_packages(root: pathlib.Path = paths.REPO) -> list[str]:
  """The dotted names of the code's packages (folders with `__init__.py`)."""
  return sorted(".".join(p.parent.relative_to(root).parts) for top in CODE
                for p in (root / top).rglob("__init__.py"))


def missing_test_folders(root: pathlib.Path = paths.REPO) -> list[str]:
  """Packages of `root` whose test folder holds no `test_*.py`."""
  return [f"{p} (tests/{folder_of(p)})" for p in code_packages(root)
          if not list((root / "tests" / folder_of(p)).glob("test_*.py"))]


def test_folder_of_maps_packages():
  assert folder_of("segpack") == "core" and folder_of("segpack.data") == "data"
  assert folder_of("train") == "train" and folder_of("train.hf") == "train/hf"
  assert folder_of("configs") == "configs"


def test_every_package_has_a_test_folder():
  assert {"segpack.attention", "train.hf", "train.runs", "configs"} <= set(code_packages())
  missing = missing_test_folders()
  assert not missing, f"packages without tests in their folder: {missing}"


def test_a_package_without_tests_is_found(tmp_path):
  """The negative control: a new package with no test folder fails the rule."""
  for folder in ("segpack/newpkg", "train", "configs", "segpack"):
    (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / folder / "__init__.py").write_text("")
  for folder in ("core", "train", "configs"):
    (tmp_path / "tests" / folder).mkdir(parents=True)
    (tmp_path / "tests" / folder / "test_x.py").write_text("")
  assert missing_test_folders(tmp_path) == ["segpack.newpkg (tests/newpkg)"]


def test_no_test_at_the_top_and_none_in_support():
  top = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
  assert not top, f"files at the top of tests/ (put them in their package's folder): {top}"
  assert not list((TESTS / "support").glob("test_*.py"))


def test_no_test_module_imports_another():
  offenders = []
  for path in TESTS.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      offenders += [f"{path.relative_to(TESTS)}: {n}" for n in names
                    if n.split(".")[-1].startswith("test_")]
  assert not offenders, f"move what is shared into tests/support/: {offenders}"


def test_test_files_are_named_by_what_they_check():
  names = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")]
  assert len(names) > 50
  assert HISTORY.search("test_silent_round2_data.py")  # the rule sees an old name
  historic = [n for n in names if HISTORY.search(pathlib.Path(n).stem)]
  assert not historic, f"name these by what they check: {historic}"
