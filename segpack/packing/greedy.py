"""Order-preserving next-fit packing, as t5x/seqio's `pack` does."""

from __future__ import annotations

import numpy as np

from segpack.packing.runs import Placement


def next_fit(length: np.ndarray, seq_len: int) -> Placement:
  """Packs chunks in their order; a row is closed as soon as the next chunk does not fit.

  Algorithm:
    1. Prefix sums `P` of the chunk lengths.
    2. A row starting at chunk `i` takes chunks `i..j-1` for the largest `j` with
       `P[j] - P[i] <= seq_len`: one `searchsorted` for every possible start gives `next[i] = j`.
    3. The rows are the orbit `0, next[0], next[next[0]], ...`, walked with plain integers.

  Example: seq_len 10, lengths [4, 5, 3, 7, 2]: rows [4, 5], [3, 7], [2] (the 3 does not fit
  after 4 + 5 and next fit never goes back, unlike first fit).

  Returns:
    The identity order and the row of each chunk (non-decreasing).
  """
  n = len(length)
  prefix = np.zeros(n + 1, np.int64)
  np.cumsum(length, out=prefix[1:])
  nxt = np.searchsorted(prefix, prefix[:-1] + seq_len, side="right") - 1
  nxt = memoryview(nxt.astype(np.int64, copy=False))  # plain-int reads, no list of 10M ints
  row_starts = []
  i = 0
  while i < n:
    row_starts.append(i)
    i = nxt[i]
  counts = np.diff(np.asarray(row_starts + [n], np.int64))
  bins = np.repeat(np.arange(len(row_starts), dtype=np.int64), counts)
  return Placement(order=np.arange(n, dtype=np.int64), bins=bins)
