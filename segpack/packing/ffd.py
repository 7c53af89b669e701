"""Exact first-fit-decreasing, placing runs of equal-length chunks in vectorized steps."""

from __future__ import annotations

import numpy as np

from segpack.packing.sorting import stable_argsort

_BLOCK = 128


def decreasing_order(length: np.ndarray, seq_len: int) -> np.ndarray:
  """Chunk indices sorted by length, longest first, ties by index (a stable sort)."""
  return stable_argsort(seq_len - length.astype(np.int64))


def length_runs(sorted_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`(starts, ends)` of the runs of equal values in `sorted_len`."""
  change = np.flatnonzero(sorted_len[1:] != sorted_len[:-1]) + 1
  starts = np.concatenate([[0], change])
  ends = np.concatenate([change, [len(sorted_len)]])
  return starts, ends


def open_new_bins(m: int, size: int, seq_len: int, first_bin: int
                  ) -> tuple[np.ndarray, np.ndarray]:
  """Places `m` chunks of `size` slots into fresh bins `first_bin, first_bin + 1, ...`.

  With every open bin too full for the run, both FFD and BFD put `seq_len // size` chunks into
  each fresh bin before opening the next. Returns the bin of each chunk and the capacities left
  in the new bins.
  """
  per_bin = seq_len // size
  bins = first_bin + np.arange(m, dtype=np.int64) // per_bin
  num_new = -(-m // per_bin)
  caps = np.full(num_new, seq_len - per_bin * size, np.int64)
  caps[-1] = seq_len - (m - (num_new - 1) * per_bin) * size
  return bins, caps


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

  def __init__(self, seq_len: int, max_bins: int):
    self.seq_len = seq_len
    nblocks = max(1, -(-max_bins // _BLOCK))
    self.cap = np.zeros((nblocks, _BLOCK), np.int64)
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
      csum = np.cumsum(share)
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

  def place_run(self, size: int, m: int) -> np.ndarray:
    """Places a run of `m` chunks of `size` slots; returns the bin of each, in order."""
    bins, counts = self._fill_open_bins(size, m)
    placed = np.repeat(bins, counts)
    rest = m - len(placed)
    if rest == 0:
      return placed
    new_bins, new_caps = open_new_bins(rest, size, self.seq_len, self.num_bins)
    flat = self.cap.reshape(-1)
    lo, hi = self.num_bins, self.num_bins + len(new_caps)
    flat[lo:hi] = new_caps
    self.num_bins = hi
    b0, b1 = lo // _BLOCK, -(-hi // _BLOCK)
    self.block_max[b0:b1] = self.cap[b0:b1].max(axis=1)
    return np.concatenate([placed, new_bins])


def first_fit_decreasing(length: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Exact FFD of chunks with `1 <= length <= seq_len`.

  Returns:
    `(order, bins)`: `order` is the processing order (longest first, ties by index), which is
    also the order of pieces inside a row, and `bins[i]` the row of chunk `order[i]` (rows
    numbered in opening order).
  """
  order = decreasing_order(length, seq_len)
  sorted_len = length[order]
  bins_sorted = np.empty(len(length), np.int64)
  packer = FirstFitDecreasing(seq_len, len(length))
  starts, ends = length_runs(sorted_len)
  for s, e in zip(starts.tolist(), ends.tolist()):
    bins_sorted[s:e] = packer.place_run(int(sorted_len[s]), e - s)
  return order, bins_sorted
