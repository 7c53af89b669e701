"""Preference records in TRL's two shapes, read from JSONL and checked, each naming `file:line`.

- Explicit: `prompt`, `chosen`, `rejected`. Either all text (`"prompt": "2+2=", "chosen": "4",
  "rejected": "5"`), or messages: `prompt` a list of messages and `chosen`, `rejected` each a
  list holding one assistant message.
- Implicit: `chosen` and `rejected` whole conversations (lists of messages) that share every
  message but their last, an assistant message each; or two texts, whose longest common
  beginning is the prompt.

An optional `tools` field (JSON schemas) goes to the chat template with the messages.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

from segpack.text.chat import ChatFormatError, Skipped, check_text
from segpack.text.chat import files as chat_files

__all__ = ["Pair", "PairFormatError", "parse_pair", "read_pairs"]


class PairFormatError(ChatFormatError):
  """A preference record that cannot be a pair; the message starts with `file:line`."""


@dataclasses.dataclass(frozen=True)
class Pair:
  """One preference pair.

  Attributes:
    where: `file:line` of its record.
    prompt: the prompt text, or its messages.
    chosen: the chosen completion: text, or one assistant message (a dict).
    rejected: the rejected completion, as `chosen`.
    tools: the record's `tools` (None: none).
    shape: "explicit" or "implicit".
  """

  where: str
  prompt: str | list[dict[str, Any]]
  chosen: str | dict[str, Any]
  rejected: str | dict[str, Any]
  tools: Any = None
  shape: str = "explicit"

  @property
  def conversational(self) -> bool:
    return not isinstance(self.prompt, str)

  def conversation(self, which: str) -> list[dict[str, Any]]:
    """The prompt's messages followed by the `which` ("chosen" or "rejected") message."""
    return [*self.prompt, getattr(self, which)]


def _kind(value: Any) -> str:
  if isinstance(value, str):
    return "text"
  if isinstance(value, list) and all(isinstance(m, dict) for m in value):
    return "messages"
  return type(value).__name__


def _one_assistant(value: list[dict[str, Any]], field: str, where: str) -> dict[str, Any]:
  if len(value) != 1 or value[0].get("role") != "assistant":
    roles = [m.get("role") for m in value]
    raise PairFormatError(f"{where}: {field} must hold exactly one assistant message (the "
                          f"completion), got roles {roles}")
  return value[0]


def _implicit(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
  """`(prompt, chosen, rejected)` of an implicit record."""
  if isinstance(chosen, str):
    n = len(os.path.commonprefix([chosen, rejected]))
    if n == 0:
      raise PairFormatError(f"{where}: chosen and rejected share no prompt (no common "
                            f"beginning); give a `prompt` field")
    return chosen[:n], chosen[n:], rejected[n:]
  for field, conv in (("chosen", chosen), ("rejected", rejected)):
    if not conv or conv[-1].get("role") != "assistant":
      raise PairFormatError(f"{where}: {field} must end with an assistant message (the "
                            f"completion)")
  if chosen[:-1] != rejected[:-1]:
    k = next((i for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])) if a != b),
             min(len(chosen), len(rejected)) - 1)
    raise PairFormatError(f"{where}: the prompts of chosen and rejected differ (message {k}); "
                          f"a pair shares every message but the last")
  if len(chosen) < 2:
    raise PairFormatError(f"{where}: chosen and rejected hold no prompt message before their "
                          f"completions")
  return chosen[:-1], chosen[-1], rejected[-1]


def parse_pair(record: Any, *, where: str) -> Pair:
  """A `Pair` from one decoded JSONL record.

  Raises:
    PairFormatError: a missing field, mixed text and messages, a completion that is not one
      assistant message, prompts that differ, or a chosen equal to the rejected.
  """
  if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
    found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
    raise PairFormatError(f"{where}: a preference record needs `chosen` and `rejected` "
                          f"(and optionally `prompt`); found {found}")
  fields = {f: record[f] for f in ("prompt", "chosen", "rejected") if f in record}
  kinds = {f: _kind(v) for f, v in fields.items()}
  if set(kinds.values()) - {"text", "messages"} or len(set(kinds.values())) != 1:
    raise PairFormatError(f"{where}: prompt, chosen and rejected must all be text or all be "
                          f"lists of messages, got {kinds}")
  chosen, rejected = fields["chosen"], fields["rejected"]
  if "prompt" in fields:
    prompt, shape = fields["prompt"], "explicit"
    if kinds["chosen"] == "messages":
      chosen = _one_assistant(chosen, "chosen", where)
      rejected = _one_assistant(rejected, "rejected", where)
  else:
    (prompt, chosen, rejected), shape = _implicit(chosen, rejected, where), "implicit"
  if chosen == rejected:
    raise PairFormatError(f"{where}: chosen equals rejected: nothing to prefer")
  if isinstance(chosen, str) and not (chosen and rejected):
    raise PairFormatError(f"{where}: an empty completion (chosen {len(chosen)} characters, "
                          f"rejected {len(rejected)})")
  return Pair(where=where, prompt=prompt, chosen=chosen, rejected=rejected,
              tools=record.get("tools"), shape=shape)


def read_pairs(path: str | os.PathLike[str], *,
               skipped: Skipped | None = None) -> Iterator[Pair]:
  """Yields the pairs of a `.jsonl` / `.jsonl.gz` file (blank lines skipped); with `skipped`
  (`--skip-bad-lines`) a bad record is counted there and skipped.

  Raises:
    PairFormatError: a line that is not JSON or not a pair, naming `file:line`.
  """
  def parse(raw: bytes, where: str) -> Pair:
    try:
      record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise PairFormatError(f"{where}: not JSON ({e}): {raw[:80]!r}") from e
    check_text(record, raw, where=where)
    return parse_pair(record, where=where)

  for _, pair in chat_files.read_records(path, parse, skipped=skipped):
    yield pair
