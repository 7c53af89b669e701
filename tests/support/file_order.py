"""Longest files first: the suite's files ordered by their measured seconds, for `--dist loadfile`.

pytest-xdist's loadfile mode hands each worker whole files, in the collection's order, as the
worker runs out (with `--no-loadscope-reorder`; xdist's default reorders by how many tests a file
holds, which puts a three-test end-to-end file of two minutes last). On CI's two workers the
suite's length is then decided by its tail: a long file started last runs alone while the other
worker is idle. Ordering files longest first (the LPT rule of multiprocessor scheduling) leaves
only short files for the end:

  1. `FILE_SECONDS` (`file_seconds.json`) holds each file's seconds from a full run: the sum of
     its tests' setup, call and teardown durations.
  2. At collection, every file gets its recorded seconds; a file not recorded (a new one) gets
     `UNKNOWN_SECONDS`, so it runs early rather than last.
  3. Files are sorted by those seconds, longest first, ties in collection order; tests keep their
     order within a file. Every worker sorts the same collection from the same file, so xdist's
     check that all workers collected the same list holds.

Example: files a (3 s), b (40 s), c (new) -> b, c (`UNKNOWN_SECONDS` 10), a.

`SEGPACK_RECORD_FILE_SECONDS=PATH python -m pytest -n auto --dist loadfile tests` writes the
seconds of that run to PATH (in the controller process, from every worker's reports); copy it
over `file_seconds.json` when files have been added or have grown.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib

import pytest

from segpack.files import atomic_write_bytes

FILE_SECONDS = pathlib.Path(__file__).with_name("file_seconds.json")
UNKNOWN_SECONDS = 10.0
RECORD_ENV = "SEGPACK_RECORD_FILE_SECONDS"

_recorded: dict[str, float] = collections.defaultdict(float)


def file_of(nodeid: str) -> str:
  """`tests/a/test_b.py` of `tests/a/test_b.py::test_c[x]`."""
  return nodeid.split("::", 1)[0]


def order_longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
  """Sorts `items` in place: files by `seconds` (default `UNKNOWN_SECONDS`), longest first."""
  first_seen: dict[str, int] = {}
  for item in items:
    first_seen.setdefault(file_of(item.nodeid), len(first_seen))
  key = lambda f: (-seconds.get(f, UNKNOWN_SECONDS), first_seen[f])
  rank = {f: i for i, f in enumerate(sorted(first_seen, key=key))}
  items.sort(key=lambda item: rank[file_of(item.nodeid)])  # stable: order within a file kept


def recorded_seconds() -> dict[str, float]:
  """The checked-in seconds per file; empty when the file is missing."""
  if not FILE_SECONDS.exists():
    return {}
  return {str(k): float(v) for k, v in json.loads(FILE_SECONDS.read_text()).items()}


def record(report: pytest.TestReport) -> None:
  """Adds a report's duration to its file, when `$SEGPACK_RECORD_FILE_SECONDS` is set."""
  if os.environ.get(RECORD_ENV):
    _recorded[file_of(report.nodeid)] += report.duration


def write_recorded() -> None:
  """Writes the recorded seconds to `$SEGPACK_RECORD_FILE_SECONDS`, longest first (the
  controller's call: xdist hands it every worker's reports)."""
  path = os.environ.get(RECORD_ENV)
  if not path or not _recorded:
    return
  rows = sorted(_recorded.items(), key=lambda kv: -kv[1])
  text = json.dumps({f: round(s, 1) for f, s in rows}, indent=0) + "\n"
  atomic_write_bytes(pathlib.Path(path), text.encode())
