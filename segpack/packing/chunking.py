"""Cutting documents into chunks that fit a row: `long_docs`, `min_len`, `overlap`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

LONG_DOCS = ("split", "truncate")


class PackingArgumentError(ValueError):
  """A packing argument is invalid; the message names the argument and echoes its value."""


@dataclasses.dataclass(frozen=True)
class Chunks:
  """Chunks in document order: chunk `i` is `length[i]` virtual slots of `doc[i]` from `start[i]`.

  Attributes:
    doc: int64 `[num_chunks]`, non-decreasing; None when it is `arange(num_chunks)` (nothing
      dropped or split).
    start: int32 `[num_chunks]`; None when all zeros (nothing split).
    length: int32 `[num_chunks]`, each in `[1, seq_len]`.
    stats: `documents`, `dropped` (by `min_len` or empty), `split` (documents cut into more than
      one chunk), `truncated` (documents cut short under `long_docs="truncate"`), `chunks`,
      `tokens` (slots the chunks occupy, repeated overlap slots included), `dropped_tokens`
      (virtual slots of dropped documents and of truncated tails).
  """

  doc: np.ndarray | None
  start: np.ndarray | None
  length: np.ndarray
  stats: dict[str, Any]


def check_lengths(lengths: Any) -> np.ndarray:
  """Returns `lengths` as an int64 1-D array, or raises naming `lengths` and the bad value."""
  arr = np.asarray(lengths)
  if arr.ndim != 1:
    raise PackingArgumentError(f"lengths must be 1-D, got shape {arr.shape}")
  if arr.size == 0:
    raise PackingArgumentError("lengths is empty: there are no documents to pack")
  if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
    raise PackingArgumentError(f"lengths must hold integers, got dtype {arr.dtype}")
  arr = arr.astype(np.int64, copy=False)
  low = int(arr.min())
  if low < 0:
    bad = int(np.argmin(arr))
    raise PackingArgumentError(f"lengths must be >= 0, got lengths[{bad}] = {low}")
  return arr


def check_args(seq_len: Any, *, long_docs: Any, min_len: Any, overlap: Any,
               extra_tokens: Any) -> None:
  """Validates the chunking arguments; each error names the argument and its value."""
  for name, value in (("seq_len", seq_len), ("min_len", min_len), ("overlap", overlap),
                      ("extra_tokens", extra_tokens)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise PackingArgumentError(f"{name} must be an int, got {value!r}")
  if seq_len < 1:
    raise PackingArgumentError(f"seq_len must be >= 1, got seq_len={seq_len}")
  if extra_tokens < 0:
    raise PackingArgumentError(f"extra_tokens must be >= 0, got extra_tokens={extra_tokens}")
  if seq_len <= extra_tokens:
    raise PackingArgumentError(
        f"seq_len={seq_len} is too small for extra_tokens={extra_tokens} (BOS/EOS): a row "
        f"must hold at least one document token besides them")
  if min_len < 0:
    raise PackingArgumentError(f"min_len must be >= 0, got min_len={min_len}")
  if not 0 <= overlap < seq_len:
    raise PackingArgumentError(
        f"overlap must be in [0, seq_len={seq_len}), got overlap={overlap}")
  if long_docs not in LONG_DOCS:
    raise PackingArgumentError(f"long_docs must be one of {list(LONG_DOCS)}, got {long_docs!r}")


def _continuations(virtual: Any, seq_len: int, overlap: int) -> Any:
  """Chunks after the first of a virtual sequence longer than `seq_len`, split with stride
  `seq_len - overlap` (an int, or an array of them): `ceil((virtual - seq_len) / stride)`."""
  return -(-(virtual - seq_len) // (seq_len - overlap))


def chunk_counts(lengths: np.ndarray, seq_len: int, *, long_docs: str = "split",
                 overlap: int = 0, extra_tokens: int = 0) -> np.ndarray:
  """Chunks of every document, vectorized (`make_chunks` without `min_len`, counted only).

  A document of `lengths[d] + extra_tokens` virtual slots has no chunk when that is 0, one when
  it fits `seq_len` or under `long_docs="truncate"`, else `1 + ceil((virtual - seq_len) /
  (seq_len - overlap))`.

  Example: seq_len 8, overlap 2, extra_tokens 2, lengths [0, 6, 7, 18]: virtual [2, 8, 9, 20],
  chunks [1, 1, 2, 3] (the 20 slots are chunks [0, 8), [6, 14), [12, 20)).

  Returns:
    int64 `[num_documents]`.
  """
  virtual = np.asarray(lengths, np.int64) + extra_tokens
  counts = (virtual > 0).astype(np.int64)
  if long_docs == "split":
    long = virtual > seq_len
    counts[long] += _continuations(virtual[long], seq_len, overlap)
  return counts


def chunk_spans(length: int, seq_len: int, *, long_docs: str = "split", overlap: int = 0,
                extra_tokens: int = 0) -> list[tuple[int, int]]:
  """`(start, slots)` of the chunks of one document, in order (what `make_chunks` cuts it into).

  Example: seq_len 8, overlap 2, extra_tokens 2, length 18: [(0, 8), (6, 8), (12, 8)].
  """
  total = int(length) + extra_tokens
  if total <= seq_len or long_docs == "truncate":
    return [(0, min(total, seq_len))] if total > 0 else []
  stride = seq_len - overlap
  return [(c * stride, min(seq_len, total - c * stride))
          for c in range(1 + _continuations(total, seq_len, overlap))]


def make_chunks(lengths: np.ndarray, seq_len: int, *, long_docs: str = "split",
                min_len: int = 0, overlap: int = 0, extra_tokens: int = 0) -> Chunks:
  """Cuts every kept document's virtual sequence into chunks of at most `seq_len` slots.

  A document `d` is a virtual sequence of `lengths[d] + extra_tokens` slots. Documents with
  `lengths[d] < min_len` or no slot at all are dropped. Under `long_docs="split"` chunk `c`
  covers virtual slots `[c * stride, c * stride + seq_len)` (clipped to the document), with
  `stride = seq_len - overlap`; so consecutive chunks share exactly `overlap` slots and the last
  chunk always brings at least one new slot. Under `"truncate"` only chunk 0 is kept.

  Args:
    lengths: int64 `[num_documents]` document lengths (validated by `check_lengths`).
    seq_len: slots per row.
    long_docs: `"split"` or `"truncate"`.
    min_len: documents shorter than this many tokens are dropped.
    overlap: slots a continuation chunk repeats.
    extra_tokens: virtual slots added to every document (BOS/EOS).

  Returns:
    The chunks in document order, with their statistics.
  """
  check_args(seq_len, long_docs=long_docs, min_len=min_len, overlap=overlap,
             extra_tokens=extra_tokens)
  virtual = lengths + extra_tokens if extra_tokens else lengths
  keep = virtual > 0
  if min_len > 0:
    keep &= lengths >= min_len
  kept = None if keep.all() else np.flatnonzero(keep)
  vkept = virtual if kept is None else virtual[kept]
  long = np.flatnonzero(vkept > seq_len)
  extra_chunks = chunk_counts(vkept[long], seq_len, long_docs=long_docs, overlap=overlap) - 1
  doc, start, length = _lay_out(kept, vkept, long, extra_chunks, seq_len, seq_len - overlap)
  tokens = int(length.sum(dtype=np.int64))
  dropped_tokens = 0 if kept is None else int(virtual[~keep].sum())
  if long_docs == "truncate":
    dropped_tokens += int((vkept[long] - seq_len).sum())
  stats = {
      "documents": int(len(lengths)),
      "dropped": 0 if kept is None else int(len(lengths) - len(kept)),
      "split": int(len(long)) if long_docs == "split" else 0,
      "truncated": int(len(long)) if long_docs == "truncate" else 0,
      "chunks": int(len(length)),
      "tokens": tokens,
      "dropped_tokens": dropped_tokens,
  }
  return Chunks(doc=doc, start=start, length=length, stats=stats)


def _lay_out(kept: np.ndarray | None, vkept: np.ndarray, long: np.ndarray,
             extra_chunks: np.ndarray, seq_len: int, stride: int
             ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray]:
  """Chunk arrays in document order; only the `long` documents get more than one chunk.

  `kept` holds the kept document indices (None: all of them), `vkept` their virtual lengths,
  `long` the positions (in `kept`) of documents longer than `seq_len`, `extra_chunks` the chunks
  each of those gets beyond its first.
  """
  n = len(vkept)
  length = np.minimum(vkept, seq_len).astype(np.int32)
  if not extra_chunks.any():
    return kept, None, length
  doc_ids = np.arange(n, dtype=np.int64) if kept is None else kept
  per_doc = np.ones(n, np.int64)
  per_doc[long] += extra_chunks
  first = np.cumsum(per_doc) - per_doc
  total = int(first[-1] + per_doc[-1])
  # Continuation chunks of the long documents, in document order.
  cont_first = np.cumsum(extra_chunks) - extra_chunks
  cont_k = (np.arange(int(extra_chunks.sum()), dtype=np.int64)
            - np.repeat(cont_first, extra_chunks) + 1)
  cont_doc = np.repeat(long, extra_chunks)
  cont_pos = first[cont_doc] + cont_k
  cont_start = cont_k * stride
  out_doc = np.empty(total, np.int64)
  out_start = np.zeros(total, np.int32)
  out_len = np.empty(total, np.int32)
  out_doc[first] = doc_ids
  out_len[first] = length
  out_doc[cont_pos] = doc_ids[cont_doc]
  out_start[cont_pos] = cont_start
  out_len[cont_pos] = np.minimum(seq_len, vkept[cont_doc] - cont_start)
  return out_doc, out_start, out_len
