"""`python -m segpack.tokenize`: tokenize text into a shard dataset (see docs/format.md).

Usage:
  python -m segpack.tokenize --input builtin --output DIR
  python -m segpack.tokenize --input a.jsonl.gz b.txt --output DIR --vocab-size 8192
  python -m segpack.tokenize --input corpus/ --output DIR --spm-model m.model --workers 8

Inputs are read in the order given (a directory: its `.txt`, `.jsonl` and `.jsonl.gz` files in
sorted order): a `.txt` file is one document (or, with `--doc-separator blank-line`, one document
per block of lines between blank lines); a `.jsonl[.gz]` line is a JSON object whose
`--text-field` is one document. JSONL conversations (`{"messages": [{"role", "content"}, ...]}`,
`--format chat`, or detected from the first line with `--format auto`) are rendered through the
chat template of `segpack.chat` and stored with a per-token loss mask (`--train-on`).
`--input builtin` (or `builtin:small`) is the built-in corpus of
this Python's docs and sources (`segpack.corpus`); it writes DIR/train and DIR/eval and copies the
SentencePiece model to DIR/spm.model.

Resuming: the document stream is deterministic, and each finished shard records the range of input
documents it holds (`segpack.shards.ShardWriter`). A rerun with the same inputs and settings keeps
the finished shards, skips their input documents without tokenizing them, and redoes the rest; a
dataset whose manifest is already written is left alone.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import fcntl
import gzip
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import shards as shards_lib
from segpack import spm as spm_lib

__all__ = ["InputFormatError", "ReadCounters", "Summary", "build_builtin", "builtin_dir",
           "builtin_tokenizer", "expand_inputs", "iter_documents", "main", "tokenize_files",
           "write_dataset"]

_LOG = logging.getLogger(__name__)
_SUFFIXES = (".txt", ".jsonl", ".jsonl.gz")
_CHUNK_BYTES = 1 << 20
_CHUNK_DOCS = 512
_DEFAULT_SHARD_TOKENS = 1 << 27
# Bump when the cached built-in shards change (not the model): a cache with another layout is
# re-tokenized (seconds), keeping its SentencePiece model (minutes).
_BUILTIN_LAYOUT = 2


class InputFormatError(ValueError):
  """An input file, line or argument is unusable; the message names it and the value."""


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
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# -----------------------------------------------------------------------------------------------
# Reading inputs.


@dataclasses.dataclass
class ReadCounters:
  """What `iter_documents` skipped: `bad_lines` (with `skip_bad_lines`)."""

  bad_lines: int = 0


def expand_inputs(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
  """Input files in order: a directory contributes its supported files, sorted."""
  files = []
  for raw in paths:
    path = Path(raw)
    if path.is_dir():
      found = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(_SUFFIXES))
      if not found:
        raise InputFormatError(f"--input {str(path)!r}: directory holds no {'/'.join(_SUFFIXES)} "
                               f"files")
      files.extend(found)
    elif not path.exists():
      raise InputFormatError(f"--input {str(path)!r}: no such file or directory")
    elif not path.name.endswith(_SUFFIXES):
      raise InputFormatError(f"--input {str(path)!r}: unsupported file type (expected "
                             f"{', '.join(_SUFFIXES)})")
    else:
      files.append(path)
  return files


def _read_txt(path: Path, doc_separator: str) -> Iterator[str]:
  try:
    with open(path, encoding="utf-8", newline="") as f:
      if doc_separator == "file":
        yield f.read()
        return
      block: list[str] = []
      for line in f:
        if line.strip():
          block.append(line)
        elif block:
          yield "".join(block)
          block = []
      if block:
        yield "".join(block)
  except UnicodeDecodeError as e:
    raise InputFormatError(f"{path}: not UTF-8 text ({e})") from e


def _numbered_lines(f, path: Path) -> Iterator[tuple[int, bytes]]:
  """(line number, line) pairs; a corrupt or truncated gzip stream becomes an InputFormatError."""
  lineno = 0
  try:
    for lineno, raw in enumerate(f, start=1):
      yield lineno, raw
  except (OSError, EOFError, zlib.error) as e:
    raise InputFormatError(f"{path}: unreadable after line {lineno} ({type(e).__name__}: {e})"
                           ) from e


def _read_jsonl(path: Path, text_field: str, skip_bad_lines: bool,
                counters: ReadCounters) -> Iterator[str]:
  opener = gzip.open if path.name.endswith(".gz") else open
  with opener(path, "rb") as f:
    for lineno, raw in _numbered_lines(f, path):
      if not raw.strip():
        continue
      try:
        record = json.loads(raw)
        problem = None
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"not JSON ({e}): {raw[:80]!r}"
      if problem is None:
        if not isinstance(record, dict) or text_field not in record:
          found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
          problem = f"no field {text_field!r} (found: {found})"
        elif not isinstance(record[text_field], str):
          problem = (f"field {text_field!r} is {type(record[text_field]).__name__}, not a string: "
                     f"{record[text_field]!r:.80}")
      if problem is not None:
        if skip_bad_lines:
          counters.bad_lines += 1
          continue
        raise InputFormatError(f"{path}:{lineno}: {problem} (pass --skip-bad-lines to count and "
                               f"skip such lines)")
      yield record[text_field]


def iter_documents(
    files: Sequence[Path], *, doc_separator: str = "file", text_field: str = "text",
    skip_bad_lines: bool = False, counters: ReadCounters | None = None,
) -> Iterator[str]:
  """The documents of `files`, in order (see the module docstring for the formats).

  Args:
    files: input files (`expand_inputs` turns CLI paths into these).
    doc_separator: `.txt`: "file" (a file is a document) or "blank-line".
    text_field: `.jsonl[.gz]`: the field holding the text.
    skip_bad_lines: `.jsonl[.gz]`: count lines that are not JSON objects with a string
      `text_field` in `counters` and go on, instead of raising InputFormatError.
    counters: where skipped lines are counted.

  Yields:
    Document texts (possibly empty: the writer counts and skips those).
  """
  if doc_separator not in ("file", "blank-line"):
    raise InputFormatError(f"--doc-separator must be 'file' or 'blank-line', got "
                           f"{doc_separator!r}")
  counters = counters if counters is not None else ReadCounters()
  for path in files:
    if path.name.endswith(".txt"):
      yield from _read_txt(path, doc_separator)
    else:
      yield from _read_jsonl(path, text_field, skip_bad_lines, counters)


# -----------------------------------------------------------------------------------------------
# Tokenizing in worker processes.

_WORKER_TOKENIZER: spm_lib.SpmTokenizer | None = None


def _worker_init(model_file: str) -> None:
  global _WORKER_TOKENIZER
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle.
  _WORKER_TOKENIZER = spm_lib.SpmTokenizer(model_file)


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
  assert _WORKER_TOKENIZER is not None
  return _WORKER_TOKENIZER.encode_batch(texts)


def _chunks(texts: Iterator[str]) -> Iterator[tuple[list[str], int]]:
  """Groups texts into chunks of about `_CHUNK_BYTES` UTF-8 bytes (or `_CHUNK_DOCS` documents)."""
  chunk, size = [], 0
  for text in texts:
    chunk.append(text)
    size += len(text.encode("utf-8"))
    if size >= _CHUNK_BYTES or len(chunk) >= _CHUNK_DOCS:
      yield chunk, size
      chunk, size = [], 0
  if chunk:
    yield chunk, size


def _encoded_chunks(
    texts: Iterator[str], tokenizer: spm_lib.SpmTokenizer, workers: int,
) -> Iterator[tuple[list[np.ndarray], int]]:
  """Token arrays chunk by chunk, in input order; at most 2 * workers chunks in flight."""
  if workers <= 1:
    for chunk, size in _chunks(texts):
      yield tokenizer.encode_batch(chunk), size
    return
  ctx = multiprocessing.get_context("spawn")  # Safe even when JAX threads run in this process.
  with ctx.Pool(workers, initializer=_worker_init, initargs=(str(tokenizer.model_file),)) as pool:
    pending: collections.deque = collections.deque()
    for chunk, size in _chunks(texts):
      pending.append((pool.apply_async(_worker_encode, (chunk,)), size))
      if len(pending) >= 2 * workers:
        result, size0 = pending.popleft()
        yield result.get(), size0
    while pending:
      result, size0 = pending.popleft()
      yield result.get(), size0


def _progress(desc: str, enabled: bool):
  """A tqdm bar of text bytes on stderr (drawn only when stderr is a terminal)."""
  if not enabled:
    return contextlib.nullcontext(None)
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  return tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1000, dynamic_ncols=True,
              file=sys.stderr, disable=None, mininterval=0.5)


def _say(enabled: bool, message: str) -> None:
  """One status line on stderr (the first build of the built-in corpus takes minutes)."""
  if enabled:
    print(f"segpack: {message}", file=sys.stderr, flush=True)


def _counted(texts: Iterable[str], enabled: bool, desc: str) -> Iterator[str]:
  """`texts`, with a bar of documents read on stderr when `enabled` (and stderr a terminal)."""
  if not enabled:
    yield from texts
    return
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  with tqdm(desc=desc, unit=" docs", file=sys.stderr, mininterval=0.5, disable=None) as bar:
    for text in texts:
      bar.update(1)
      yield text


def write_dataset(
    texts: Iterable[str],
    output: str | os.PathLike[str],
    *,
    tokenizer: spm_lib.SpmTokenizer,
    resume_key: str,
    workers: int = 1,
    shard_tokens: int = _DEFAULT_SHARD_TOKENS,
    metadata: dict[str, Any] | None = None,
    progress: bool = False,
    overwrite: bool = False,
) -> tuple[dict[str, Any], int, int]:
  """Tokenizes `texts` into a shard dataset at `output`, resuming an interrupted run.

  Args:
    texts: the documents, in a deterministic order (a rerun must see the same stream).
    output: dataset directory.
    tokenizer: the SentencePiece tokenizer.
    resume_key: identifies the inputs and settings; shards of an interrupted run with the same
      key are kept, a complete dataset with the same key is returned as is.
    workers: tokenizer processes (1: tokenize in this process).
    shard_tokens: target tokens per shard.
    metadata: stored in the manifest, with `tokenizer` (`SpmTokenizer.describe()`: special ids
      such as `bos_id` and `eos_id` that the packing pipeline reads) added.
    progress: show a progress bar on stderr.
    overwrite: replace a complete dataset made with a different key (else InputFormatError).

  Returns:
    (manifest, shards kept from an earlier run, UTF-8 bytes of text tokenized in this run).
  """
  output = Path(output)
  manifest_path = output / shards_lib.MANIFEST_NAME
  if manifest_path.exists():
    try:
      old = json.loads(manifest_path.read_text("utf-8"))
    except ValueError:
      old = {}
    if isinstance(old, dict) and old.get("resume_key") == resume_key:
      return old, len(old.get("shards", [])), 0
    if not overwrite:
      raise InputFormatError(f"--output {str(output)!r} already holds a dataset made from other "
                             f"inputs or settings; pass --overwrite to replace it")
  texts = iter(texts)
  metadata = dict(metadata or {}, tokenizer=tokenizer.describe())
  writer = shards_lib.ShardWriter(
      output, vocab_size=tokenizer.vocab_size, tokenizer_fingerprint=tokenizer.fingerprint,
      shard_tokens=shard_tokens, metadata=metadata, resume_key=resume_key)
  for _ in range(writer.resumed_inputs):  # Documents already in kept shards.
    if next(texts, None) is None:
      raise InputFormatError(f"{output}: the kept shards hold {writer.resumed_inputs} input "
                             f"documents but the input has fewer; rerun with --overwrite")
  text_bytes = tokens = 0
  with writer, _progress(f"tokenize {output.name}", progress) as bar:
    for arrays, size in _encoded_chunks(texts, tokenizer, workers):
      for doc in arrays:
        writer.write(doc)
        tokens += doc.size
      text_bytes += size
      if bar is not None:
        bar.update(size)
        bar.set_postfix(docs=f"{writer.inputs:,}", tokens=f"{tokens:,}", refresh=False)
  manifest = json.loads(manifest_path.read_text("utf-8"))
  return manifest, writer.resumed_shards, text_bytes


def _summary(output: Path, manifest: dict[str, Any], *, resumed: int, bad_lines: int,
             seconds: float, text_bytes: int) -> Summary:
  lengths = shards_lib.ShardSource(output).lengths
  empty = lengths.size == 0
  return Summary(
      output=output, documents=int(lengths.size), tokens=int(lengths.sum()),
      dtype=manifest["dtype"], skipped_empty=manifest["skipped_empty"], bad_lines=bad_lines,
      shards=len(manifest["shards"]), resumed_shards=resumed,
      mean_length=0.0 if empty else float(lengths.mean()),
      median_length=0.0 if empty else float(np.median(lengths)),
      p99_length=0.0 if empty else float(np.percentile(lengths, 99)),
      max_length=0 if empty else int(lengths.max()), seconds=seconds, text_bytes=text_bytes)


def _resume_key(parts: dict[str, Any]) -> str:
  parts = dict(parts, format_version=shards_lib.FORMAT_VERSION)
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _file_identity(path: Path) -> list[Any]:
  st = path.stat()
  return [str(path.resolve()), st.st_size, st.st_mtime_ns]


# -----------------------------------------------------------------------------------------------
# Tokenizers, the built-in corpus and the CLI.


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
  """An exclusive advisory lock (several processes may build the same cache entry)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a+b") as f:
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _refuse_to_replace_model(model_file: Path, datasets: Sequence[Path], *,
                             overwrite: bool) -> None:
  """Raises before `model_file` is (re)written while a finished dataset beside it uses it.

  Without this, a rerun with other inputs or settings retrains (or copies) the model first and
  only then finds the dataset and refuses: the old dataset would be left with a model that no
  longer matches its `tokenizer_fingerprint`.
  """
  if overwrite:
    return
  for dataset in datasets:
    if (dataset / shards_lib.MANIFEST_NAME).exists():
      raise InputFormatError(
          f"--output {str(dataset)!r} already holds a dataset made from other inputs or "
          f"settings (its tokenizer {str(model_file)!r} would be replaced); pass --overwrite to "
          f"replace it")


