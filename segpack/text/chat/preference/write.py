"""`segpack tokenize --format preference`: preference pairs to a shard dataset.

Pair `k` is stored as documents `2k` (prompt + chosen) and `2k + 1` (prompt + rejected), each
with a loss mask on its completion; the manifest's `metadata.preference` counts the pairs, and
`metadata.chat` names the chat rendering of message pairs. `segpack.data.pairs.pack_pairs` reads it.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any, Iterator, Sequence

from segpack import shards
from segpack.shards.record import stored_metadata
from segpack.text import chat
from segpack.text import encode
from segpack.text.chat import hf_chat
from segpack.text.chat import write as chat_write
from segpack.text.chat.preference.encode import PairEncoder
from segpack.text.chat.preference.pairs import Pair, PairFormatError, read_pairs
from segpack.text.inputs import InputFormatError

__all__ = ["PREFERENCE_KEY", "tokenize_preference"]

PREFERENCE_KEY = "preference"  # the manifest's `metadata.preference`


def _pairs(files: Sequence[Path], skipped: chat.Skipped | None) -> Iterator[Pair]:
  """Every file's pairs; text and message pairs are not mixed in one dataset."""
  kind = None
  for path in files:
    try:
      for pair in read_pairs(path, skipped=skipped):
        this = "messages" if pair.conversational else "text"
        if kind is not None and this != kind:
          error = PairFormatError(f"{pair.where}: a pair of {this} in a dataset of {kind} "
                                  f"pairs; tokenize them separately")
          if skipped is None:
            raise error
          skipped.add(error)
          continue
        kind = this
        yield pair
    except (OSError, EOFError, zlib.error) as e:
      raise InputFormatError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


def _texts(pair: Pair) -> list[dict[str, Any]]:
  """A pair as messages whose contents train a tokenizer (`chat.write`'s reader)."""
  if pair.conversational:
    return [*pair.prompt, pair.chosen, pair.rejected]
  return [{"content": pair.prompt}, {"content": pair.chosen}, {"content": pair.rejected}]


@dataclasses.dataclass
class _Tally:
  pairs: int = 0
  shapes: dict[str, int] = dataclasses.field(default_factory=dict)
  prompt_tokens: int = 0
  chosen_tokens: int = 0
  rejected_tokens: int = 0
  kind: str | None = None

  def add(self, pair: Pair, chosen, rejected) -> None:
    self.pairs += 1
    self.shapes[pair.shape] = self.shapes.get(pair.shape, 0) + 1
    self.prompt_tokens += int(chosen[1].argmax())
    self.chosen_tokens += int(chosen[1].sum())
    self.rejected_tokens += int(rejected[1].sum())
    self.kind = "messages" if pair.conversational else "text"


def _encoder(tokenizer, *, spec, chat_template, options, conversational: bool) -> PairEncoder:
  if not conversational:
    return PairEncoder(tokenizer)
  return PairEncoder(tokenizer, chat_encoder=chat_write.chat_encoder(
      tokenizer, train_on="last_assistant", spec=spec, chat_template=chat_template,
      options=options))


def _write(pairs: Iterator[Pair], output: Path, *, tokenizer, encoder_for, shard_tokens: int,
           key: str, metadata: dict[str, Any], skipped: chat.Skipped | None) -> dict[str, Any]:
  """Encodes and writes the pairs (a finished dataset with `key` is returned as is)."""
  manifest = output / shards.MANIFEST_NAME
  tally, encoder, written = _Tally(), None, 0
  with shards.ShardWriter(output, vocab_size=int(tokenizer.vocab_size),
                          tokenizer_fingerprint=str(tokenizer.fingerprint),
                          shard_tokens=shard_tokens, resume_key=key, loss_mask=True,
                          metadata=stored_metadata(metadata, where=manifest)) as writer:
    for pair in pairs:
      encoder = encoder or encoder_for(pair.conversational)
      try:
        chosen, rejected = encoder.encode(pair)
      except chat.ChatFormatError as e:
        if skipped is None:
          raise
        skipped.add(e)
        continue
      tally.add(pair, chosen, rejected)
      for ids, mask in (chosen, rejected):
        written += 1
        if written > writer.resumed_inputs:
          writer.write(ids, loss_mask=mask)
    parts = {PREFERENCE_KEY: dict(
        pairs=tally.pairs, format=tally.kind, shapes=tally.shapes,
        prompt_tokens=tally.prompt_tokens, chosen_trained_tokens=tally.chosen_tokens,
        rejected_trained_tokens=tally.rejected_tokens,
        skipped_pairs=skipped.count if skipped else 0)}
    if encoder is not None and encoder.chat_encoder is not None:
      parts["chat"] = encoder.chat_encoder.describe()
    writer.metadata = stored_metadata(writer.metadata, where=manifest, **parts)
  if encoder is not None and encoder.chat_encoder is not None and hasattr(
      encoder.chat_encoder, "keep_files"):
    encoder.chat_encoder.keep_files(output)
  return json.loads(manifest.read_text("utf-8"))


def tokenize_preference(files: Sequence[Path], output: Path, *, given, vocab_size,
                        shard_tokens: int, overwrite: bool, skip_bad_lines: bool = False,
                        spec: str | None = None, chat_template: str = "auto",
                        options: hf_chat.ChatOptions | None = None) -> encode.Summary:
  """`--format preference`: the pairs of `files` as documents `2k`, `2k + 1` with loss masks.

  Raises:
    PairFormatError: a bad pair (`file:line`), unless `skip_bad_lines`.
    InputFormatError: no tokenizer, an unreadable file.
  """
  def write(pairs, *, tokenizer, key, skipped, metadata):
    return _write(pairs, output, tokenizer=tokenizer, shard_tokens=shard_tokens, key=key,
                  skipped=skipped, metadata=metadata,
                  encoder_for=lambda conversational: _encoder(
                      tokenizer, spec=spec, chat_template=chat_template, options=options,
                      conversational=conversational))

  done = chat_write.tokenize_records(
      files, output, kind="preference", read=lambda skipped: _pairs(files, skipped),
      texts=lambda p: (p.where, _texts(p)), write=write, given=given, vocab_size=vocab_size,
      shard_tokens=shard_tokens, overwrite=overwrite, skip_bad_lines=skip_bad_lines,
      chat_template=chat_template, options=options)
  finished = done.manifest
  record = shards.DatasetRecord.from_manifest(finished, where=output / shards.MANIFEST_NAME)
  counts = dict(record.extra.get(PREFERENCE_KEY) or {})
  summary = encode.summarize(output, finished, resumed=done.resumed, seconds=done.seconds,
                             text_bytes=sum(p.stat().st_size for p in files),
                             bad_lines=int(counts.get("skipped_pairs", 0)))
  line = (f"{counts.get('pairs', 0):,} pairs of {counts.get('format')} "
          f"(chosen / rejected trained tokens {counts.get('chosen_trained_tokens', 0):,} / "
          f"{counts.get('rejected_trained_tokens', 0):,})")
  return dataclasses.replace(summary, chat_turns=line)
