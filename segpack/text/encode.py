"""Encoding documents into a shard dataset: worker processes, progress, the resume key.

`write_dataset` streams texts through a tokenizer (SentencePiece or a Hugging Face tokenizer.json,
see `tokenizer_spec`; in `workers` processes that rebuild it from its `spec`, chunks of about 1 MB
kept in input order) into a `segpack.shards.ShardWriter`. The workers are forked from a
server process that imported this module once (`_context`); they read plain `.jsonl` inputs
themselves, a byte range at a time (`input_ranges`), and send each chunk back as one array of
its documents' ids back to back with their lengths, which the writer appends a shard's part at
a time (`ShardWriter.write_many`), hashing as it writes. The main process thus only cuts the
inputs, writes and hashes while the workers encode. The document stream is deterministic,
and each finished shard records the range of input documents it holds: a rerun with the same
inputs and settings (the same `resume_key`) keeps the finished shards, skips their input
documents without tokenizing them, and redoes the rest; a finished dataset with the same key is
checked (`finished_dataset`) and left alone, unless `overwrite` asks for a rebuild.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tqdm

from segpack import shards as shards_lib
from segpack.shards.format import OFFSET_DTYPE, load_manifest, read_manifest
from segpack.shards.record import stored_metadata
from segpack.text import input_ranges
from segpack.text.inputs import InputFormatError
from segpack.text.tokenizers import spec as tokenizer_spec

__all__ = ["DEFAULT_SHARD_TOKENS", "STAGES", "Summary", "chunk_texts", "counted", "file_identity",
           "finished_dataset", "resume_key", "say", "summarize", "write_dataset"]

_CHUNK_BYTES = 1 << 20
_CHUNK_DOCS = 512
DEFAULT_SHARD_TOKENS = 1 << 27
# `file_identity` hashes this many bytes at each end of an input (docs/ingest.md, "Resuming").
_EDGE_BYTES = 1 << 16
# Where the parent's time goes (`write_dataset(stage_seconds=...)`, `Summary.stages`): reading the
# texts, waiting for (or, with one worker, doing) the encoding, writing the shards, hashing them.
STAGES = ("read", "encode", "write", "hash")


@dataclasses.dataclass
class Summary:
  """What a tokenization produced (printed by the CLI)."""

  output: Path
  documents: int
  tokens: int
  dtype: str
  skipped_empty: int
  bad_lines: int
  shards: int
  resumed_shards: int
  mean_length: float
  median_length: float
  p99_length: float
  max_length: int
  seconds: float
  text_bytes: int
  trained_by_role: dict[str, int] | None = None  # chat: trained tokens of each role
  chat_turns: str | None = None  # chat: samples per conversation, expansion cost, empty reasoning
  stages: dict[str, float] | None = None

  def table(self) -> str:
    rows = [
        ("dataset", str(self.output)),
        ("documents", f"{self.documents:,}"),
        ("tokens", f"{self.tokens:,}"),
        ("length mean / median / p99 / max",
         f"{self.mean_length:.1f} / {self.median_length:.0f} / {self.p99_length:.0f} / "
         f"{self.max_length}"),
        ("dtype", self.dtype),
        ("shards (kept from an earlier run)", f"{self.shards} ({self.resumed_shards})"),
        ("skipped empty documents", f"{self.skipped_empty:,}"),
        ("skipped bad lines", f"{self.bad_lines:,}"),
        ("time", f"{self.seconds:.1f} s" + (
            f" ({self.text_bytes / 1e6 / self.seconds:.1f} MB/s of text tokenized)"
            if self.seconds > 0 and self.text_bytes else "")),
    ]
    if self.trained_by_role is not None:
      rows.insert(-1, ("trained tokens by role", ", ".join(
          f"{role} {n:,}" for role, n in self.trained_by_role.items()) or "none"))
    if self.chat_turns is not None:
      rows.insert(-1, ("samples", self.chat_turns))
    if self.stages:
      rows.append(("time by stage", ", ".join(f"{k} {v:.2f} s" for k, v in self.stages.items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


_WORKER_TOKENIZER: tokenizer_spec.Tokenizer | None = None


def _worker_init(spec: str) -> None:
  global _WORKER_TOKENIZER
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  _WORKER_TOKENIZER = tokenizer_spec.from_spec(spec)


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
  assert _WORKER_TOKENIZER is not None
  started = time.perf_counter()
  tokens, lengths = _flat(_WORKER_TOKENIZER.encode_batch(texts), _WORKER_TOKENIZER.dtype)
  return tokens, lengths, {"worker_encode": time.perf_counter() - started, **_cpu()}


def _cpu() -> dict[str, Any]:
  """This worker's process id and CPU seconds so far (the run's summary adds them up)."""
  return {"pid": os.getpid(), "cpu": time.process_time()}


def _worker_read_encode(job: tuple[input_ranges.Span, ...],
                        read: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
  """A job of `input_ranges`: its parts read here, then encoded."""
  assert _WORKER_TOKENIZER is not None
  started = time.perf_counter()
  got = input_ranges.read_job(job, read)
  middle = time.perf_counter()
  tokens, lengths = _flat(_WORKER_TOKENIZER.encode_batch(got.texts), _WORKER_TOKENIZER.dtype)
  return tokens, lengths, {"worker_read": middle - started,
                           "worker_encode": time.perf_counter() - middle,
                           "text_bytes": got.text_bytes, "read": dataclasses.replace(got, texts=[]),
                           **_cpu()}


def _flat(arrays: list[np.ndarray], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
  """`(the arrays back to back, their lengths)`: one array to send and write instead of many."""
  lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
  return (np.concatenate(arrays) if arrays else np.zeros(0, dtype)), lengths


def _utf8_size(text: str) -> int:
  """The UTF-8 bytes of `text` (an ASCII string's length, without encoding it)."""
  return len(text) if text.isascii() else len(text.encode("utf-8"))


def chunk_texts(texts: Iterator[str]) -> Iterator[tuple[list[str], int]]:
  """Groups texts into chunks of about `_CHUNK_BYTES` UTF-8 bytes (or `_CHUNK_DOCS` documents)."""
  chunk, size = [], 0
  for text in texts:
    chunk.append(text)
    size += _utf8_size(text)
    if size >= _CHUNK_BYTES or len(chunk) >= _CHUNK_DOCS:
      yield chunk, size
      chunk, size = [], 0
  if chunk:
    yield chunk, size


def _timed(iterator: Iterator[Any], seconds: dict[str, float], stage: str) -> Iterator[Any]:
  """`iterator`, adding the time spent in it to `seconds[stage]`."""
  while True:
    started = time.perf_counter()
    item = next(iterator, None)
    seconds[stage] += time.perf_counter() - started
    if item is None:
      return
    yield item


def _encoded_chunks(
    texts: Iterable[str], tokenizer: tokenizer_spec.Tokenizer, workers: int,
    seconds: dict[str, float],
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
  """`(tokens back to back, lengths, text bytes)` chunk by chunk, in input order.

  With workers, at most 2 * workers chunks are in flight; the workers read `RangedInputs` that
  they can read themselves (`input_ranges`). Reading here adds to `seconds["read"]`, encoding
  here (or waiting for the workers) to `seconds["encode"]`, and the workers' own reading and
  encoding to `seconds["worker_read"]` and `seconds["worker_encode"]`.
  """
  if workers <= 1:
    for chunk, size in _timed(chunk_texts(iter(texts)), seconds, "read"):
      started = time.perf_counter()
      tokens, lengths = _flat(tokenizer.encode_batch(chunk), tokenizer.dtype)
      seconds["encode"] += time.perf_counter() - started
      yield tokens, lengths, size
    return
  ranged = texts if isinstance(texts, input_ranges.RangedInputs) and texts.by_parts else None
  if ranged is not None:
    jobs = ((_worker_read_encode, (job, ranged.read), 0)
            for job in _timed(ranged.jobs(), seconds, "read"))
  else:
    jobs = ((_worker_encode, (chunk,), size)
            for chunk, size in _timed(chunk_texts(iter(texts)), seconds, "read"))
  ctx = _context(tokenizer.spec)
  cpu: dict[int, float] = {}
  with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer.spec,)) as pool:
    pending: collections.deque = collections.deque()
    for fn, args, size in jobs:
      pending.append((pool.apply_async(fn, args), size))
      while len(pending) >= 2 * workers or (pending and pending[0][0].ready()):
        yield _result(pending.popleft(), seconds, ranged, cpu)
    while pending:
      yield _result(pending.popleft(), seconds, ranged, cpu)
  seconds["worker_cpu"] = seconds.get("worker_cpu", 0.0) + sum(cpu.values())
  if ranged is not None:
    ranged.at_end()


