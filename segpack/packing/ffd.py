"""Exact first-fit-decreasing: runs of equal-length chunks in vectorized steps, or (a minibatch's
few chunks) one by one through `segpack.packing.first_fit`."""

from __future__ import annotations

import numpy as np

from segpack.packing.first_fit import first_fit
from segpack.packing.runs import Placement, max_bins, open_new_bins, run_decreasing

_BLOCK = 128
# Up to this many chunks, placing them one by one beats the run-based packer (whose NumPy calls
# per run of equal lengths cost more than a tree walk per chunk when runs are short).
ONE_BY_ONE = 256


class FirstFitDecreasing:
  """Exact first-fit-decreasing (FFD) over all chunks at once.

  Algorithm:
    1. Sort chunks by length, longest first, ties by chunk index (the textbook order).
    2. Take the chunks run by run, a run being all chunks of one length `L` (`m` of them).
    3. Textbook FFD puts each chunk into the lowest-index bin with room `cap >= L`. Bins before
       that one have less than `L` and only ever shrink, so the next chunk of the run goes to the
       same bin while it still has room: the bin takes `cap // L` chunks at once, then the next
       bin with room takes its share, and so on. The bins are kept in blocks of 128 with the
       largest room per block, so the bins with room are found block by block and the shares
       come from one cumulative sum.
    4. Chunks left when no bin has room open new bins, `seq_len // L` per bin.

  Example: seq_len 10, lengths [6, 5, 4, 4, 3]. Runs: 6 opens bin 0 (room 4); 5 opens bin 1
  (room 5); the two 4s: bin 0 takes one (room 0), bin 1 takes one (room 1); 3 opens bin 2.
  Bins: {0: [6, 4], 1: [5, 4], 2: [3]}, as the one-by-one textbook loop gives.
  """

  def __init__(self, seq_len: int, *, bins_bound: int):
    """`bins_bound`: at most this many bins will be opened (see `runs.max_bins`)."""
    self.seq_len = seq_len
    nblocks = max(1, -(-bins_bound // _BLOCK))
    self.cap = np.zeros((nblocks, _BLOCK), np.int32)  # room <= seq_len
    self.block_max = np.zeros(nblocks, np.int64)
    self.num_bins = 0

  def _fill_open_bins(self, size: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Places up to `m` chunks of `size` into open bins; returns (bins, counts) in order."""
    used_blocks = -(-self.num_bins // _BLOCK)
    cand = np.flatnonzero(self.block_max[:used_blocks] >= size)
    if len(cand) == 0:
      return np.zeros(0, np.int64), np.zeros(0, np.int64)
    take = 4
    while True:
      blocks = cand[:take]
      share = (self.cap[blocks] // size).ravel()
      csum = np.cumsum(share, dtype=np.int64)
      if csum[-1] >= m or take >= len(cand):
        break
      take *= 4
    if csum[-1] >= m:
      last = int(np.searchsorted(csum, m))
      share = share[:last + 1].copy()
      share[last] = m - (int(csum[last - 1]) if last else 0)
    hit = np.flatnonzero(share)
    counts = share[hit]
    bins = blocks[hit // _BLOCK] * _BLOCK + hit % _BLOCK
    flat = self.cap.reshape(-1)
    flat[bins] -= counts * size
    self.block_max[blocks] = self.cap[blocks].max(axis=1)
    return bins, counts

  def place_run(self, size: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Places a run of `m` chunks of `size` slots; returns `(bins, counts)` in order."""
    bins, counts = self._fill_open_bins(size, m)
    rest = m - int(counts.sum())
    if rest == 0:
      return bins, counts
    new_bins, new_counts, new_rooms = open_new_bins(rest, size, self.seq_len, self.num_bins)
    lo, hi = self.num_bins, self.num_bins + len(new_bins)
    self.cap.reshape(-1)[lo:hi] = new_rooms
    self.num_bins = hi
    b0, b1 = lo // _BLOCK, -(-hi // _BLOCK)
    self.block_max[b0:b1] = self.cap[b0:b1].max(axis=1)
    return np.concatenate([bins, new_bins]), np.concatenate([counts, new_counts])


def first_fit_decreasing(length: np.ndarray, seq_len: int) -> Placement:
  """Exact FFD of chunks with `1 <= length <= seq_len`; pieces in a row in placement order.

  Both paths take the chunks in the textbook order (longest first, ties by index) and give the
  textbook result: up to `ONE_BY_ONE` chunks (a minibatch) go one by one through
  `segpack.packing.first_fit` (rows `0..n-1` all empty at first: the leftmost empty row is the
  next new one); more go through `FirstFitDecreasing`, run by run.
  """
  length = np.asarray(length)
  if len(length) > ONE_BY_ONE:
    packer = FirstFitDecreasing(seq_len, bins_bound=max_bins(length, seq_len))
    return run_decreasing(packer, length, seq_len)
  sizes = length.tolist()
  order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # stable: `decreasing_order`
  bins = first_fit([sizes[i] for i in order], [seq_len] * len(sizes))
  fill = [0] * len(sizes)
  rank = []
  for b in bins:
    rank.append(fill[b])
    fill[b] += 1
  return Placement(order=np.asarray(order, np.int64), bins=np.asarray(bins, np.int64),
                   rank=np.asarray(rank, np.int64))
