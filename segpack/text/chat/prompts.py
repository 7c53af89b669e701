"""`segpack tokenize --format prompts`: prompts for RL, each with its record, to a shard dataset.

A `.jsonl` line is an object with a `prompt`: a text, or a list of messages (rendered with the
chat template and its generation prompt, as `--format chat` renders conversations: the
tokenizer's own template or segpack's; `tools` as in chat records). Every other field (`answer`,
ids, metadata) is kept for the rewards: document `i` of the dataset is prompt `i`'s ids, and
line `i` of `records.jsonl` beside the shards is its whole record. The manifest's
`metadata.prompts` counts the prompts and lists the fields every record has.

Example: `{"prompt": "What is 2+3?", "answer": "5"}` becomes one document (the prompt's ids; the
pipeline adds BOS as for text) and the record line `{"prompt": "What is 2+3?", "answer": "5"}`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import shards
from segpack.files import atomic_write_bytes
from segpack.shards.record import stored_metadata
from segpack.text import encode
from segpack.text.chat import files as chat_files
from segpack.text.chat import hf_chat
from segpack.text.chat import write as chat_write
from segpack.text.chat.template import ChatEncoder, ChatFormatError, Skipped, check_text

__all__ = ["PROMPTS_KEY", "RECORDS_NAME", "PromptFormatError", "read_prompts", "read_records",
           "tokenize_prompts"]

PROMPTS_KEY = "prompts"  # the manifest's `metadata.prompts`
RECORDS_NAME = "records.jsonl"  # the prompts' records, line i = document i


class PromptFormatError(ChatFormatError):
  """A prompts line that is not an object with a usable `prompt` (names `file:line`)."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
  """One line: where it is, its record, and whether its prompt is messages."""

  where: str
  record: dict[str, Any]

  @property
  def conversational(self) -> bool:
    return isinstance(self.record["prompt"], list)


def _parse(raw: bytes, where: str) -> PromptRecord:
  try:
    record = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise PromptFormatError(f"{where}: not JSON ({e}): {raw[:80]!r}") from e
  check_text(record, raw, where=where)
  if not isinstance(record, dict) or "prompt" not in record:
    got = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise PromptFormatError(f"{where}: a prompts record is an object with a 'prompt' (text or "
                            f"messages), got {got}")
  prompt = record["prompt"]
  if isinstance(prompt, str) and prompt.strip():
    return PromptRecord(where, record)
  if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
    return PromptRecord(where, record)
  raise PromptFormatError(f"{where}: 'prompt' must be a non-empty text or a list of messages, "
                          f"got {prompt!r:.80}")


def read_prompts(files: Sequence[Path], skipped: Skipped | None) -> Iterator[PromptRecord]:
  """Every file's prompts; text and message prompts are not mixed in one dataset."""
  kind = None
  for path in files:
    for _, rec in chat_files.read_records(path, _parse, skipped=skipped):
      this = "messages" if rec.conversational else "text"
      if kind is not None and this != kind:
        error = PromptFormatError(f"{rec.where}: a prompt of {this} in a dataset of {kind} "
                                  f"prompts; tokenize them separately")
        if skipped is None:
          raise error
        skipped.add(error)
        continue
      kind = this
      yield rec


def read_records(directory: str | Path) -> list[dict[str, Any]]:
  """The records of a prompts dataset, in document order."""
  path = Path(directory) / RECORDS_NAME
  with open(path, "rb") as f:
    return [json.loads(line) for line in f if line.strip()]


def _texts(rec: PromptRecord) -> list[dict[str, Any]]:
  if rec.conversational:
    return rec.record["prompt"]
  return [{"content": rec.record["prompt"]}]


def _ids(rec: PromptRecord, tokenizer, encoder) -> np.ndarray:
  if not rec.conversational:
    return np.asarray(tokenizer.encode(rec.record["prompt"]), np.int64)
  kwargs = {}
  if not isinstance(encoder, ChatEncoder):  # the tokenizer's own template renders tools
    kwargs["tools"] = rec.record.get("tools")
  return np.asarray(encoder.prompt_ids(rec.record["prompt"], where=rec.where, **kwargs), np.int64)


