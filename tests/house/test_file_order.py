"""The suite's files run longest first (support/file_order.py), from seconds that name real files."""

import dataclasses
import json

from support import file_order
from support import paths


@dataclasses.dataclass
class _Item:
  nodeid: str


def test_files_sort_longest_first_with_unknown_files_early_and_tests_kept_in_order():
  ids = ["tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1[x]",
         "tests/b.py::t2", "tests/d.py::t1", "tests/c.py::t1[y]"]
  items = [_Item(i) for i in ids]
  seconds = {"tests/a.py": 3.0, "tests/b.py": 40.0, "tests/d.py": 3.0}
  file_order.order_longest_first(items, seconds)
  # b (40 s), c (unknown: 10 s), then a and d (3 s each) in collection order; tests keep their
  # order within a file (a sort by test id, or by file name, gets this wrong).
  assert [i.nodeid for i in items] == [
      "tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1[x]", "tests/c.py::t1[y]",
      "tests/a.py::t1", "tests/a.py::t2", "tests/d.py::t1"]
  assert file_order.UNKNOWN_SECONDS == 10.0


def test_the_recorded_seconds_name_existing_test_files_and_cover_most_of_them():
  recorded = json.loads(file_order.FILE_SECONDS.read_text())
  existing = {p.relative_to(paths.REPO).as_posix()
              for p in (paths.REPO / "tests").rglob("test_*.py")}
  assert set(recorded) <= existing, sorted(set(recorded) - existing)  # renamed or removed
  assert all(isinstance(s, float | int) and s >= 0 for s in recorded.values())
  assert len(recorded) >= 0.8 * len(existing), "re-record: see support/file_order.py"