def _context(spec: str) -> Any:
  """Where workers come from: forked from a server process that started clean and imported this
  module (and the tokenizer's library) once (`forkserver`): safe even when JAX threads run in
  this process, and each worker starts in milliseconds instead of importing it all again, as a
  `spawn`ed one does (the fallback where there is no forkserver)."""
  if "forkserver" not in multiprocessing.get_all_start_methods():
    return multiprocessing.get_context("spawn")
  ctx = multiprocessing.get_context("forkserver")
  kind, _ = tokenizer_spec.split_spec(spec)
  ctx.set_forkserver_preload([__name__] + (["tokenizers"] if kind == "hf" else []))
  return ctx


def _result(item: tuple[Any, int], seconds: dict[str, float],
            ranged: input_ranges.RangedInputs | None,
            cpu: dict[int, float]) -> tuple[np.ndarray, np.ndarray, int]:
  """A worker's chunk when it is ready; the wait adds to `seconds["encode"]`, the worker's
  seconds to its stages, its CPU seconds so far to `cpu`, a job's counts to `ranged`'s."""
  started = time.perf_counter()
  tokens, lengths, done = item[0].get()
  seconds["encode"] += time.perf_counter() - started
  cpu[done["pid"]] = done["cpu"]
  for stage in ("worker_read", "worker_encode"):
    seconds[stage] = seconds.get(stage, 0.0) + done.get(stage, 0.0)
  if ranged is not None:
    ranged.account(done["read"])
  return tokens, lengths, done.get("text_bytes", item[1])


