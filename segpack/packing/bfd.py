"""Exact best-fit-decreasing, with bins bucketed by the room they have left."""

from __future__ import annotations

import numpy as np

from segpack.packing.runs import Placement, open_new_bins, run_decreasing


class BestFitDecreasing:
  """Exact best-fit-decreasing (BFD) over all chunks at once.

  Algorithm:
    1. Sort chunks by length, longest first, ties by chunk index.
    2. Keep the open bins in buckets by remaining room `c` (`0 < c <= seq_len`), each bucket a
       set of bin indices.
    3. For a run of `m` chunks of length `L`: textbook BFD puts a chunk into the bin with the
       least room `c >= L`, lowest index first among equals. Its room drops to `c - L`; no other
       bin has room in `[L, c)`, so while `c - L >= L` the same bin takes the next chunk too: each
       bin takes `c // L` chunks and lands in bucket `c % L`. The buckets `c >= L` are therefore
       drained in increasing `c`, bins of one bucket in increasing index, a whole bucket moving
       at once; only the last bin touched may take fewer and stay with room `>= L`.
    4. Chunks left when no bin has room open new bins, `seq_len // L` per bin.

  Example: seq_len 100, lengths [60, 45, 42, 13]. 60 -> bin 0 (room 40); 45 -> bin 1 (room
  55); 42 does not fit bin 0 -> bin 1 (room 13). For the 13, bucket 13 = {1} is the smallest
  room that fits, so it goes to bin 1 (room 0), where first fit would pick bin 0 (room 40).
  """

  def __init__(self, seq_len: int):
    self.seq_len = seq_len
    self.count = np.zeros(seq_len + 1, np.int64)
    self.buckets: list[list[np.ndarray]] = [[] for _ in range(seq_len + 1)]
    self.num_bins = 0

  def _add(self, room: int, bins: np.ndarray) -> None:
    if room > 0 and len(bins):
      self.buckets[room].append(bins)
      self.count[room] += len(bins)

  def _take_bucket(self, room: int) -> np.ndarray:
    parts = self.buckets[room]
    self.buckets[room] = []
    self.count[room] = 0
    if len(parts) == 1:
      return parts[0]
    return np.sort(np.concatenate(parts), kind="stable")

  def place_run(self, size: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Places a run of `m` chunks of `size` slots; returns `(bins, counts)` in order."""
    rooms = np.flatnonzero(self.count[size:]) + size
    out_bins, out_counts = [], []
    left = m
    if len(rooms):
      capacity = np.cumsum(self.count[rooms] * (rooms // size))
      last = int(np.searchsorted(capacity, m)) if capacity[-1] >= m else len(rooms) - 1
      for room in rooms[:last + 1].tolist():
        share = room // size
        bins = self._take_bucket(room)
        if len(bins) * share <= left:
          out_bins.append(bins)
          out_counts.append(np.full(len(bins), share, np.int64))
          self._add(room - share * size, bins)
          left -= len(bins) * share
          continue
        full, rest = divmod(left, share)
        out_bins.append(bins[:full + (rest > 0)])
        counts = np.full(full + (rest > 0), share, np.int64)
        if rest:
          counts[-1] = rest
        out_counts.append(counts)
        self._add(room - share * size, bins[:full])
        if rest:
          self._add(room - rest * size, bins[full:full + 1])
        self._add(room, bins[full + (rest > 0):])
        left = 0
        break
    bins = np.concatenate(out_bins) if out_bins else np.zeros(0, np.int64)
    counts = np.concatenate(out_counts) if out_counts else np.zeros(0, np.int64)
    if left == 0:
      return bins, counts
    new_bins, new_counts, new_rooms = open_new_bins(left, size, self.seq_len, self.num_bins)
    self._add(int(new_rooms[0]), new_bins[:-1])
    self._add(int(new_rooms[-1]), new_bins[-1:])
    self.num_bins += len(new_bins)
    return np.concatenate([bins, new_bins]), np.concatenate([counts, new_counts])


def best_fit_decreasing(length: np.ndarray, seq_len: int) -> Placement:
  """Exact BFD of chunks with `1 <= length <= seq_len`; pieces in a row in placement order."""
  return run_decreasing(BestFitDecreasing(seq_len), length, seq_len)
