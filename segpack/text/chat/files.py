"""Chat data files: conversations read from JSONL, and written as a shard dataset with a loss mask.

`read_conversations` reads `{"messages": [...]}` records (one per line, `.jsonl` or `.jsonl.gz`;
a record with `tools` gives a `chat.Conversation`); `write_chat_dataset` encodes them with a
`chat.ChatEncoder` or a `segpack.text.chat.hf_chat.HfChatTemplate` into shards whose loss mask the
packing pipeline turns into label -100, and records what was stored in the manifest.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from segpack import shards
from segpack.shards.record import stored_metadata
from segpack.text.chat import ChatFormatError, Conversation, Encoded, Skipped, check_text

__all__ = ["read_conversations", "read_records", "write_chat_dataset"]


def _record(raw: bytes, where: str, messages_field: str) -> Any:
  """The messages of one JSONL line, or a `Conversation` when the record has `tools`; raises
  ChatFormatError naming `where`."""
  try:
    record = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ChatFormatError(f"{where}: not JSON ({e}): {raw[:80]!r}") from e
  check_text(record, raw, where=where)
  if not isinstance(record, dict) or messages_field not in record:
    found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
    raise ChatFormatError(f"{where}: no field {messages_field!r} (found: {found})")
  if record.get("tools") is not None:
    return Conversation(messages=record[messages_field], tools=record["tools"])
  return record[messages_field]


def read_records(path: str | os.PathLike[str], parse: Callable[[bytes, str], Any], *,
                 skipped: Skipped | None = None) -> Iterator[tuple[str, Any]]:
  """Yields `(where, parse(raw, where))` for every non-blank line of a `.jsonl` / `.jsonl.gz`
  file, `where` being "file:line"; a `ChatFormatError` of `parse` is raised, or with `skipped`
  (`--skip-bad-lines`) counted there and the line skipped."""
  path = Path(path)
  opener = gzip.open if path.name.endswith(".gz") else open
  with opener(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        value = parse(raw, where)
      except ChatFormatError as e:
        if skipped is None:
          raise
        skipped.add(e)
        continue
      yield where, value


def read_conversations(path: str | os.PathLike[str], *, messages_field: str = "messages",
                       skipped: Skipped | None = None) -> Iterator[tuple[str, Any]]:
  """Yields (where, messages) for every non-blank line of a `.jsonl` / `.jsonl.gz` file.

  `where` is "file:line"; the messages are not validated here (the encoder does). A record with a
  `tools` field gives a `Conversation` of its messages and tools.
  With `skipped` (`--skip-bad-lines`), a bad line is counted there and skipped.

  Raises:
    ChatFormatError: a line is not a JSON object with `messages_field`.
  """
  return read_records(path, lambda raw, where: _record(raw, where, messages_field),
                      skipped=skipped)


@dataclasses.dataclass
class _Tally:
  """The counts `write_chat_dataset` records in `metadata.chat`."""

  by_role: dict[str, int] = dataclasses.field(default_factory=dict)
  conversations: int = 0
  samples: int = 0
  expanded: int = 0
  stored: int = 0
  whole: int = 0
  empty_think: int = 0

  def add(self, encoded: Encoded) -> None:
    for role, n in encoded.trained_by_role.items():
      self.by_role[role] = self.by_role.get(role, 0) + n
    self.conversations += 1
    self.samples += len(encoded.samples)
    self.expanded += int(encoded.expanded)
    self.stored += encoded.stored_tokens
    self.whole += encoded.whole_tokens
    self.empty_think += encoded.empty_think_turns

  def record(self) -> dict[str, Any]:
    return {"trained_tokens_by_role": self.by_role, "conversations": self.conversations,
            "samples": self.samples, "expanded_conversations": self.expanded,
            "stored_tokens": self.stored, "whole_tokens": self.whole,
            "empty_think_turns": self.empty_think}


def write_chat_dataset(
    conversations: Iterable[tuple[str, Any]],
    output: str | os.PathLike[str],
    *,
    encoder: Any,
    shard_tokens: int = 1 << 27,
    metadata: Mapping[str, Any] | None = None,
    resume_key: str | None = None,
    skipped: Skipped | None = None,
) -> dict[str, Any]:
  """Encodes `(where, messages)` pairs into a shard dataset with a loss mask; returns the manifest.

  With a `resume_key`, a complete dataset with that key is returned as is, and the finished
  shards of an interrupted run with that key are kept (their conversations are encoded again, to
  count them, but not written). With `skipped`, a conversation the encoder refuses is counted
  there and skipped instead of stopping the run.

  Args:
    encoder: a `ChatEncoder` or a `segpack.text.chat.hf_chat.HfChatTemplate`
      (`encode_conversation`, `describe`, `tokenizer`).

  The manifest's record (`segpack.shards.record`) gets `chat`: the encoder's `describe()` plus
  `trained_tokens_by_role`, `skipped_conversations`, and the counts of expansion per turn
  (`conversations`, `samples`, `expanded_conversations`, `stored_tokens`, `whole_tokens`,
  `empty_think_turns`; `Encoded`), and `tokenizer` (the tokenizer's
  `describe()`, where `pack_dataset` finds the BOS/EOS ids) when the tokenizer has one.
  """
  manifest_path = Path(output) / shards.MANIFEST_NAME
  if resume_key is not None and manifest_path.exists():
    try:
      old = json.loads(manifest_path.read_text("utf-8"))
    except ValueError:
      old = None
    if isinstance(old, dict) and old.get("resume_key") == resume_key:
      return old  # Already complete with these inputs and settings.
  tok = encoder.tokenizer
  described = encoder.describe()
  parts: dict[str, Any] = {"chat": described}
  if hasattr(tok, "describe"):
    parts["tokenizer"] = tok.describe()
  meta = stored_metadata(metadata, where=manifest_path, **parts)
  tally = _Tally()
  with shards.ShardWriter(output, vocab_size=int(tok.vocab_size),
                          tokenizer_fingerprint=str(getattr(tok, "fingerprint", "")),
                          shard_tokens=shard_tokens, metadata=meta, resume_key=resume_key,
                          loss_mask=True) as writer:
    written = 0
    for where, conversation in conversations:
      try:
        encoded = encoder.encode_conversation(conversation, where=where)
      except ChatFormatError as e:
        if skipped is None:
          raise
        skipped.add(e)
        continue
      tally.add(encoded)
      for ids, mask in encoded.samples:
        written += 1
        if written > writer.resumed_inputs:  # else: already in a kept shard
          writer.write(ids, loss_mask=mask)
    writer.metadata = stored_metadata(writer.metadata, where=manifest_path, chat=dict(
        described, **tally.record(), skipped_conversations=skipped.count if skipped else 0))
  return json.loads((Path(output) / shards.MANIFEST_NAME).read_text("utf-8"))
