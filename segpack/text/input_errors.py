"""The error every input reader raises, and what the readers count while skipping bad records.

Kept apart from `segpack.text.inputs` so that the format readers it dispatches to (such as
`segpack.text.arrow_inputs`) can raise it without an import cycle; `segpack.text.inputs`
re-exports both names.
"""

from __future__ import annotations

import dataclasses

from segpack.errors import UserError

__all__ = ["InputFormatError", "ReadCounters"]


class InputFormatError(UserError, ValueError):
  """An input file, record or argument is unusable; the message names it and the value."""


@dataclasses.dataclass
class ReadCounters:
  """What the readers skipped: `bad_lines`, records (JSONL lines, Parquet / Arrow rows) that
  hold no usable text, counted with `skip_bad_lines` instead of raising."""

  bad_lines: int = 0
