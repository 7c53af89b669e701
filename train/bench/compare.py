"""What `python -m train.bench.revisions` compares and how it reports it: a workload's `Run`,
its parts without the measured fields (`MEASURED`, old names renamed), compared bit for bit
(`first_difference`), and the table of every workload and part with the median seconds of both
revisions.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import struct
from collections.abc import Callable
from typing import Any

# Keys of measured values, at any depth: seconds, rates, RSS (and what is derived from RSS).
MEASURED = re.compile(r"seconds|_s$|per_s|rss|peak|over_grain|speedup|mfu|draw_bytes")
# Benchmark row names renamed on purpose: old -> new (the planner of repack="epoch").
LABEL_RENAMES = {"TiePlanner": "RepackPlanner"}
MISSING = "<absent>"


@dataclasses.dataclass
class Run:
  """One workload run in one checkout: `parts` (label -> what is compared), `times` (label ->
  seconds), `wall` (seconds of the whole process) and `what` (the parts, in words)."""
  parts: dict[str, Any]
  times: dict[str, float]
  what: str
  wall: float = 0.0


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
  """Where `b` first differs from `a` (`"metrics[3].loss: 7.63 != 7.64"`), or None.

  Dicts are compared key by key (sorted; a missing key differs), lists item by item, floats bit
  for bit (a changed last bit, or -0.0 for 0.0, differs), anything else by type and `==`.
  """
  where = path or "value"
  if type(a) is not type(b):
    return f"{where}: {a!r:.80} != {b!r:.80}"
  if isinstance(a, dict):
    for key in sorted(set(a) | set(b), key=str):
      if found := first_difference(a.get(key, MISSING), b.get(key, MISSING),
                                   f"{path}.{key}" if path else str(key)):
        return found
    return None
  if isinstance(a, list):
    for i, (x, y) in enumerate(zip(a, b)):
      if found := first_difference(x, y, f"{path}[{i}]"):
        return found
    return None if len(a) == len(b) else f"{where}: {len(a)} items != {len(b)}"
  same = struct.pack("<d", a) == struct.pack("<d", b) if isinstance(a, float) else a == b
  return None if same else f"{where}: {a!r:.80} != {b!r:.80}"


def comparable(value: Any) -> Any:
  """`value` without its measured fields (`MEASURED`, at any depth), old row names renamed."""
  if isinstance(value, dict):
    return {k: comparable(v) for k, v in value.items() if not MEASURED.search(str(k))}
  if isinstance(value, list):
    return [comparable(v) for v in value]
  if isinstance(value, str):
    for old, new in LABEL_RENAMES.items():
      value = value.replace(old, new)
  return value


def stream_position(position: dict[str, Any]) -> dict[str, Any]:
  """A logged row-stream position in the state format of `segpack.data.position` (one logged in
  the earlier format, `{"epoch", "index", "rows_per_epoch"}`, is that state in rows)."""
  if set(position) != {"epoch", "index", "rows_per_epoch"}:
    return position
  return {"version": 1, "unit": "rows", "epoch": position["epoch"], "index": position["index"],
          "epoch_length": position["rows_per_epoch"]}


def _median(runs: list[tuple[str, int, Run]], label: str, time_of: Callable[[Run], Any]
            ) -> float | None:
  values = [v for which, _, run in runs if which == label and (v := time_of(run)) is not None]
  return statistics.median(values) if values else None


def _row(workload: str, compared: str, difference: str | None, identical: bool | None,
         runs: list[tuple[str, int, Run]], time_of: Callable[[Run], Any]) -> dict[str, Any]:
  before, after = _median(runs, "before", time_of), _median(runs, "after", time_of)
  return {"workload": workload, "compared": compared, "identical": identical,
          "difference": difference, "before_s": before, "after_s": after,
          "ratio": after / before if before and after is not None else None}


def _part_difference(runs: list[tuple[str, int, Run]], label: str) -> str | None:
  reference = runs[0][2].parts.get(label, MISSING)
  for which, repeat, run in runs[1:]:
    if found := first_difference(reference, run.parts.get(label, MISSING), label):
      return f"{which}, repeat {repeat + 1}: {found}"
  return None


def table_rows(runs: dict[str, list[tuple[str, int, Run]]]) -> list[dict[str, Any]]:
  """The report: per workload one row (the whole process), then one row per part or time."""
  rows = []
  for name, done in runs.items():
    if not done:
      continue
    labels = list(dict.fromkeys([label for _, _, r in done for label in r.parts] +
                                [label for _, _, r in done for label in r.times]))
    parts = []
    for label in labels:
      compared = any(label in r.parts for _, _, r in done)
      difference = _part_difference(done, label) if compared else None
      parts.append(_row(name, "  " + label, difference, (difference is None) if compared else None,
                        done, lambda r, label=label: r.times.get(label)))
    difference = next((r["difference"] for r in parts if r["difference"]), None)
    rows.append(_row(name, done[0][2].what, difference, difference is None, done,
                     lambda r: r.wall))
    rows.extend(parts)
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """The rows as an aligned text table; a differing row is followed by its first difference."""
  width = max([len(r["compared"]) for r in rows] + [8])
  lines = [f"{'workload':9} {'compared':{width}} {'same':>4} {'before s':>9} {'after s':>9} "
           f"{'after/before':>12}"]
  seconds = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
  for r in rows:
    same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    lines.append(f"{r['workload']:9} {r['compared']:{width}} {same:>4} "
                 f"{seconds(r['before_s']):>9} {seconds(r['after_s']):>9} {ratio:>12}")
    if r["difference"] and not r["compared"].startswith(" "):
      lines.append(f"{'':9}   first difference: {r['difference']}")
  return "\n".join(lines)