def _progress(desc: str, enabled: bool):
  """A tqdm bar of text bytes on stderr (drawn only when stderr is a terminal)."""
  if not enabled:
    return contextlib.nullcontext(None)
  return tqdm.tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1000, dynamic_ncols=True,
              file=sys.stderr, disable=None, mininterval=0.5)


def say(enabled: bool, message: str) -> None:
  """One status line on stderr (the first build of the built-in corpus takes minutes)."""
  if enabled:
    print(f"segpack: {message}", file=sys.stderr, flush=True)


def counted(texts: Iterable[str], enabled: bool, desc: str) -> Iterator[str]:
  """`texts`, with a bar of documents read on stderr when `enabled` (and stderr a terminal)."""
  if not enabled:
    yield from texts
    return
  with tqdm.tqdm(desc=desc, unit=" docs", file=sys.stderr, mininterval=0.5, disable=None) as bar:
    for text in texts:
      bar.update(1)
      yield text


def write_dataset(
    texts: Iterable[str],
    output: str | os.PathLike[str],
    *,
    tokenizer: tokenizer_spec.Tokenizer,
    resume_key: str,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    metadata: dict[str, Any] | None = None,
    progress: bool = False,
    overwrite: bool = False,
    stage_seconds: dict[str, float] | None = None,
) -> tuple[dict[str, Any], int, int]:
  """Tokenizes `texts` into a shard dataset at `output`, resuming an interrupted run.

  Args:
    texts: the documents, in a deterministic order (a rerun must see the same stream); an
      `input_ranges.RangedInputs` that workers can read lets them read it themselves.
    output: dataset directory.
    tokenizer: the tokenizer (`tokenizer_spec.Tokenizer`; workers rebuild it from its `spec`).
    resume_key: identifies the inputs and settings; shards of an interrupted run with the same
      key are kept, a complete dataset with the same key is returned as is.
    workers: tokenizer processes (1: tokenize in this process).
    shard_tokens: target tokens per shard.
    metadata: stored in the manifest, with `tokenizer` (`tokenizer.describe()`: special ids
      such as `bos_id` and `eos_id` that the packing pipeline reads) added.
    progress: show a progress bar on stderr.
    overwrite: rebuild the dataset, also a complete one made with the same key; without it a
      complete dataset made with another key, or with an unreadable manifest or missing or
      damaged files, raises InputFormatError (see `finished_dataset`).
    stage_seconds: when given, the seconds this process spent in each of `STAGES` are added to
      it: reading the texts (or, when workers read them, cutting the inputs into parts),
      encoding them (with workers: waiting for them), writing the shards and the manifest,
      hashing the shards; with workers also `worker_read` and `worker_encode`, the seconds
      they spent reading and encoding, summed over the workers, and `worker_cpu`, their CPU
      seconds since they started.

  Returns:
    (manifest, shards kept from an earlier run, UTF-8 bytes of text tokenized in this run).
  """
  output = Path(output)
  manifest_path = output / shards_lib.MANIFEST_NAME
  finished = finished_dataset(output, resume_key, overwrite=overwrite)
  if finished is not None:
    return finished, len(finished["shards"]), 0
  metadata = stored_metadata(metadata, where=manifest_path, tokenizer=tokenizer.describe())
  writer = shards_lib.ShardWriter(
      output, vocab_size=tokenizer.vocab_size, tokenizer_fingerprint=tokenizer.fingerprint,
      shard_tokens=shard_tokens, metadata=metadata, resume_key=resume_key)
  if writer.resumed_inputs:  # Documents already in kept shards, skipped here: read here.
    texts = iter(texts)
    for _ in range(writer.resumed_inputs):
      if next(texts, None) is None:
        raise InputFormatError(f"{output}: the kept shards hold {writer.resumed_inputs} input "
                               f"documents but the input has fewer; rerun with overwrite=True "
                               f"(--overwrite)")
  seconds = dict.fromkeys(STAGES, 0.0)
  text_bytes = tokens = 0
  with _progress(f"tokenize {output.name}", progress) as bar:
    try:
      for chunk_tokens, lengths, size in _encoded_chunks(texts, tokenizer, workers, seconds):
        started = time.perf_counter()
        writer.write_many(chunk_tokens, lengths)
        seconds["write"] += time.perf_counter() - started
        tokens += chunk_tokens.size
        text_bytes += size
        if bar is not None:
          bar.update(size)
          bar.set_postfix(docs=f"{writer.inputs:,}", tokens=f"{tokens:,}", refresh=False)
    except BaseException:
      writer.abort()
      raise
    started = time.perf_counter()
    writer.close()
    seconds["write"] += time.perf_counter() - started - writer.hash_seconds
  seconds["hash"] = writer.hash_seconds
  if stage_seconds is not None:
    for stage, value in seconds.items():
      stage_seconds[stage] = stage_seconds.get(stage, 0.0) + value
  manifest = json.loads(manifest_path.read_text("utf-8"))
  return manifest, writer.resumed_shards, text_bytes