def _trained_tokenizer(texts: Iterable[str], model_file: Path, *, vocab_size: int,
                       key: dict[str, Any], protect: Sequence[Path] = (),
                       overwrite: bool = True, progress: bool = False) -> spm_lib.SpmTokenizer:
  """Trains (or, when `model_file` was trained with the same `key`, reuses) a model.

  `protect`: dataset directories that use `model_file`; unless `overwrite`, training is refused
  while one of them holds a finished dataset (see `_refuse_to_replace_model`). `progress`: say on
  stderr what the training is doing (it is silent for a minute or more otherwise).
  """
  record = model_file.with_suffix(".json")
  key_hash = _resume_key(dict(key, vocab_size=vocab_size))
  if model_file.exists() and record.exists():
    try:
      if json.loads(record.read_text("utf-8")).get("key") == key_hash:
        return spm_lib.SpmTokenizer(model_file)
    except ValueError:
      pass
  _refuse_to_replace_model(model_file, protect, overwrite=overwrite)
  record.unlink(missing_ok=True)
  _LOG.info("training a SentencePiece model (%d pieces) into %s", vocab_size, model_file)
  _say(progress, f"training a SentencePiece model ({vocab_size} pieces) into {model_file}: "
       f"reading its documents, then training (about a minute on 2 cores for the full corpus)")
  start = time.perf_counter()
  tokenizer = spm_lib.train_spm(_counted(texts, progress, "read for the tokenizer"), model_file,
                                vocab_size=vocab_size)
  shards_lib.atomic_write_json(record, {"key": key_hash, "vocab_size": vocab_size,
                                         "fingerprint": tokenizer.fingerprint})
  _LOG.info("trained %s in %.1f s", model_file, time.perf_counter() - start)
  _say(progress, f"trained the SentencePiece model in {time.perf_counter() - start:.1f} s")
  return tokenizer


