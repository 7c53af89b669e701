"""How conversations are rendered with a model's own chat template: turns, reasoning, date, and
the template itself (`ChatOptions`, the `segpack tokenize` flags `--turns`, `--reasoning`,
`--chat-date`, `--chat-template-file`)."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from segpack.errors import ArgumentError

__all__ = ["ChatOptions", "DEFAULT_DATE", "REASONING", "TURNS"]

# `turns`: "auto" keeps a conversation whole when that trains exactly what one sample per turn
# would, else expands it; "expand" always expands; "whole" refuses a conversation it cannot keep.
TURNS = ("auto", "expand", "whole")
# `reasoning`: whether an assistant turn's reasoning block is trained.
REASONING = ("train", "mask")
# The date templates render by default: the one Llama 3.1's template writes when given none.
DEFAULT_DATE = "2024-07-26"


@dataclasses.dataclass(frozen=True)
class ChatOptions:
  """The choices of rendering with a model's own chat template (each recorded in the manifest).

  Attributes:
    turns: one of `TURNS` (`--turns`).
    reasoning: one of `REASONING` (`--reasoning`).
    date: `YYYY-MM-DD`, the date a template reads (`date_string`, `strftime_now`;
      `--chat-date`), so that rendering twice gives the same tokens.
    template_file: a Jinja file rendering instead of the tokenizer's own template
      (`--chat-template-file`, e.g. a training template with `{% generation %}` markers).
  """

  turns: str = "auto"
  reasoning: str = "train"
  date: str = DEFAULT_DATE
  template_file: str | None = None

  def __post_init__(self):
    if self.turns not in TURNS:
      raise ArgumentError(f"turns (--turns) must be one of {TURNS}, got {self.turns!r}")
    if self.reasoning not in REASONING:
      raise ArgumentError(f"reasoning (--reasoning) must be one of {REASONING}, got "
                          f"{self.reasoning!r}")
    try:
      datetime.date.fromisoformat(self.date)
    except (TypeError, ValueError) as e:
      raise ArgumentError(f"date (--chat-date) must be YYYY-MM-DD, got {self.date!r}") from e
    if self.template_file is not None and not Path(self.template_file).is_file():
      raise ArgumentError(f"template_file (--chat-template-file): {self.template_file!r} is not a "
                          f"file")

  @property
  def day(self) -> datetime.datetime:
    """`date` as a datetime at midnight (what the template's `strftime_now` formats)."""
    return datetime.datetime.combine(datetime.date.fromisoformat(self.date), datetime.time())

  @property
  def date_string(self) -> str:
    """`date` as Llama 3.x templates write it (`26 Jul 2024`)."""
    return self.day.strftime("%d %b %Y")

  def describe(self) -> dict[str, Any]:
    """The manifest's record of these choices (the template file is recorded by the template's
    own keys: its text's SHA-256 and the copy kept in the dataset)."""
    return {"turns": self.turns, "reasoning": self.reasoning, "date": self.date}
