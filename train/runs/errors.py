"""The errors of reading a finished run back (`train.runs`), whichever command reads it.

Their messages name the run's directory, checkpoint or config key and echo the value, and say
nothing of the command: `python -m train.sample` and `python -m train.export` print them as
they are, in one line with exit status 2 (`segpack.errors.command`).
"""

from __future__ import annotations

from segpack.errors import UserError


class RunError(UserError, ValueError):
  """A run directory, checkpoint, config or dataset of a run that cannot be read back."""


class NoTokenizerError(RunError):
  """The run's data has no tokenizer (`data.source="synthetic"`, or a dataset whose manifest
  names no tokenizer file): its text cannot be encoded, only its token ids read."""
