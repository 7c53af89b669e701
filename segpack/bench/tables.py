"""How the benchmarks print their results: one JSON record a line, or a fixed-width table."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable


def table(head: str, rows: Iterable[str]) -> str:
  """`head`, a rule as wide as it, then the rows, one a line."""
  return "\n".join([head, "-" * len(head), *rows])


def print_results(results: list[dict[str, Any]], *, as_json: bool,
                  format_table: Callable[[list[dict[str, Any]]], str]) -> None:
  """Prints one JSON record a line with `as_json`, else `format_table(results)`.

  Args:
    results: the benchmark's records.
    as_json: the `--json` flag.
    format_table: the benchmark's table of the records.
  """
  if as_json:
    for r in results:
      print(json.dumps(r))
  else:
    print(format_table(results))