def builtin_dir(*, size: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
  """The cache directory of the built-in corpus of `size` for this Python."""
  from segpack import corpus  # pylint: disable=g-import-not-at-top

  if size not in corpus.SIZES:
    raise InputFormatError(f"built-in corpus size must be one of {sorted(corpus.SIZES)}, got "
                           f"{size!r}")
  return spm_lib.cache_root(cache_dir) / f"builtin-{size}-{corpus.corpus_key(size)}"


def builtin_tokenizer(*, size: str, cache_dir: str | os.PathLike[str] | None = None,
                      progress: bool = False) -> spm_lib.SpmTokenizer:
  """The cached SentencePiece model of the built-in corpus, trained on first use."""
  from segpack import corpus  # pylint: disable=g-import-not-at-top

  root = builtin_dir(size=size, cache_dir=cache_dir)
  with _file_lock(root / ".lock"):
    return _trained_tokenizer((t for _, t in corpus.builtin_documents(split="train", size=size)),
                              root / "spm.model", vocab_size=corpus.SIZES[size],
                              key={"builtin": corpus.corpus_key(size)}, progress=progress)


def _builtin_splits(output: Path, size: str, tokenizer: spm_lib.SpmTokenizer, *, workers: int,
                    shard_tokens: int, progress: bool, overwrite: bool) -> list[Summary]:
  from segpack import corpus  # pylint: disable=g-import-not-at-top

  summaries = []
  for split in ("train", "eval"):
    start = time.perf_counter()
    key = _resume_key({"builtin": corpus.corpus_key(size), "split": split,
                       "tokenizer": tokenizer.fingerprint, "shard_tokens": shard_tokens,
                       "layout": _BUILTIN_LAYOUT})
    manifest, resumed, nbytes = write_dataset(
        (text for _, text in corpus.builtin_documents(split=split, size=size)), output / split,
        tokenizer=tokenizer, resume_key=key, workers=workers, shard_tokens=shard_tokens,
        metadata={"source": f"builtin:{size}", "split": split, "python": sys.version},
        progress=progress, overwrite=overwrite)
    summaries.append(_summary(output / split, manifest, resumed=resumed, bad_lines=0,
                              seconds=time.perf_counter() - start, text_bytes=nbytes))
    _say(progress, f"tokenized the {split} split: {manifest['num_documents']:,} "
         f"documents, {manifest['num_tokens']:,} tokens in "
         f"{time.perf_counter() - start:.1f} s")
  return summaries


def _intact(root: Path) -> bool:
  """Whether both cached splits pass the structural checks and have the current layout."""
  try:
    done = json.loads((root / "complete.json").read_text("utf-8"))
    if not isinstance(done, dict) or done.get("layout") != _BUILTIN_LAYOUT:
      return False
  except (OSError, ValueError):
    return False
  try:
    shards_lib.ShardSource(root / "train")
    shards_lib.ShardSource(root / "eval")
  except shards_lib.ShardFormatError:
    return False
  return True


def build_builtin(*, size: str = "full", cache_dir: str | os.PathLike[str] | None = None,
                  workers: int | None = None, progress: bool = False):
  """Implements `segpack.corpus.ensure_builtin` (see there)."""
  from segpack import corpus  # pylint: disable=g-import-not-at-top

  root = builtin_dir(size=size, cache_dir=cache_dir)
  if progress and not (root / "complete.json").exists():
    _say(True, f"building the built-in corpus ({size}: this Python's docs and standard-library "
               f"sources) into {root}; first use only, later runs read the cache")
  tokenizer = builtin_tokenizer(size=size, cache_dir=cache_dir, progress=progress)
  with _file_lock(root / ".lock"):
    if (root / "complete.json").exists() and not _intact(root):
      _LOG.warning("cached built-in corpus %s is damaged or outdated; re-tokenizing it", root)
      for path in (root / "complete.json", root / "train" / shards_lib.MANIFEST_NAME,
                   root / "eval" / shards_lib.MANIFEST_NAME):
        path.unlink(missing_ok=True)
    if not (root / "complete.json").exists():
      _say(progress, f"tokenizing the train and eval splits with {workers or os.cpu_count()} "
                     f"worker processes")
      _builtin_splits(root, size, tokenizer, workers=workers or os.cpu_count() or 1,
                      shard_tokens=_DEFAULT_SHARD_TOKENS, progress=progress, overwrite=True)
      shards_lib.atomic_write_json(root / "complete.json", {"fingerprint": tokenizer.fingerprint,
                                                            "layout": _BUILTIN_LAYOUT})
  return corpus.BuiltinDataset(train_dir=root / "train", eval_dir=root / "eval",
                               spm_model=root / "spm.model", vocab_size=tokenizer.vocab_size)


def _copy_model(tokenizer: spm_lib.SpmTokenizer, output: Path, *,
                overwrite: bool) -> spm_lib.SpmTokenizer:
  """Copies the model to `output/spm.model` (atomically) unless it already is that file (and
  refuses to replace the model of finished `output/train`, `output/eval` without `overwrite`)."""
  target = output / "spm.model"
  if target.exists() and spm_lib.sha256_file(target) == tokenizer.fingerprint.split(":", 1)[1]:
    return spm_lib.SpmTokenizer(target)
  _refuse_to_replace_model(target, [output / "train", output / "eval"], overwrite=overwrite)
  output.mkdir(parents=True, exist_ok=True)
  shards_lib.atomic_write_bytes(target, tokenizer.model_file.read_bytes())
  return spm_lib.SpmTokenizer(target)


def tokenize_files(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    spm_model: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    doc_separator: str = "file",
    text_field: str = "text",
    skip_bad_lines: bool = False,
    workers: int | None = None,
    shard_tokens: int = _DEFAULT_SHARD_TOKENS,
    progress: bool = False,
    overwrite: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    input_format: str = "auto",
    train_on: str = "assistant",
    messages_field: str = "messages",
) -> list[Summary]:
  """The CLI as a function: tokenizes `inputs` into `output` (or its train/ and eval/).

  Returns:
    One summary per dataset written (two for `builtin`: train and eval).
  """
  output = Path(output)
  workers = (os.cpu_count() or 1) if workers is None else workers
  if not isinstance(workers, int) or workers < 1:
    raise InputFormatError(f"--workers must be a positive int, got {workers!r}")
  if not isinstance(shard_tokens, int) or shard_tokens < 1:
    raise InputFormatError(f"--shard-tokens must be a positive int, got {shard_tokens!r}")
  if spm_model is not None and vocab_size is not None:
    raise InputFormatError(f"pass --spm-model ({spm_model}) or --vocab-size ({vocab_size}), "
                           f"not both")
  builtin = [s for s in map(str, inputs) if s == "builtin" or s.startswith("builtin:")]
  if builtin:
    if len(inputs) != 1 or builtin[0] not in ("builtin", "builtin:full", "builtin:small"):
      raise InputFormatError(f"--input builtin[:full|:small] must be the only input, got "
                             f"{[str(p) for p in inputs]}")
    size = builtin[0].partition(":")[2] or "full"
    if spm_model is not None:
      tokenizer = spm_lib.SpmTokenizer(spm_model)
    elif vocab_size is not None:
      from segpack import corpus  # pylint: disable=g-import-not-at-top

      train_texts = (t for _, t in corpus.builtin_documents(split="train", size=size))
      tokenizer = _trained_tokenizer(train_texts, output / "spm.model", vocab_size=vocab_size,
                                     key={"builtin": corpus.corpus_key(size)},
                                     protect=[output / "train", output / "eval"],
                                     overwrite=overwrite)
    else:
      tokenizer = builtin_tokenizer(size=size, cache_dir=cache_dir)
    tokenizer = _copy_model(tokenizer, output, overwrite=overwrite)
    return _builtin_splits(output, size, tokenizer, workers=workers, shard_tokens=shard_tokens,
                           progress=progress, overwrite=overwrite)

  files = expand_inputs(inputs)
  if not files:
    raise InputFormatError("--input: no input files given")
  if _is_chat(files, input_format, text_field=text_field, messages_field=messages_field):
    return [_tokenize_chat(files, output, spm_model=spm_model, vocab_size=vocab_size,
                           train_on=train_on, messages_field=messages_field,
                           shard_tokens=shard_tokens, overwrite=overwrite)]
  read = dict(doc_separator=doc_separator, text_field=text_field, skip_bad_lines=skip_bad_lines)
  ident = {"inputs": [_file_identity(p) for p in files], **read}
  if spm_model is not None:
    tokenizer = spm_lib.SpmTokenizer(spm_model)
  elif vocab_size is not None:
    tokenizer = _trained_tokenizer(iter_documents(files, **read), output / "spm.model",
                                   vocab_size=vocab_size, key=ident, protect=[output],
                                   overwrite=overwrite)
  else:
    raise InputFormatError("pass --spm-model FILE or --vocab-size N (to train a model first)")
  start = time.perf_counter()
  counters = ReadCounters()
  manifest, resumed, nbytes = write_dataset(
      iter_documents(files, counters=counters, **read), output, tokenizer=tokenizer,
      resume_key=_resume_key(dict(ident, tokenizer=tokenizer.fingerprint,
                                  shard_tokens=shard_tokens)),
      workers=workers, shard_tokens=shard_tokens, progress=progress, overwrite=overwrite,
      metadata={"inputs": [str(p) for p in files], "spm_model": str(tokenizer.model_file), **read})
  return [_summary(output, manifest, resumed=resumed, bad_lines=counters.bad_lines,
                   seconds=time.perf_counter() - start, text_bytes=nbytes)]


def _is_chat(files: Sequence[Path], input_format: str, *, text_field: str,
             messages_field: str) -> bool:
  """Whether the inputs are chat conversations (`--format auto`: the first JSONL record has
  `messages_field` and no `text_field`)."""
  if input_format not in ("auto", "text", "chat"):
    raise InputFormatError(f"--format must be auto, text or chat, got {input_format!r}")
  if input_format != "auto":
    if input_format == "chat" and any(not p.name.endswith((".jsonl", ".jsonl.gz"))
                                      for p in files):
      raise InputFormatError(f"--format chat reads .jsonl[.gz] files only, got "
                             f"{[str(p) for p in files]}")
    return input_format == "chat"
  first = files[0]
  if not first.name.endswith((".jsonl", ".jsonl.gz")):
    return False
  opener = gzip.open if first.name.endswith(".gz") else open
  try:
    with opener(first, "rb") as f:
      for raw in f:
        if raw.strip():
          record = json.loads(raw)
          return (isinstance(record, dict) and messages_field in record
                  and text_field not in record)
  except (OSError, EOFError, zlib.error, ValueError):
    return False  # The text reader reports what is wrong with the file.
  return False


def _tokenize_chat(files: Sequence[Path], output: Path, *, spm_model, vocab_size, train_on: str,
                   messages_field: str, shard_tokens: int, overwrite: bool) -> Summary:
  """`--format chat`: conversations to tokens + loss mask (single process; see segpack.chat)."""
  from segpack import chat  # pylint: disable=g-import-not-at-top

  def conversations():
    for path in files:
      yield from chat.read_conversations(path, messages_field=messages_field)

  ident = {"inputs": [_file_identity(p) for p in files], "format": "chat",
           "messages_field": messages_field, "train_on": train_on,
           "template": dataclasses.asdict(chat.DEFAULT_TEMPLATE)}
  if spm_model is not None:
    tokenizer = spm_lib.SpmTokenizer(spm_model)
  elif vocab_size is not None:
    texts = (m.get("content", "") for _, ms in conversations() if isinstance(ms, list)
             for m in ms if isinstance(m, dict) and isinstance(m.get("content"), str))
    model_file = output / "spm.model"
    key_hash = _resume_key(dict(ident, vocab_size=vocab_size))
    record = model_file.with_suffix(".json")
    try:
      ok = json.loads(record.read_text("utf-8")).get("key") == key_hash
    except (OSError, ValueError):
      ok = False
    if ok and model_file.exists():
      tokenizer = spm_lib.SpmTokenizer(model_file)
    else:
      _refuse_to_replace_model(model_file, [output], overwrite=overwrite)
      tokenizer = spm_lib.train_spm(texts, model_file, vocab_size=vocab_size,
                                    user_defined_symbols=list(chat.DEFAULT_TEMPLATE.markers))
      shards_lib.atomic_write_json(record, {"key": key_hash, "fingerprint": tokenizer.fingerprint})
  else:
    raise InputFormatError("pass --spm-model FILE or --vocab-size N (to train a model first)")
  encoder = chat.ChatEncoder(tokenizer, train_on=train_on)
  if not encoder.markers_are_symbols:
    _LOG.warning("%s has no chat markers as special symbols; they are encoded as text",
                 tokenizer.model_file)
  key = _resume_key(dict(ident, tokenizer=tokenizer.fingerprint, shard_tokens=shard_tokens))
  manifest_path = output / shards_lib.MANIFEST_NAME
  if manifest_path.exists() and not overwrite:
    try:
      same = json.loads(manifest_path.read_text("utf-8")).get("resume_key") == key
    except ValueError:
      same = False
    if not same:
      raise InputFormatError(f"--output {str(output)!r} already holds a dataset made from other "
                             f"inputs or settings; pass --overwrite to replace it")
  start = time.perf_counter()
  manifest = chat.write_chat_dataset(
      conversations(), output, encoder=encoder, shard_tokens=shard_tokens, resume_key=key,
      metadata={"inputs": [str(p) for p in files], "spm_model": str(tokenizer.model_file)})
  return _summary(output, manifest, resumed=0, bad_lines=0,
                  seconds=time.perf_counter() - start,
                  text_bytes=sum(p.stat().st_size for p in files))


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m segpack.tokenize",
                              description="Tokenize text into a segpack shard dataset.")
  p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                 help=".txt, .jsonl, .jsonl.gz files or directories; or builtin[:small]")
  p.add_argument("--output", required=True, metavar="DIR")
  tok = p.add_mutually_exclusive_group()
  tok.add_argument("--spm-model", metavar="FILE", help="an existing SentencePiece model")
  tok.add_argument("--vocab-size", type=int, metavar="N",
                   help="train a SentencePiece model of N pieces on the input first")
  p.add_argument("--doc-separator", choices=("file", "blank-line"), default="file",
                 help=".txt files: a file is a document, or blank lines separate documents")
  p.add_argument("--text-field", default="text", help=".jsonl: the field holding the text")
  p.add_argument("--format", choices=("auto", "text", "chat"), default="auto",
                 help="chat: .jsonl conversations with a loss mask; auto: chat when the first "
                      "record has --messages-field and no --text-field")
  p.add_argument("--train-on", choices=("assistant", "last_assistant", "all"),
                 default="assistant", help="chat: which tokens carry loss")
  p.add_argument("--messages-field", default="messages", help="chat: the field of the messages")
  p.add_argument("--skip-bad-lines", action="store_true",
                 help=".jsonl: count and skip lines that are not JSON or lack the field")
  p.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: CPUs)")
  p.add_argument("--shard-tokens", type=int, default=_DEFAULT_SHARD_TOKENS,
                 help=f"target tokens per shard (default {_DEFAULT_SHARD_TOKENS})")
  p.add_argument("--overwrite", action="store_true",
                 help="replace a complete dataset made from other inputs or settings")
  p.add_argument("--cache-dir", default=None,
                 help="cache for the built-in corpus's model (default $SEGPACK_CACHE or "
                      "~/.cache/segpack)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the CLI; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
  args = _parser().parse_args(argv)
  if not logging.getLogger().handlers:
    logging.basicConfig(level=logging.INFO, format="segpack.tokenize: %(message)s")
  try:
    summaries = tokenize_files(
        args.input, args.output, spm_model=args.spm_model, vocab_size=args.vocab_size,
        doc_separator=args.doc_separator, text_field=args.text_field,
        skip_bad_lines=args.skip_bad_lines, workers=args.workers, shard_tokens=args.shard_tokens,
        progress=not args.no_progress, overwrite=args.overwrite, cache_dir=args.cache_dir,
        input_format=args.format, train_on=args.train_on, messages_field=args.messages_field)
  except (ValueError, OSError) as e:  # InputFormatError, ShardFormatError, missing files.
    print(f"segpack.tokenize: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("segpack.tokenize: interrupted; rerun the same command to resume", file=sys.stderr)
    return 130
  for summary in summaries:
    print(summary.table())
  return 0


if __name__ == "__main__":
  sys.exit(main())
