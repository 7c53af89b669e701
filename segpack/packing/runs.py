"""What the decreasing packers share: the textbook order, runs of equal lengths, new bins."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from segpack.packing.sorting import stable_argsort


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a packer put the chunks.

  Attributes:
    order: int64 `[num_chunks]`, the chunks in the order they were placed.
    bins: int64 `[num_chunks]`, the row of chunk `order[i]`; rows are numbered 0, 1, ... in the
      order they were opened.
    rank: int64 `[num_chunks]` or None: the position of chunk `order[i]` inside its row. None
      means `bins` is non-decreasing, so `order` already lists the pieces row by row.
  """

  order: np.ndarray
  bins: np.ndarray
  rank: np.ndarray | None = None


class RunPacker(Protocol):
  """A decreasing packer's state, fed one run of equal chunk lengths at a time (longest first):
  FFD's and BFD's packers, used by `run_decreasing` and by `layout.place_runs`."""

  num_bins: int  # bins opened so far

  def place_run(self, size: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Places `m` chunks of `size` slots; returns `(bins, counts)`: bin `bins[j]` takes the next
    `counts[j]` chunks of the run."""


def decreasing_order(length: np.ndarray, seq_len: int) -> np.ndarray:
  """Chunk indices sorted by length, longest first, ties by index (a stable sort)."""
  return stable_argsort(seq_len - np.asarray(length, np.int64))


def length_runs(sorted_len: np.ndarray) -> tuple[list[int], list[int]]:
  """`(starts, ends)` of the runs of equal values in `sorted_len`."""
  change = np.flatnonzero(sorted_len[1:] != sorted_len[:-1]) + 1
  starts = np.concatenate([[0], change])
  ends = np.concatenate([change, [len(sorted_len)]])
  return starts.tolist(), ends.tolist()


def open_new_bins(m: int, size: int, seq_len: int, first_bin: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Places `m` chunks of `size` slots into fresh bins `first_bin, first_bin + 1, ...`.

  With every open bin too full for the run, both FFD and BFD put `seq_len // size` chunks into
  each fresh bin before opening the next.

  Returns:
    `(bins, counts, rooms)`: the new bins, the chunks each takes and the room each has left.
  """
  per_bin = seq_len // size
  num_new = -(-m // per_bin)
  bins = first_bin + np.arange(num_new, dtype=np.int64)
  counts = np.full(num_new, per_bin, np.int64)
  counts[-1] = m - (num_new - 1) * per_bin
  return bins, counts, seq_len - counts * size


def max_bins(length: np.ndarray, seq_len: int) -> int:
  """An upper bound on the bins any-fit packing (FFD, BFD) opens: `2 * ceil(total / seq_len) + 1`.

  Any-fit opens a bin only when no open bin has room, so no two bins end at most half full (the
  first chunk of the later one would have fit the earlier one): all bins but one hold more than
  `seq_len / 2`.
  """
  total = int(length.sum(dtype=np.int64))
  return min(len(length), 2 * -(-total // seq_len) + 1)


def run_decreasing(packer: RunPacker, length: np.ndarray, seq_len: int) -> Placement:
  """Feeds the chunks to `packer` run by run, longest first, and records bins and ranks."""
  n = len(length)
  order = decreasing_order(length, seq_len)
  sorted_len = length[order]
  bins = np.empty(n, np.int64)
  rank = np.empty(n, np.int64)
  fill = np.zeros(max_bins(length, seq_len) + 1, np.int64)  # chunks in each bin so far
  starts, ends = length_runs(sorted_len)
  for s, e in zip(starts, ends):
    run_bins, counts = packer.place_run(int(sorted_len[s]), e - s)
    ahead = np.cumsum(counts) - counts  # chunks of this run placed before each bin's share
    bins[s:e] = np.repeat(run_bins, counts)
    rank[s:e] = np.repeat(fill[run_bins] - ahead, counts)
    rank[s:e] += np.arange(e - s)
    fill[run_bins] += counts
  return Placement(order=order, bins=bins, rank=rank)
