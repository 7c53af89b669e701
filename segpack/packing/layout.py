"""The decreasing packers (FFD, BFD) over all chunks in compact memory.

`place_rows` and `lay_out` give the same plan as `runs.run_decreasing` followed by the
row-major counting sort of `segpack.packing.planner`, with no int64 array over all chunks: the
planning's peak over the input lengths was 12.4 to 14.2 bytes per document (the plan's own 11.8
included) on 10M and 100M lognormal documents, against 76.5 before (docs/benchmarks.md).

1. A histogram of the chunk lengths gives the runs of equal length, longest first. The packer
   places the runs from the histogram alone (which chunk of a run goes where does not change the
   bins), recording for every run the open bins it filled and how many new bins it opened; the
   chunks per row follow, hence `row_splits`.
2. A counting sort, block by block, lists the chunks' documents longest first, ties by index
   (the textbook order), as int32; the few continuation chunks of split documents are noted
   (their sorted position and first slot). With `rng`, every run is then put in a random order.
3. The sorted documents live in their own anonymous memory map, handed back to the OS page by
   page as step 4 reads them.
4. The runs are replayed: the `t`-th chunk of a run goes to the `t`-th place of the run's bins,
   at `row_splits[bin] + chunks already in the bin`, so the pieces are written straight into the
   row-major plan arrays.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import mmap
import sys
from typing import Callable

import numpy as np

from segpack.packing.chunking import BLOCK, Chunks, index_dtype, length_dtype
from segpack.packing.runs import RunPacker


def length_histogram(length: np.ndarray, seq_len: int) -> np.ndarray:
  """int64 `[seq_len + 1]`: how many chunks have each length (computed block by block)."""
  hist = np.zeros(seq_len + 1, np.int64)
  for a in range(0, len(length), BLOCK):
    hist += np.bincount(length[a:a + BLOCK], minlength=seq_len + 1)
  return hist


def bins_bound(hist: np.ndarray, seq_len: int) -> int:
  """`runs.max_bins` from the histogram: at most `2 * ceil(total / seq_len) + 1` bins."""
  total = int(np.dot(hist, np.arange(len(hist), dtype=np.int64)))
  return min(int(hist.sum()), 2 * -(-total // seq_len) + 1)


def place_runs(packer: RunPacker, hist: np.ndarray, *, max_bins: int
               ) -> tuple[list[tuple], np.ndarray]:
  """Runs the packer over the runs of `hist`, longest first.

  Returns:
    `(runs, per_row)`: per run `(size, m, old_bins, old_counts, first_new, num_new)` (the open bins
    it filled, in order, and the new bins `first_new ...` it opened), and int32 `[num_bins]` the
    chunks of each row.
  """
  fill = np.zeros(max_bins + 1, np.int32)
  runs = []
  for size in np.flatnonzero(hist[::-1][:-1]).tolist():
    size = len(hist) - 1 - size
    m = int(hist[size])
    first_new = packer.num_bins
    bins, counts = packer.place_run(size, m)
    num_new = packer.num_bins - first_new
    k = len(bins) - num_new
    runs.append((size, m, bins[:k].astype(index_dtype(max_bins)), counts[:k].astype(np.int32),
                 first_new, num_new))
    fill[bins] += counts.astype(np.int32)
  return runs, fill[:packer.num_bins].copy()


def sorted_documents(chunks: Chunks, hist: np.ndarray, *, out: np.ndarray,
                     rng: np.random.Generator | None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The documents of the chunks longest first, ties by chunk index (or, with `rng`, in a random
  order per run of equal lengths).

  A stable counting sort, block by block: each block is radix-sorted by its keys (NumPy sorts
  16-bit keys by radix), and its chunks go to their buckets' next free places as documents
  (`chunks.docs` of the block's own window).

  Returns:
    `(docs, cont_pos, cont_starts)`: `out`, now the documents in sorted order, and the
    sorted positions of the continuation chunks (int64, increasing) with their first slots.
  """
  seq_len = len(hist) - 1
  length, cont, cont_start = chunks.length, chunks.cont, chunks.cont_start
  identity = chunks.kept is None and not len(cont)
  key_dtype = np.uint16 if seq_len <= 0xFFFF else np.int32
  hist_k = hist[::-1]  # key k = seq_len - length
  next_k = np.cumsum(hist_k) - hist_k
  docs = out
  pos_parts, start_parts = [], []
  for a in range(0, len(length), BLOCK):
    key = np.subtract(seq_len, length[a:a + BLOCK], dtype=key_dtype)
    loc = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=seq_len + 1)
    used = np.flatnonzero(counts)
    dest = np.repeat((next_k - (np.cumsum(counts) - counts))[used], counts[used])
    dest += np.arange(len(key))
    docs[dest] = loc + a if identity else chunks.docs(a, a + len(key))[loc]
    lo, hi = np.searchsorted(cont, [a, a + len(key)])
    if hi > lo:
      # Where the block's continuation chunks went: (key, index) increases along `loc`.
      c = cont[lo:hi] - a
      ranked = key[loc].astype(np.int64) * len(key) + loc
      pos_parts.append(dest[np.searchsorted(ranked, key[c].astype(np.int64) * len(key) + c)])
      start_parts.append(cont_start[lo:hi])
    next_k += counts
  cont_pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
  cont_starts = np.concatenate(start_parts) if start_parts else np.zeros(0, np.int32)
  by_pos = np.argsort(cont_pos, kind="stable")
  cont_pos, cont_starts = cont_pos[by_pos], cont_starts[by_pos]
  if rng is not None:
    return shuffle_runs(docs, cont_pos, cont_starts, hist, rng=rng, out=docs)
  return docs, cont_pos, cont_starts


