"""`segpack tokenize` as it was before it wrote whole chunks (commit 8471066): the baseline of
`segpack bench tokenize` and of tests/bench/test_bench_tokenize.py. `segpack tokenize` never runs it.

What the command did then, and this module does again:

- start-up: `segpack` imported every subcommand's module, the benchmarks' JAX and Grain
  included, before it parsed the command line (`BEFORE_IMPORTS`);
- workers: each chunk's documents went back as one array per document, SentencePiece's ids
  first made as Python lists and then converted (`encode_lists`);
- the parent: checked, converted, wrote and hashed one document at a time (`ShardWriter.write`);
- the summary: opened the dataset with `ShardSource(output)`, which hashed every shard again.

`write_dataset_before` and `summarize_before` are those two steps, with the signatures of
`segpack.text.encode.write_dataset` and `summarize`; `main(argv)` runs `segpack tokenize ARGV`
with them in place of the current ones (in its own process: `python -m
segpack.cli.tokenize_baseline ARGS`). The reading, the tokenizer, the writer's file format and
the manifest are the current code's, so both paths must write the same bytes.
"""

from __future__ import annotations

import collections
import importlib
import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece

from segpack import shards as shards_lib
from segpack.cli import tokenize as tokenize_cli
from segpack.text import encode
from segpack.text.inputs import InputFormatError
from segpack.text.tokenizers import spec as tokenizer_spec
from segpack.text.tokenizers import spm as spm_lib

__all__ = ["BEFORE_IMPORTS", "encode_lists", "main", "summarize_before", "write_dataset_before"]

# What `python -m segpack tokenize` imported before it parsed its flags.
BEFORE_IMPORTS = ("segpack.bench.attention", "segpack.bench.gpu_report", "segpack.bench.packing",
                  "segpack.cli.stats", "segpack.cli.tokenize")
_CHUNK_BYTES = 1 << 20
_CHUNK_DOCS = 512

_WORKER: tuple[tokenizer_spec.Tokenizer, Any] | None = None
# The current summary, which `summarize_before` feeds with the lengths it read its old way.
_SUMMARIZE = encode.summarize


def _lists_encoder(tokenizer: tokenizer_spec.Tokenizer) -> Any:
  """A SentencePiece processor of the tokenizer's model (None for other tokenizers)."""
  if isinstance(tokenizer, spm_lib.SpmTokenizer):
    return sentencepiece.SentencePieceProcessor(model_file=str(tokenizer.model_file))
  return None


def encode_lists(tokenizer: tokenizer_spec.Tokenizer, processor: Any,
                 texts: list[str]) -> list[np.ndarray]:
  """The old `encode_batch`: SentencePiece's ids as lists, converted one document at a time."""
  if processor is None:
    return tokenizer.encode_batch(texts)
  return [np.asarray(ids, dtype=tokenizer.dtype) for ids in processor.encode(list(texts))]


def _worker_init(spec: str) -> None:
  global _WORKER
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  tokenizer = tokenizer_spec.from_spec(spec)
  _WORKER = (tokenizer, _lists_encoder(tokenizer))


def _worker_encode(texts: list[str]) -> list[np.ndarray]:
  assert _WORKER is not None
  return encode_lists(*_WORKER, texts)


def _chunks(texts: Iterator[str]) -> Iterator[tuple[list[str], int]]:
  chunk, size = [], 0
  for text in texts:
    chunk.append(text)
    size += len(text.encode("utf-8"))
    if size >= _CHUNK_BYTES or len(chunk) >= _CHUNK_DOCS:
      yield chunk, size
      chunk, size = [], 0
  if chunk:
    yield chunk, size


def _encoded_chunks(texts: Iterator[str], tokenizer: tokenizer_spec.Tokenizer,
                    workers: int) -> Iterator[tuple[list[np.ndarray], int]]:
  if workers <= 1:
    processor = _lists_encoder(tokenizer)
    for chunk, size in _chunks(texts):
      yield encode_lists(tokenizer, processor, chunk), size
    return
  ctx = multiprocessing.get_context("spawn")
  with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer.spec,)) as pool:
    pending: collections.deque = collections.deque()
    for chunk, size in _chunks(texts):
      pending.append((pool.apply_async(_worker_encode, (chunk,)), size))
      if len(pending) >= 2 * workers:
        result, size0 = pending.popleft()
        yield result.get(), size0
    while pending:
      result, size0 = pending.popleft()
      yield result.get(), size0


def write_dataset_before(
    texts: Iterable[str], output: str | os.PathLike[str], *, tokenizer: tokenizer_spec.Tokenizer,
    resume_key: str, workers: int = 1, shard_tokens: int = encode.DEFAULT_SHARD_TOKENS,
    metadata: dict[str, Any] | None = None, progress: bool = False, overwrite: bool = False,
    stage_seconds: dict[str, float] | None = None,
) -> tuple[dict[str, Any], int, int]:
  """`encode.write_dataset` as it was: one `ShardWriter.write` per document. (`progress` and
  `stage_seconds` are taken and ignored: it drew no bar here and measured no stages.)"""
  del progress, stage_seconds
  output = Path(output)
  finished = encode.finished_dataset(output, resume_key, overwrite=overwrite)
  if finished is not None:
    return finished, len(finished["shards"]), 0
  texts = iter(texts)
  writer = shards_lib.ShardWriter(
      output, vocab_size=tokenizer.vocab_size, tokenizer_fingerprint=tokenizer.fingerprint,
      shard_tokens=shard_tokens, metadata=dict(metadata or {}, tokenizer=tokenizer.describe()),
      resume_key=resume_key)
  for _ in range(writer.resumed_inputs):
    if next(texts, None) is None:
      raise InputFormatError(f"{output}: the kept shards hold {writer.resumed_inputs} input "
                             f"documents but the input has fewer; rerun with --overwrite")
  text_bytes = 0
  with writer:
    for arrays, size in _encoded_chunks(texts, tokenizer, workers):
      for doc in arrays:
        writer.write(doc)
      text_bytes += size
  manifest = json.loads((output / shards_lib.MANIFEST_NAME).read_text("utf-8"))
  return manifest, writer.resumed_shards, text_bytes


def summarize_before(output: Path | str, manifest: dict[str, Any], *, resumed: int,
                     bad_lines: int, seconds: float, text_bytes: int,
                     lengths: np.ndarray | None = None,
                     stages: dict[str, float] | None = None) -> encode.Summary:
  """`encode.summarize` as it was: the lengths from `ShardSource(output)`, which hashes every
  shard on its first open on this machine."""
  del stages
  if lengths is None:
    lengths = shards_lib.ShardSource(output).lengths
  return _SUMMARIZE(output, manifest, resumed=resumed, bad_lines=bad_lines, seconds=seconds,
                    text_bytes=text_bytes, lengths=lengths)


def main(argv: Sequence[str] | None = None) -> int:
  """`segpack tokenize ARGV` as it ran before (see the module docstring); the exit status. The
  current `write_dataset` and `summarize` are put back when it returns."""
  for name in BEFORE_IMPORTS:
    importlib.import_module(name)
  current = encode.write_dataset, encode.summarize
  encode.write_dataset, encode.summarize = write_dataset_before, summarize_before
  try:
    return tokenize_cli.main(sys.argv[1:] if argv is None else list(argv))
  finally:
    encode.write_dataset, encode.summarize = current


if __name__ == "__main__":
  sys.exit(main())
