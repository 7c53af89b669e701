"""`ShardWriter`: streams documents into memory-mapped token shards, resumably and atomically."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack.errors import ArgumentError, ArgumentTypeError
from segpack.shards.format import (
    FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, OFFSET_DTYPE, OWNED_FILE, dtype_for_vocab,
    mask_name, metadata_sha256, shard_names)
from segpack.shards.record import stored_metadata


def _close_synced(f: Any) -> None:
  """Flushes the open file `f` to the disk (`os.fsync`) and closes it."""
  f.flush()
  os.fsync(f.fileno())
  f.close()


class ShardWriter:
  """Streams documents into the shards of a new dataset directory; a context manager.

  Algorithm:
    1. Open: remove the files of any earlier dataset in the directory (only names the format owns),
       unless `resume_key` is given, in which case the finished shards of an interrupted run with
       the same key are kept (checked against their done-records and checksums) and the rest is
       removed; `resumed_inputs` then tells the caller how many input documents they consumed.
    2. `write(doc)`: an empty document is counted and skipped; otherwise its tokens are appended to
       the current shard's temporary token file and its end to the shard's offsets. Once the shard
       holds `shard_tokens` tokens or more it is finished: both files are renamed to their final
       names, then a done-record (counts, checksums, the range of input documents) is written.
       A document is never split across shards, so a shard may exceed `shard_tokens` by one
       document.
    3. Close: finish the last shard, write the manifest atomically, remove the done-records. An
       exception inside the `with` block removes the temporary shard and writes no manifest.

  Example: with `shard_tokens=4`, writing [5, 6, 7], [], [8, 9], [1] gives shard 0 = tokens
  [5, 6, 7, 8, 9] offsets [0, 3, 5] and shard 1 = tokens [1] offsets [0, 1]; one empty document
  skipped; `inputs` 4.

  With `loss_mask=True` every `write` also takes a per-token mask (1 = the token is trained as a
  target, 0 = not), streamed to `shard-NNNNN.mask` (uint8) beside the token file: writing
  [5, 6, 7] with mask [0, 1, 1] adds the bytes 00 01 01.

  `write_many(tokens, lengths)` appends many documents given back to back in one array and
  writes the same files as `write` of each: the example above is `write_many([5, 6, 7, 8, 9, 1],
  [3, 0, 2, 1])`. It writes, checks and hashes each shard's part of the array at once.
  `hash_seconds` is the time spent hashing so far.
  """

  def __init__(
      self,
      path: str | os.PathLike[str],
      *,
      vocab_size: int,
      tokenizer_fingerprint: str,
      shard_tokens: int = 1 << 27,
      metadata: Mapping[str, Any] | None = None,
      resume_key: str | None = None,
      loss_mask: bool = False,
  ):
    """Opens a dataset directory for writing.

    Args:
      path: dataset directory, created when missing.
      vocab_size: tokens must lie in [0, vocab_size); also picks the dtype (`dtype_for_vocab`).
      tokenizer_fingerprint: identifies the tokenizer (e.g. the SHA-256 of its model file).
      shard_tokens: a shard is finished once it holds this many tokens (default 2**27).
      metadata: JSON-serialisable extra information stored in the manifest, through its record
        (`segpack.shards.record.stored_metadata`: a known field of the wrong type is refused
        here, before any shard is written). `metadata` may be replaced until `close`.
      resume_key: when given, keep the finished shards of an interrupted writer with the same key
        (see `resumed_inputs`); when None, start from scratch.
      loss_mask: every document comes with a per-token loss mask (`write(doc, loss_mask=...)`),
        stored in `shard-NNNNN.mask` files.
    """
    if not isinstance(shard_tokens, (int, np.integer)) or shard_tokens < 1:
      raise ArgumentError(f"ShardWriter: shard_tokens must be a positive int, got {shard_tokens!r}")
    if not isinstance(tokenizer_fingerprint, str):
      raise ArgumentTypeError(
          f"ShardWriter: tokenizer_fingerprint must be a str, got {tokenizer_fingerprint!r}")
    self.path = Path(path)
    self.vocab_size = int(vocab_size)
    self.dtype = dtype_for_vocab(vocab_size)
    self.tokenizer_fingerprint = tokenizer_fingerprint
    self.shard_tokens = int(shard_tokens)
    self.metadata = stored_metadata(metadata, where=self.path / MANIFEST_NAME)
    json.dumps(self.metadata)  # Fails early when not serialisable.
    self.resume_key = resume_key
    self.loss_mask = bool(loss_mask)
    self._open_mask: tuple[Any, Path] | None = None
    self._mask_hash = hashlib.sha256()
    self.path.mkdir(parents=True, exist_ok=True)
    self._records: list[dict[str, Any]] = []
    self.inputs = 0
    self.skipped_empty = 0
    self._closed = False
    self._open_shard: tuple[Any, Path] | None = None
    self._offsets: list[int] = [0]
    self._hash = hashlib.sha256()
    self._max_token = 0
    self._shard_input_start = 0
    self._shard_skipped = 0
    self.hash_seconds = 0.0
    self._prepare_directory()
    self.resumed_inputs = self.inputs
    self.resumed_shards = len(self._records)

  # ---------------------------------------------------------------------------------------------
  # Opening and resuming.

  def _prepare_directory(self) -> None:
    (self.path / MANIFEST_NAME).unlink(missing_ok=True)
    if self.resume_key is not None:
      self._records = self._kept_records()
    kept = set()
    for record in self._records:
      kept.update((record["tokens"], record["offsets"], shard_names(record["index"])[2]))
      if record.get("mask"):
        kept.add(record["mask"])
    for entry in os.listdir(self.path):
      if OWNED_FILE.match(entry) and entry not in kept:
        (self.path / entry).unlink()
    if self._records:
      last = self._records[-1]
      self.inputs = last["input_end"]
      self.skipped_empty = sum(r["skipped_empty"] for r in self._records)

  def _kept_records(self) -> list[dict[str, Any]]:
    """The consecutive finished shards, from 0, that an interrupted run with our key left."""
    records = []
    while True:
      tokens_name, offsets_name, done_name = shard_names(len(records))
      try:
        record = json.loads((self.path / done_name).read_text("utf-8"))
      except (OSError, ValueError):
        return records
      if (record.get("resume_key") != self.resume_key or record.get("dtype") != self.dtype.name
          or record.get("index") != len(records) or record.get("tokens") != tokens_name
          or record.get("offsets") != offsets_name or not isinstance(record.get("max_token"), int)
          or record.get("mask") != (mask_name(len(records)) if self.loss_mask else None)):
        return records
      try:
        ok = (files.sha256_file(self.path / tokens_name) == record["sha256"]["tokens"]
              and files.sha256_file(self.path / offsets_name) == record["sha256"]["offsets"]
              and (not self.loss_mask
                   or files.sha256_file(self.path / record["mask"]) == record["sha256"]["mask"]))
      except (OSError, KeyError, TypeError):
        ok = False
      if not ok:
        return records
      records.append(record)

  # ---------------------------------------------------------------------------------------------
  # Writing.

  def __enter__(self) -> ShardWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()

  def write(self, doc_tokens: Any, loss_mask: Any = None) -> None:
    """Appends one document (a 1-D array of integer token ids); empty documents are skipped.

    Args:
      doc_tokens: the token ids.
      loss_mask: required exactly when the writer was opened with `loss_mask=True`: one 0/1 value
        per token (1: the token is trained as a target).
    """
    if self._closed:
      raise ValueError(f"ShardWriter({str(self.path)!r}): write() after close()")
    mask = self._check_mask(doc_tokens, loss_mask)
    doc = np.asarray(doc_tokens)
    if doc.ndim != 1 or not (doc.dtype.kind in "iu" or doc.size == 0):
      raise ArgumentTypeError(
          f"ShardWriter({str(self.path)!r}): document {self.inputs} must be a 1-D integer array, "
          f"got dtype {doc.dtype} shape {doc.shape}")
    self.inputs += 1
    if doc.size == 0:
      self.skipped_empty += 1
      self._shard_skipped += 1
      return
    lo, hi = int(doc.min()), int(doc.max())
    if lo < 0 or hi >= self.vocab_size:
      self.inputs -= 1
      raise ArgumentError(
          f"ShardWriter({str(self.path)!r}): document {self.inputs} has token id "
          f"{lo if lo < 0 else hi} outside [0, vocab_size={self.vocab_size})")
    if self._open_shard is None:
      tokens_name = shard_names(len(self._records))[0]
      tmp = self.path / f"{tokens_name}.writing.tmp"
      self._open_shard = (open(tmp, "wb"), tmp)
    self._max_token = max(self._max_token, hi)
    data = doc.astype(self.dtype, copy=False).tobytes()
    self._open_shard[0].write(data)
    started = time.perf_counter()
    self._hash.update(data)
    self.hash_seconds += time.perf_counter() - started
    if mask is not None:
      if self._open_mask is None:
        tmp = self.path / f"{mask_name(len(self._records))}.writing.tmp"
        self._open_mask = (open(tmp, "wb"), tmp)
      mask_bytes = mask.tobytes()
      self._open_mask[0].write(mask_bytes)
      self._mask_hash.update(mask_bytes)
    self._offsets.append(self._offsets[-1] + doc.size)
    if self._offsets[-1] >= self.shard_tokens:
      self._finish_shard()

  def write_many(self, tokens: Any, lengths: Any) -> None:
    """Appends the documents `tokens[0:lengths[0]]`, `tokens[lengths[0]:lengths[0] + lengths[1]]`,
    ...: the same files as `write` of each, written a shard's part at a time.

    Args:
      tokens: 1-D integer array, the documents' token ids back to back.
      lengths: 1-D integer array, each document's token count (0: an empty document, skipped).
    """
    where = f"ShardWriter({str(self.path)!r})"
    if self._closed:
      raise ValueError(f"{where}: write_many() after close()")
    if self.loss_mask:
      raise ValueError(f"{where}: write_many() takes no loss masks; write each document with "
                       f"write(doc, loss_mask=...)")
    data, lengths = np.asarray(tokens), np.asarray(lengths)
    if lengths.size == 0:
      lengths = lengths.astype(np.int64)  # `[]` is float64 to NumPy
    if data.ndim != 1 or not (data.dtype.kind in "iu" or data.size == 0):
      raise TypeError(f"{where}: write_many() needs a 1-D integer array of tokens, got dtype "
                      f"{data.dtype} shape {data.shape}")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
      raise ValueError(f"{where}: write_many() needs a 1-D array of lengths >= 0, got "
                       f"{lengths!r:.200}")
    ends = np.cumsum(lengths, dtype=np.int64)
    if (ends[-1] if ends.size else 0) != data.size:
      raise ValueError(f"{where}: write_many() lengths sum to {int(ends[-1]) if ends.size else 0} "
                       f"but there are {data.size} tokens")
    if data.size and (int(data.min()) < 0 or int(data.max()) >= self.vocab_size):
      starts = ends - lengths
      for lo, hi in zip(starts.tolist(), ends.tolist()):  # raises at the first bad document
        self.write(data[lo:hi])
      return
    data = data.astype(self.dtype, copy=False)
    first = 0
    while first < lengths.size:
      base = int(ends[first - 1]) if first else 0
      # The document that brings the open shard to `shard_tokens` tokens closes it.
      last = int(np.searchsorted(ends, base + self.shard_tokens - self._offsets[-1]))
      stop = min(last + 1, lengths.size)
      self._append(data, lengths[first:stop], ends[first:stop], base)
      if last < lengths.size:
        self._finish_shard()
      first = stop

  def _append(self, data: np.ndarray, lengths: np.ndarray, ends: np.ndarray, base: int) -> None:
    """Appends documents with `lengths` ending at `ends` in `data` (from `base` on) to the open
    shard, none of which reaches `shard_tokens` but maybe the last."""
    empty = int(np.count_nonzero(lengths == 0))
    self.inputs += lengths.size
    self.skipped_empty += empty
    self._shard_skipped += empty
    if empty == lengths.size:
      return
    part = data[base:int(ends[-1])]
    if self._open_shard is None:
      tmp = self.path / f"{shard_names(len(self._records))[0]}.writing.tmp"
      self._open_shard = (open(tmp, "wb"), tmp)
    self._max_token = max(self._max_token, int(part.max()))
    self._open_shard[0].write(part)
    started = time.perf_counter()
    self._hash.update(part)
    self.hash_seconds += time.perf_counter() - started
    held = self._offsets[-1] - base
    self._offsets.extend((ends[lengths > 0] + held).tolist())

  def _check_mask(self, doc_tokens: Any, loss_mask: Any) -> np.ndarray | None:
    """The mask as uint8 (None without `loss_mask`); raises when it does not fit the writer."""
    where = f"ShardWriter({str(self.path)!r}): document {self.inputs}"
    if not self.loss_mask:
      if loss_mask is not None:
        raise ArgumentError(f"{where}: got a loss_mask but the writer was opened with "
                         f"loss_mask=False")
      return None
    if loss_mask is None:
      raise ArgumentError(f"{where}: the writer was opened with loss_mask=True; pass loss_mask=...")
    mask = np.asarray(loss_mask)
    size = np.shape(doc_tokens)
    if mask.shape != size:
      raise ArgumentError(f"{where}: loss_mask has shape {mask.shape}, the tokens {size}")
    if mask.size and not np.isin(mask, (0, 1)).all():
      bad = mask.reshape(-1)[~np.isin(mask.reshape(-1), (0, 1))][0].item()
      raise ArgumentError(f"{where}: loss_mask values must be 0 or 1, got {bad!r}")
    return mask.astype(np.uint8)

  def _finish_shard(self) -> None:
    assert self._open_shard is not None
    f, tmp = self._open_shard
    _close_synced(f)
    self._open_shard = None
    index = len(self._records)
    tokens_name, offsets_name, done_name = shard_names(index)
    offsets = np.asarray(self._offsets, dtype=OFFSET_DTYPE).tobytes()
    files.atomic_write_bytes(self.path / offsets_name, offsets)
    mask_file = None
    if self.loss_mask:
      assert self._open_mask is not None
      mf, mtmp = self._open_mask
      _close_synced(mf)
      self._open_mask = None
      mask_file = mask_name(index)
      os.replace(mtmp, self.path / mask_file)
    os.replace(tmp, self.path / tokens_name)
    record = {
        "index": index,
        "tokens": tokens_name,
        "offsets": offsets_name,
        "num_documents": len(self._offsets) - 1,
        "num_tokens": self._offsets[-1],
        "max_token": self._max_token,
        "sha256": {"tokens": self._hash.hexdigest(),
                   "offsets": hashlib.sha256(offsets).hexdigest()},
        "mask": mask_file,
        "dtype": self.dtype.name,
        "resume_key": self.resume_key,
        "input_start": self._shard_input_start,
        "input_end": self.inputs,
        "skipped_empty": self._shard_skipped,
    }
    if mask_file is not None:
      record["sha256"]["mask"] = self._mask_hash.hexdigest()
    files.atomic_write_json(self.path / done_name, record)
    self._records.append(record)
    self._offsets = [0]
    self._hash = hashlib.sha256()
    self._max_token = 0
    self._mask_hash = hashlib.sha256()
    self._shard_input_start = self.inputs
    self._shard_skipped = 0

  def abort(self) -> None:
    """Drops the unfinished shard and writes no manifest; finished shards stay for a resume."""
    for attr in ("_open_shard", "_open_mask"):
      if getattr(self, attr) is not None:
        f, tmp = getattr(self, attr)
        f.close()
        tmp.unlink(missing_ok=True)
        setattr(self, attr, None)
    self._closed = True

  def close(self) -> dict[str, Any]:
    """Finishes the last shard and writes the manifest; returns the manifest."""
    if self._closed:
      raise ValueError(f"ShardWriter({str(self.path)!r}): close() called twice")
    if self._open_shard is not None:
      self._finish_shard()
    self._closed = True
    keys = ("tokens", "offsets", "num_documents", "num_tokens", "sha256", "max_token") + (
        ("mask",) if self.loss_mask else ())
    shards = [{k: r[k] for k in keys} for r in self._records]
    metadata = stored_metadata(self.metadata, where=self.path / MANIFEST_NAME)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dtype": self.dtype.name,
        "byte_order": "little",
        "vocab_size": self.vocab_size,
        "tokenizer_fingerprint": self.tokenizer_fingerprint,
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "skipped_empty": self.skipped_empty,
        "inputs": self.inputs,
        "resume_key": self.resume_key,
        "metadata": metadata,
        "metadata_sha256": metadata_sha256(json.loads(json.dumps(metadata))),
        "shards": shards,
    }
    if self.loss_mask:
      manifest["loss_mask"] = True
    files.atomic_write_json(self.path / MANIFEST_NAME, manifest)
    for record in self._records:
      (self.path / shard_names(record["index"])[2]).unlink(missing_ok=True)
    return manifest