def shuffle_runs(docs: np.ndarray, cont_pos: np.ndarray, cont_start: np.ndarray,
                 hist: np.ndarray, *, rng: np.random.Generator, out: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`docs` (sorted, as `sorted_documents` returns them) with every run of equal lengths in a
  random order (`rng.permutation` per run, longest run first), written to `out` (which may be
  `docs`); the continuation chunks' positions move along.

  Returns:
    `(out, cont_pos, cont_start)`, the continuation chunks again by increasing position.
  """
  run_sizes = hist[::-1][hist[::-1] > 0].tolist()
  cont_pos = cont_pos.copy()
  start = 0
  bounds = np.searchsorted(cont_pos, np.cumsum([0] + run_sizes)).tolist()
  for m, lo, hi in zip(run_sizes, bounds, bounds[1:]):
    perm = rng.permutation(m)
    out[start:start + m] = docs[start:start + m][perm]
    if hi > lo:
      where = np.empty(m, np.int64)
      where[perm] = np.arange(m)
      cont_pos[lo:hi] = start + where[cont_pos[lo:hi] - start]
    start += m
  by_pos = np.argsort(cont_pos, kind="stable")
  return out, cont_pos[by_pos], cont_start[by_pos]


def _repeat_range(values: np.ndarray, counts: np.ndarray, cum: np.ndarray, lo: int,
                  hi: int) -> np.ndarray:
  """`np.repeat(values, counts)[lo:hi]` without the whole repetition (`cum = cumsum(counts)`)."""
  j0 = int(np.searchsorted(cum, lo, side="right"))
  j1 = int(np.searchsorted(cum, hi - 1, side="right")) + 1
  ends = np.minimum(cum[j0:j1], hi)
  begins = np.maximum(cum[j0:j1] - counts[j0:j1], lo)
  return np.repeat(values[j0:j1], ends - begins)


def write_rows(runs: list[tuple], row_splits: np.ndarray, docs_sorted: np.ndarray,
               cont_pos: np.ndarray, *, seq_len: int, doc_out: np.ndarray,
               length_out: np.ndarray, release: Callable[[int], None] | None = None
               ) -> np.ndarray:
  """Replays the runs: writes each sorted chunk's document and length at its plan position.

  The `t`-th chunk of a run goes to the run's `t`-th place: the open bins it filled (`counts[j]`
  places in bin `old_bins[j]`, after the chunks already there), then its new bins, `seq_len //
  size` chunks each. `runs` is emptied as it is consumed, and `release(i)` (when given) is told
  after every run that `docs_sorted[:i]` is no longer needed.

  Returns:
    int64: the plan positions of the sorted positions `cont_pos`.
  """
  fill = np.zeros(len(row_splits) - 1, np.int32)
  cont_dest = []
  start = 0
  runs.reverse()
  while runs:
    size, m, old_bins, old_counts, first_new, num_new = runs.pop()
    per_bin = seq_len // size
    m_new = m - int(old_counts.sum())
    # Each place's bin start minus the places of the run before that bin's share.
    base_old = row_splits[old_bins] + fill[old_bins] - (np.cumsum(old_counts) - old_counts)
    fill[old_bins] += old_counts
    new = np.arange(first_new, first_new + num_new)
    base_new = row_splits[new] - (m - m_new) - (new - first_new) * per_bin
    counts_new = np.full(num_new, per_bin, np.int64)
    if num_new:
      counts_new[-1] = m_new - (num_new - 1) * per_bin
      fill[new] = counts_new
    base = np.concatenate([base_old, base_new])
    counts = np.concatenate([old_counts, counts_new])
    cum = np.cumsum(counts)
    for t0 in range(0, m, BLOCK):
      t1 = min(m, t0 + BLOCK)
      if t0 == 0 and t1 == m:
        dest = np.repeat(base, counts)
      else:
        dest = _repeat_range(base, counts, cum, t0, t1)
      dest += np.arange(t0, t1)
      doc_out[dest] = docs_sorted[start + t0:start + t1]
      length_out[dest] = size
      lo, hi = np.searchsorted(cont_pos, [start + t0, start + t1])
      if hi > lo:
        cont_dest.append(dest[cont_pos[lo:hi] - start - t0])
    start += m
    if release is not None:
      release(start)
  return np.concatenate(cont_dest) if cont_dest else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class Rows:
  """What `lay_out` needs besides the chunks: it does not depend on the order of equal lengths.

  Attributes:
    hist: int64 `[seq_len + 1]` chunks of each length.
    runs: per run of equal lengths, longest first, `(size, m, old_bins, old_counts, first_new,
      num_new)` (see `place_runs`).
    row_splits: int64 `[num_rows + 1]`, read-only.
    max_per_row: the most pieces in a row.
  """

  hist: np.ndarray
  runs: list[tuple]
  row_splits: np.ndarray
  max_per_row: int


def place_rows(chunks: Chunks, seq_len: int, make_packer: Callable[[int], RunPacker]) -> Rows:
  """Step 1 of the module docstring: the rows, from the histogram of the chunk lengths."""
  hist = length_histogram(chunks.length, seq_len)
  max_bins = bins_bound(hist, seq_len)
  runs, per_row = place_runs(make_packer(max_bins), hist, max_bins=max_bins)
  row_splits = np.zeros(len(per_row) + 1, np.int64)
  np.cumsum(per_row, out=row_splits[1:])
  row_splits.flags.writeable = False
  return Rows(hist=hist, runs=runs, row_splits=row_splits, max_per_row=int(per_row.max()))


def lay_out(chunks: Chunks, rows: Rows, *, seq_len: int, num_docs: int,
            rng: np.random.Generator | None, consume: bool,
            presorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Steps 2-4 of the module docstring: `(doc, start, length)` of the pieces, row by row.

  Args:
    chunks: the chunks `rows` was placed from (only their `length` dtype and count are read
      when `presorted` is given).
    rows: `place_rows(chunks, ...)`.
    seq_len: slots per row.
    num_docs: documents before chunking (the dtype of the document indices).
    rng: None (ties by index), or the generator that orders every run at random.
    consume: set `chunks.length` and `chunks.kept` to None once sorted, so that they are freed
      before the plan's arrays fill up (keep only `chunks.stats` then).
    presorted: `sorted_documents(chunks, ..., rng=None)`, kept from an earlier call: step 2 is
      then only the shuffle of its runs.

  Returns:
    int32 (int64 from 2**31 documents) documents, int32 first slots and the chunks' length dtype.
  """
  n = chunks.stats["chunks"]
  trim = _trim_heap if n >= 1 << 22 else (lambda: None)
  trim()
  buffer = _ReleasableArray(n, index_dtype(num_docs))
  if presorted is None:
    docs_sorted, cont_pos, cont_start = sorted_documents(chunks, rows.hist, out=buffer.array,
                                                         rng=rng)
  elif rng is None:
    buffer.array[:] = presorted[0]
    docs_sorted, cont_pos, cont_start = buffer.array, presorted[1], presorted[2]
  else:
    docs_sorted, cont_pos, cont_start = shuffle_runs(*presorted, rows.hist, rng=rng,
                                                     out=buffer.array)
  length_dtype = length_dtype_of(chunks, seq_len)
  if consume:
    chunks.length = chunks.kept = None
  trim()
  doc = np.empty(n, index_dtype(num_docs))
  length = np.empty(n, length_dtype)
  cont_dest = write_rows(list(rows.runs), rows.row_splits, docs_sorted, cont_pos,
                         seq_len=seq_len, doc_out=doc, length_out=length, release=buffer.release)
  del docs_sorted, buffer
  trim()
  start = np.zeros(n, np.int32)
  start[cont_dest] = cont_start
  return doc, start, length