def summarize(output: Path | str, manifest: dict[str, Any], *, resumed: int, bad_lines: int,
              seconds: float, text_bytes: int, lengths: np.ndarray | None = None,
              stages: dict[str, float] | None = None) -> Summary:
  """The run's `Summary`; `lengths` (document lengths) default to those of the dataset at
  `output` (a local directory, read without hashing its shards again: the writer hashed them as
  it wrote them; a dataset at a URL passes its own). `stages`: `write_dataset`'s seconds by
  stage, printed with the summary."""
  if lengths is None:
    lengths = shards_lib.ShardSource(output, verify="never").lengths
  empty = lengths.size == 0
  return Summary(
      output=output, documents=int(lengths.size), tokens=int(lengths.sum()),
      dtype=manifest["dtype"], skipped_empty=manifest["skipped_empty"], bad_lines=bad_lines,
      shards=len(manifest["shards"]), resumed_shards=resumed,
      mean_length=0.0 if empty else float(lengths.mean()),
      median_length=0.0 if empty else float(np.median(lengths)),
      p99_length=0.0 if empty else float(np.percentile(lengths, 99)),
      max_length=0 if empty else int(lengths.max()), seconds=seconds, text_bytes=text_bytes,
      stages=stages)


def resume_key(parts: dict[str, Any]) -> str:
  parts = dict(parts, format_version=shards_lib.FORMAT_VERSION)
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(path: Path) -> list[Any]:
  """What the resume key knows of an input file: its resolved path, size, mtime and the SHA-256
  of its first and last 64 KiB (a change elsewhere with size and mtime restored goes unseen)."""
  st = path.stat()
  return [str(path.resolve()), st.st_size, st.st_mtime_ns, _edges_sha256(path, st.st_size)]


