"""Cutting documents into chunks that fit a row: the one chunking rule, set by `LongDocs`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from segpack.errors import UserError

LONG_DOC_MODES = ("split", "truncate")


@dataclasses.dataclass(frozen=True)
class LongDocs:
  """What happens to documents longer than a row, and which documents are dropped.

  Attributes:
    mode: "split" (chunks of `seq_len` slots, nothing dropped) or "truncate" (the first chunk
      only); one of `LONG_DOC_MODES`.
    overlap: slots a continuation chunk repeats from the previous chunk (no loss on them); in
      `[0, seq_len)`.
    min_len: documents with fewer tokens are dropped.
  """

  mode: str = "split"
  overlap: int = 0
  min_len: int = 0


DEFAULT_LONG_DOCS = LongDocs()


class PackingArgumentError(UserError, ValueError):
  """A packing argument is invalid; the message names the argument and echoes its value."""


# Documents (or chunks) per block of the blockwise passes: bounds their int64 temporaries.
BLOCK = 1 << 17


def index_dtype(n: int) -> type:
  """The narrowest signed dtype for indices `0..n`: int32 below 2**31, else int64."""
  return np.int32 if n < 2**31 - 1 else np.int64


def length_dtype(seq_len: int) -> type:
  """The dtype of chunk lengths `1..seq_len`: uint16 up to 65535, else int32."""
  return np.uint16 if seq_len <= 0xFFFF else np.int32


@dataclasses.dataclass(eq=False)
class Chunks:
  """Chunks in document order: chunk `i` is `length[i]` virtual slots of `doc[i]` from `start[i]`.

  Stored compactly: 2 bytes per chunk for `length` (uint16 up to seq_len 65535), the kept
  documents only when some are dropped, and the continuation chunks of split documents (the
  chunks that do not start at slot 0, a few percent); `doc` and `start` are derived from them.

  Attributes:
    length: `[num_chunks]` (`length_dtype(seq_len)`), each in `[1, seq_len]`.
    kept: None (no document dropped), or the kept document indices in increasing order (int32,
      or int64 from 2**31 documents).
    cont: int64 `[num_continuations]`, the indices of the chunks that start after slot 0, in
      increasing order (each follows the previous chunk of its document).
    cont_start: int32 `[num_continuations]`, their first virtual slots.
    stats: `documents`, `dropped` (by `min_len` or empty), `split` (documents cut into more than
      one chunk), `truncated` (documents cut short under mode "truncate"), `chunks`,
      `tokens` (slots the chunks occupy, repeated overlap slots included), `dropped_tokens`
      (virtual slots of dropped documents and of truncated tails).
  """

  length: np.ndarray
  kept: np.ndarray | None
  cont: np.ndarray
  cont_start: np.ndarray
  stats: dict[str, Any]

  def docs(self, lo: int, hi: int) -> np.ndarray:
    """The documents of chunks `lo..hi-1` (int64): chunk `c` belongs to kept document
    `c - (continuations at or before c)`."""
    idx = np.arange(lo, hi, dtype=np.int64)
    c_lo, c_hi = np.searchsorted(self.cont, [lo, hi])
    idx -= c_lo
    if c_hi > c_lo:
      step = np.zeros(hi - lo, np.int64)
      step[self.cont[c_lo:c_hi] - lo] = 1
      idx -= np.cumsum(step)
    return idx if self.kept is None else self.kept[idx].astype(np.int64)

  @property
  def doc(self) -> np.ndarray | None:
    """int64 `[num_chunks]` document of every chunk; None when it is `arange(num_chunks)`."""
    if self.kept is None and not len(self.cont):
      return None
    return self.docs(0, len(self.length))

  @property
  def start(self) -> np.ndarray | None:
    """int32 `[num_chunks]` first virtual slot of every chunk; None when all are 0."""
    if not len(self.cont):
      return None
    start = np.zeros(len(self.length), np.int32)
    start[self.cont] = self.cont_start
    return start


def check_lengths(lengths: Any) -> np.ndarray:
  """Returns `lengths` as a 1-D integer array (its own integer dtype, never copied when it is
  one), or raises naming `lengths` and the bad value."""
  arr = np.asarray(lengths)
  if arr.ndim != 1:
    raise PackingArgumentError(f"lengths must be 1-D, got shape {arr.shape}")
  if arr.size == 0:
    raise PackingArgumentError("lengths is empty: there are no documents to pack")
  if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
    raise PackingArgumentError(f"lengths must hold integers, got dtype {arr.dtype}")
  if arr.dtype == np.uint64:
    arr = arr.astype(np.int64)
  low = int(arr.min())
  if low < 0:
    bad = int(np.argmin(arr))
    raise PackingArgumentError(f"lengths must be >= 0, got lengths[{bad}] = {low}")
  return arr


def check_args(seq_len: Any, *, long_docs: Any, extra_tokens: Any) -> None:
  """Validates the chunking arguments; each error names the argument and its value."""
  if not isinstance(long_docs, LongDocs):
    raise PackingArgumentError(f"long_docs must be a LongDocs, got long_docs={long_docs!r}")
  min_len, overlap = long_docs.min_len, long_docs.overlap
  for name, value in (("seq_len", seq_len), ("long_docs.min_len", min_len),
                      ("long_docs.overlap", overlap), ("extra_tokens", extra_tokens)):
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
    raise PackingArgumentError(f"long_docs.min_len must be >= 0, got min_len={min_len}")
  if not 0 <= overlap < seq_len:
    raise PackingArgumentError(
        f"long_docs.overlap must be in [0, seq_len={seq_len}), got overlap={overlap}")
  if long_docs.mode not in LONG_DOC_MODES:
    raise PackingArgumentError(
        f"long_docs.mode must be one of {list(LONG_DOC_MODES)}, got mode={long_docs.mode!r}")


def _continuations(virtual: Any, seq_len: int, overlap: int) -> Any:
  """Chunks after the first of a virtual sequence longer than `seq_len`, split with stride
  `seq_len - overlap` (an int, or an array of them): `ceil((virtual - seq_len) / stride)`."""
  return -(-(virtual - seq_len) // (seq_len - overlap))


def chunk_counts(lengths: np.ndarray, seq_len: int, *, long_docs: LongDocs = DEFAULT_LONG_DOCS,
                 extra_tokens: int = 0) -> np.ndarray:
  """Chunks of every document, vectorized (`make_chunks` without `min_len`, counted only).

  A document of `lengths[d] + extra_tokens` virtual slots has no chunk when that is 0, one when
  it fits `seq_len` or under mode "truncate", else `1 + ceil((virtual - seq_len) /
  (seq_len - overlap))`.

  Example: seq_len 8, overlap 2, extra_tokens 2, lengths [0, 6, 7, 18]: virtual [2, 8, 9, 20],
  chunks [1, 1, 2, 3] (the 20 slots are chunks [0, 8), [6, 14), [12, 20)).

  Returns:
    int64 `[num_documents]`.
  """
  virtual = np.asarray(lengths, np.int64) + extra_tokens
  counts = (virtual > 0).astype(np.int64)
  if long_docs.mode == "split":
    long = virtual > seq_len
    counts[long] += _continuations(virtual[long], seq_len, long_docs.overlap)
  return counts


def chunk_spans(length: int, seq_len: int, *, long_docs: LongDocs = DEFAULT_LONG_DOCS,
                extra_tokens: int = 0) -> list[tuple[int, int]]:
  """`(start, slots)` of the chunks of one document, in order (what `make_chunks` cuts it into).

  Example: seq_len 8, overlap 2, extra_tokens 2, length 18: [(0, 8), (6, 8), (12, 8)].
  """
  total = int(length) + extra_tokens
  if total <= seq_len or long_docs.mode == "truncate":
    return [(0, min(total, seq_len))] if total > 0 else []
  stride = seq_len - long_docs.overlap
  return [(c * stride, min(seq_len, total - c * stride))
          for c in range(1 + _continuations(total, seq_len, long_docs.overlap))]


def make_chunks(lengths: np.ndarray, seq_len: int, *, long_docs: LongDocs = DEFAULT_LONG_DOCS,
                extra_tokens: int = 0) -> Chunks:
  """Cuts every kept document's virtual sequence into chunks of at most `seq_len` slots.

  A document `d` is a virtual sequence of `lengths[d] + extra_tokens` slots. Documents with
  `lengths[d] < long_docs.min_len` or no slot at all are dropped. Under mode "split" chunk `c`
  covers virtual slots `[c * stride, c * stride + seq_len)` (clipped to the document), with
  `stride = seq_len - long_docs.overlap`; so consecutive chunks share exactly `overlap` slots and
  the last chunk always brings at least one new slot. Under "truncate" only chunk 0 is kept.

  The documents are read in blocks of `BLOCK`, so no int64 temporary spans all of them.

  Args:
    lengths: `[num_documents]` document lengths (validated by `check_lengths`).
    seq_len: slots per row.
    long_docs: the mode ("split" or "truncate"), `overlap` (slots a continuation chunk repeats)
      and `min_len` (documents shorter than this many tokens are dropped).
    extra_tokens: virtual slots added to every document (BOS/EOS).

  Returns:
    The chunks in document order, with their statistics.
  """
  check_args(seq_len, long_docs=long_docs, extra_tokens=extra_tokens)
  mode, min_len, overlap = long_docs.mode, long_docs.min_len, long_docs.overlap
  n = len(lengths)
  sel_parts, long_parts, vlong_parts = [], [], []
  num_kept = dropped_tokens = 0
  for a in range(0, n, BLOCK):
    virtual, sel = _kept_block(lengths, a, extra_tokens=extra_tokens, min_len=min_len)
    sel_parts.append(sel)
    long = np.flatnonzero(virtual > seq_len)
    long_parts.append(long + num_kept)
    vlong_parts.append(virtual[long])
    num_kept += len(virtual)
  kept = None
  if any(sel is not None for sel in sel_parts):
    kept = _kept_docs(sel_parts, n, num_kept, index_dtype(n))
    dropped_tokens = _dropped_tokens(lengths, extra_tokens=extra_tokens, min_len=min_len)
  del sel_parts
  long, vlong = np.concatenate(long_parts), np.concatenate(vlong_parts)
  if mode == "split":
    extra_chunks = _continuations(vlong, seq_len, overlap)
  else:
    extra_chunks = np.zeros(len(long), np.int64)
    dropped_tokens += int((vlong - seq_len).sum())
  length, cont, cont_start = _lay_out(lengths, num_kept, long, vlong, extra_chunks, seq_len,
                                      seq_len - overlap, extra_tokens=extra_tokens,
                                      min_len=min_len)
  stats = {
      "documents": int(n),
      "dropped": int(n - num_kept),
      "split": int(len(long)) if mode == "split" else 0,
      "truncated": int(len(long)) if mode == "truncate" else 0,
      "chunks": int(len(length)),
      "tokens": int(length.sum(dtype=np.int64)),
      "dropped_tokens": dropped_tokens,
  }
  return Chunks(length=length, kept=kept, cont=cont, cont_start=cont_start, stats=stats)


def _kept_block(lengths: np.ndarray, a: int, *, extra_tokens: int, min_len: int
                ) -> tuple[np.ndarray, np.ndarray | None]:
  """Block `a:a + BLOCK`: int64 virtual lengths of its kept documents, and their positions in
  the block (None: all kept)."""
  block = lengths[a:a + BLOCK]
  virtual = block.astype(np.int64) + extra_tokens
  keep = virtual > 0
  if min_len > 0:
    keep &= block >= min_len
  if keep.all():
    return virtual, None
  sel = np.flatnonzero(keep)
  return virtual[sel], sel


def _dropped_tokens(lengths: np.ndarray, *, extra_tokens: int, min_len: int) -> int:
  """Virtual slots of the dropped documents."""
  total = 0
  for a in range(0, len(lengths), BLOCK):
    block = lengths[a:a + BLOCK]
    virtual = block.astype(np.int64) + extra_tokens
    drop = virtual <= 0
    if min_len > 0:
      drop |= block < min_len
    total += int(virtual[drop].sum())
  return total


def _kept_docs(parts: list[np.ndarray | None], n: int, num_kept: int, dtype: type
               ) -> np.ndarray:
  """The kept document indices from the per-block selections (None: all of the block)."""
  kept = np.empty(num_kept, dtype)
  at = 0
  for b, sel in enumerate(parts):
    lo = b * BLOCK
    if sel is None:
      hi = min(n, lo + BLOCK)
      kept[at:at + hi - lo] = np.arange(lo, hi, dtype=dtype)
      at += hi - lo
    else:
      kept[at:at + len(sel)] = sel + lo
      at += len(sel)
  return kept


def _lay_out(lengths: np.ndarray, num_kept: int, long: np.ndarray, vlong: np.ndarray,
             extra_chunks: np.ndarray, seq_len: int, stride: int, *, extra_tokens: int,
             min_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(length, cont, cont_start)` of the chunks in document order.

  `long` holds the positions (among the kept documents) of the documents longer than `seq_len`,
  `vlong` their virtual lengths and `extra_chunks` the chunks each gets beyond its first. The
  continuation chunks of kept document `j` follow its first chunk, so that first chunk is chunk
  `j + (continuations of the long documents before j)`. Written block by block.
  """
  num_cont = int(extra_chunks.sum())
  ahead = np.cumsum(extra_chunks) - extra_chunks  # continuations of earlier long documents
  owner = np.repeat(np.arange(len(long)), extra_chunks)
  k = np.arange(num_cont, dtype=np.int64) - ahead[owner] + 1  # 1 for the second chunk, ...
  cont = long[owner] + ahead[owner] + k
  cont_start = k * stride
  conts_before = np.concatenate([[0], np.cumsum(extra_chunks)])  # by long documents before
  length = np.empty(num_kept + num_cont, length_dtype(seq_len))
  at = 0
  for a in range(0, len(lengths), BLOCK):
    virtual, _ = _kept_block(lengths, a, extra_tokens=extra_tokens, min_len=min_len)
    first = np.minimum(virtual, seq_len)
    if num_cont:
      # First chunk of kept document j: j + continuations of the long documents before j.
      i0, i1 = np.searchsorted(long, [at, at + len(virtual)])
      pos = np.zeros(len(virtual), np.int64)
      after = long[i0:i1] + 1 - at
      inside = after < len(virtual)
      pos[after[inside]] = extra_chunks[i0:i1][inside]
      np.cumsum(pos, out=pos)
      pos += np.arange(at + conts_before[i0], at + conts_before[i0] + len(virtual))
      length[pos] = first
    else:
      length[at:at + len(virtual)] = first
    at += len(virtual)
  length[cont] = np.minimum(seq_len, vlong[owner] - cont_start)
  return length, cont, cont_start.astype(np.int32)
