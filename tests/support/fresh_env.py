"""A virtual environment holding only what `pip install ".[EXTRA]"` would install, made from the
packages of this one without a download: the requirements of pyproject.toml (the base and the
extra), then those of each installed distribution they name, transitively, markers evaluated.
Each distribution's top-level files (its RECORD) are linked into a new venv's site-packages and
the repository is put on its path by a `.pth` file, as an editable install does; everything else
installed here (torch, pytest, ...) is absent there.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from support import paths


def _project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
  project = tomllib.loads((paths.REPO / "pyproject.toml").read_text())["project"]
  texts = list(project["dependencies"])
  for extra in extras:
    texts += project["optional-dependencies"][extra]
  return [Requirement(t) for t in texts]


def closure(extras: tuple[str, ...]) -> set[str]:
  """The canonical names of the distributions `pip install ".[extras]"` installs (those present
  here; a requirement whose marker is false on this platform is left out)."""
  found: set[str] = set()
  todo = [(r, "") for r in _project_requirements(extras)]
  while todo:
    req, extra = todo.pop()
    if req.marker is not None and not req.marker.evaluate({"extra": extra}):
      continue
    name = canonicalize_name(req.name)
    new_extras = set(req.extras)
    if name in found and not new_extras:
      continue
    found.add(name)
    try:
      dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError as e:
      raise AssertionError(f"{name}, which pip install '.[{','.join(extras)}]' installs, is not "
                           f"installed here: install the test extra") from e
    for text in dist.requires or []:
      sub = Requirement(text)
      for e in new_extras or {""}:
        if sub.marker is None or sub.marker.evaluate({"extra": e}):
          todo.append((sub, ""))
  return found


def make(root: pathlib.Path, *, extras: tuple[str, ...], drop: tuple[str, ...] = ()) -> pathlib.Path:
  """Makes the venv at `root` with the distributions of `closure(extras)` less `drop`; returns
  its python."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                 timeout=120)
  python = root / "bin" / "python"
  purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                            "['purelib'])"], check=True, capture_output=True, text=True,
                           timeout=60).stdout.strip()
  site = pathlib.Path(purelib)
  for name in closure(extras) - {canonicalize_name(d) for d in drop}:
    dist = importlib.metadata.distribution(name)
    for top in {pathlib.Path(str(f)).parts[0] for f in dist.files or ()}:
      source = pathlib.Path(dist.locate_file(top))
      if source.exists() and not (site / top).exists() and top != "..":
        os.symlink(source, site / top)
  (site / "segpack_repo.pth").write_text(f"{paths.REPO}\n")
  return python