def _write(records: Iterator[PromptRecord], output: Path, *, tokenizer, encoder_for,
           shard_tokens: int, key: str, metadata: dict[str, Any],
           skipped: Skipped | None) -> dict[str, Any]:
  """Encodes and writes the prompts, then their records (atomically, after the shards)."""
  manifest = output / shards.MANIFEST_NAME
  kept, encoder, kind, fields = [], None, None, None
  with shards.ShardWriter(output, vocab_size=int(tokenizer.vocab_size),
                          tokenizer_fingerprint=str(tokenizer.fingerprint),
                          shard_tokens=shard_tokens, resume_key=key,
                          metadata=stored_metadata(metadata, where=manifest)) as writer:
    for rec in records:
      if rec.conversational and encoder is None:
        encoder = encoder_for()
      try:
        ids = _ids(rec, tokenizer, encoder)
      except ChatFormatError as e:
        if skipped is None:
          raise
        skipped.add(e)
        continue
      if not ids.size:
        error = PromptFormatError(f"{rec.where}: the prompt encodes to no token")
        if skipped is None:
          raise error
        skipped.add(error)
        continue
      kept.append(rec.record)
      kind = "messages" if rec.conversational else "text"
      fields = set(rec.record) if fields is None else fields & set(rec.record)
      if len(kept) > writer.resumed_inputs:
        writer.write(ids)
    parts = {PROMPTS_KEY: dict(prompts=len(kept), format=kind, fields=sorted(fields or ()),
                               skipped_prompts=skipped.count if skipped else 0)}
    if encoder is not None:
      parts["chat"] = encoder.describe()
    writer.metadata = stored_metadata(writer.metadata, where=manifest, **parts)
  lines = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in kept)
  atomic_write_bytes(output / RECORDS_NAME, lines)
  if encoder is not None and hasattr(encoder, "keep_files"):
    encoder.keep_files(output)
  return json.loads(manifest.read_text("utf-8"))


def tokenize_prompts(files: Sequence[Path], output: Path, *, given, vocab_size,
                     shard_tokens: int, overwrite: bool, skip_bad_lines: bool = False,
                     spec: str | None = None, chat_template: str = "auto",
                     options: hf_chat.ChatOptions | None = None) -> encode.Summary:
  """`--format prompts`: the prompts of `files` as documents, their records beside them.

  Raises:
    PromptFormatError: a bad line (`file:line`), unless `skip_bad_lines`.
    InputFormatError: no tokenizer, an unreadable file.
  """
  def write(records, *, tokenizer, key, skipped, metadata):
    return _write(records, output, tokenizer=tokenizer, shard_tokens=shard_tokens, key=key,
                  skipped=skipped, metadata=metadata,
                  encoder_for=lambda: chat_write.chat_encoder(
                      tokenizer, train_on="last_assistant", spec=spec,
                      chat_template=chat_template, options=options))

  done = chat_write.tokenize_records(
      files, output, kind="prompts", read=lambda skipped: read_prompts(files, skipped),
      texts=lambda r: (r.where, _texts(r)), write=write, given=given, vocab_size=vocab_size,
      shard_tokens=shard_tokens, overwrite=overwrite, skip_bad_lines=skip_bad_lines,
      chat_template=chat_template, options=options,
      complete=lambda out: (out / RECORDS_NAME).is_file())
  finished = done.manifest
  record = shards.DatasetRecord.from_manifest(finished, where=output / shards.MANIFEST_NAME)
  counts = dict(record.extra.get(PROMPTS_KEY) or {})
  summary = encode.summarize(output, finished, resumed=done.resumed, seconds=done.seconds,
                             text_bytes=sum(p.stat().st_size for p in files),
                             bad_lines=int(counts.get("skipped_prompts", 0)))
  return dataclasses.replace(summary, chat_turns=(
      f"{counts.get('prompts', 0):,} prompts of {counts.get('format')}, fields "
      f"{counts.get('fields')}"))