def _edges_sha256(path: Path, size: int) -> str:
  """SHA-256 of the first and last `_EDGE_BYTES` of a file (all of it when smaller than both)."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    digest.update(f.read(_EDGE_BYTES))
    if size > _EDGE_BYTES:
      f.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
      digest.update(f.read(_EDGE_BYTES))
  return "sha256-edges:" + digest.hexdigest()


def finished_dataset(output: Path, resume_key: str, *, overwrite: bool) -> dict[str, Any] | None:
  """The checked manifest of a finished dataset with `resume_key` at `output`, to be kept as is;
  None when there is nothing to keep (no manifest, or `overwrite`: rebuild whatever is there).

  The check is the one `ShardSource` makes on open (every file's size, the offsets, and on the
  first open on this machine every file's SHA-256), with every missing or resized file listed.

  Raises:
    InputFormatError: the manifest is unreadable (naming it and why), holds another key, or files
      are missing or damaged (naming them); each says that `--overwrite` rebuilds the dataset.
  """
  manifest_path = output / shards_lib.MANIFEST_NAME
  if overwrite or not (manifest_path.exists() or manifest_path.is_symlink()):
    return None
  where = f"output={str(output)!r} (--output)"
  try:
    old = read_manifest(manifest_path)
  except shards_lib.ShardFormatError as e:
    raise InputFormatError(f"{where}: the manifest is unreadable: {e}; pass overwrite=True "
                           f"(--overwrite) to rebuild the dataset") from e
  if not isinstance(old, dict) or old.get("resume_key") != resume_key:
    raise InputFormatError(f"{where} already holds a dataset made from other inputs or "
                           f"settings; pass overwrite=True (--overwrite) to replace it")
  try:
    manifest = load_manifest(output)
    bad = _missing_or_resized(output, manifest)
    if bad:
      raise InputFormatError(f"{where} holds a finished dataset with missing or damaged files: "
                             f"{', '.join(bad)}; pass overwrite=True (--overwrite) to rebuild it")
    shards_lib.ShardSource(output)
  except shards_lib.ShardFormatError as e:
    raise InputFormatError(f"{where} holds a finished dataset that is damaged: {e}; pass "
                           f"overwrite=True (--overwrite) to rebuild it") from e
  return manifest


def _missing_or_resized(output: Path, manifest: dict[str, Any]) -> list[str]:
  """'NAME (missing)' or 'NAME (N bytes, expected M)' for each shard file that is so."""
  itemsize = np.dtype(manifest["dtype"]).itemsize
  bad = []
  for shard in manifest["shards"]:
    want = {"tokens": shard["num_tokens"] * itemsize,
            "offsets": (shard["num_documents"] + 1) * OFFSET_DTYPE.itemsize}
    if manifest.get("loss_mask"):
      want["mask"] = shard["num_tokens"]
    for kind, size in want.items():
      path = output / shard[kind]
      if not path.is_file():
        bad.append(f"{shard[kind]} (missing)")
      elif path.stat().st_size != size:
        bad.append(f"{shard[kind]} ({path.stat().st_size} bytes, expected {size})")
  return bad