def length_dtype_of(chunks: Chunks, seq_len: int) -> type:
  """The dtype of the chunk lengths (also once `chunks.length` has been released)."""
  return chunks.length.dtype if chunks.length is not None else length_dtype(seq_len)


def _trim_heap() -> None:
  """Hands the C heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere nothing).

  The phases above free many mid-sized temporaries that glibc keeps in its heap; without the
  trim they stay resident beside the next phase's arrays (about 3 bytes per chunk).
  """
  trim = _libc_malloc_trim()
  if trim is not None:
    trim(0)


@functools.lru_cache(maxsize=1)
def _libc_malloc_trim() -> Callable[[int], int] | None:
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):  # not glibc
    return None


# Arrays from this size on are released page by page, in steps of at least RELEASE_STEP_BYTES.
RELEASE_MIN_BYTES = 1 << 24
RELEASE_STEP_BYTES = 1 << 22


class _ReleasableArray:
  """A 1-D array in its own anonymous memory map whose prefix can be handed back to the OS
  (`madvise(MADV_DONTNEED)`) once it has been read for the last time; a plain array where the
  platform lacks it."""

  def __init__(self, n: int, dtype: type):
    nbytes = n * np.dtype(dtype).itemsize
    self._map = None
    self._released = 0
    if nbytes >= RELEASE_MIN_BYTES and hasattr(mmap, "MADV_DONTNEED"):
      self._map = mmap.mmap(-1, nbytes)
      self.array = np.frombuffer(self._map, dtype=dtype, count=n)
    else:
      self.array = np.empty(n, dtype)

  def release(self, upto: int) -> None:
    """Frees the whole pages of `array[:upto]` (their contents are lost)."""
    if self._map is None:
      return
    end = upto * self.array.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
    if end - self._released >= RELEASE_STEP_BYTES:
      self._map.madvise(mmap.MADV_DONTNEED, self._released, end - self._released)
      self._released = end
