"""First fit: each item goes into the leftmost row with room for it.

One primitive for every first-fit placement in the package: the small-input path of
first-fit-decreasing (`segpack.packing.ffd`), the segment cap's pool placement
(`segpack.packing.cap`) and the token-budget minibatches (`segpack.packing.minibatch_planner`). The
run-based vectorized FFD over a whole data set (`ffd.FirstFitDecreasing`) places thousands of
equal items per step instead and does not use it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["FirstFitTree", "first_fit"]

# Trees over at most this many rows are built with plain Python (NumPy's per-call overhead
# dominates for a handful of rows).
_SMALL = 256


class FirstFitTree:
  """Rows with free slots, and optionally a limit on the items each row still takes; finds the
  leftmost row with room for an item in O(log rows).

  Algorithm: a max segment tree over the rows' free slots (a closed row, one whose item limit is
  used up, counts as -1). `find(need)` walks from the root to the leftmost leaf >= need: at each
  node it goes left when the left subtree's maximum is >= need. `take` lowers a leaf and
  refreshes the maxima on its path to the root.

  Example: free [3, 8, 5]: `find(4)` is row 1; after `take(1, 4)` free is [3, 4, 5] and
  `find(5)` is row 2.
  """

  def __init__(self, free: Sequence[int] | np.ndarray,
               slots: Sequence[int] | np.ndarray | None = None):
    """Creates the tree.

    Args:
      free: free slots of each row.
      slots: items each row may still take (None: no limit); a row at 0 is closed.
    """
    self._free = free = _int_list(free)
    self._slots = None if slots is None else _int_list(slots)
    size = 1 << max(0, len(free) - 1).bit_length()
    self._size = size
    leaves = free if self._slots is None else [
        f if s > 0 else -1 for f, s in zip(free, self._slots)]
    if size <= _SMALL:
      tree = [-1] * (2 * size)
      tree[size:size + len(leaves)] = leaves
      for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
      self._tree = tree
      return
    tree_N = np.full(2 * size, -1, dtype=np.int64)
    tree_N[size:size + len(leaves)] = leaves
    level = size
    while level > 1:
      tree_N[level // 2:level] = np.maximum(tree_N[level:2 * level:2],
                                            tree_N[level + 1:2 * level:2])
      level //= 2
    self._tree = tree_N.tolist()

  def __len__(self) -> int:
    return len(self._free)

  def free(self, row: int) -> int:
    """Free slots of `row`."""
    return self._free[row]

  def find(self, need: int) -> int:
    """The leftmost open row with at least `need` free slots, or -1."""
    tree, i = self._tree, 1
    if tree[1] < need:
      return -1
    while i < self._size:
      i = 2 * i if tree[2 * i] >= need else 2 * i + 1
    return i - self._size

  def set(self, row: int, value: int) -> None:
    """Sets the leaf of `row` (its free slots, or -1 to close it) and the maxima above it."""
    tree, i = self._tree, row + self._size
    tree[i] = value
    i >>= 1
    while i:
      a, b = tree[2 * i], tree[2 * i + 1]
      m = a if a >= b else b
      if tree[i] == m:
        return  # the maxima above are unchanged too
      tree[i] = m
      i >>= 1

  def take(self, row: int, need: int) -> None:
    """Puts an item of `need` slots into `row` (closing it when its item limit is used up)."""
    self._free[row] -= need
    if self._slots is None:
      self.set(row, self._free[row])
      return
    self._slots[row] -= 1
    self.set(row, self._free[row] if self._slots[row] > 0 else -1)

  def place(self, sizes: Sequence[int]) -> list[int] | None:
    """First fit of `sizes` in order, all or nothing.

    Returns:
      The row of each item, or None (the tree unchanged) when some item fits no row.
    """
    out: list[int] = []
    if self._slots is not None:
      for need in sizes:
        row = self.find(need)
        if row < 0:
          self._undo(out, sizes)
          return None
        self.take(row, need)
        out.append(row)
      return out
    # No item limit: find() and take() inlined, the hot path of FFD and the token budget.
    tree, size, free = self._tree, self._size, self._free
    for need in sizes:
      if tree[1] < need:
        self._undo(out, sizes)
        return None
      i = 1
      while i < size:
        i = 2 * i if tree[2 * i] >= need else 2 * i + 1
      row = i - size
      out.append(row)
      free[row] -= need
      tree[i] = free[row]
      i >>= 1
      while i:
        a, b = tree[2 * i], tree[2 * i + 1]
        m = a if a >= b else b
        if tree[i] == m:
          break
        tree[i] = m
        i >>= 1
    return out

  def _undo(self, rows: list[int], sizes: Sequence[int]) -> None:
    for row, need in zip(rows, sizes):
      self._free[row] += need
      if self._slots is not None:
        self._slots[row] += 1
      self.set(row, self._free[row])


def _int_list(values: Sequence[int] | np.ndarray) -> list[int]:
  if len(values) <= _SMALL:
    return [int(v) for v in values]
  return np.asarray(values, np.int64).tolist()


def first_fit(sizes: Sequence[int], free: Sequence[int] | np.ndarray, *,
              slots: Sequence[int] | np.ndarray | None = None) -> list[int] | None:
  """First fit of `sizes`, in order, into rows with `free` slots (not modified).

  Args:
    sizes: slots of each item.
    free: free slots of each row.
    slots: items each row may take (None: no limit).

  Returns:
    The row of each item (the leftmost row with room when it was placed), or None when some
    item fits no row.

  Example: `first_fit([4, 4, 3], [5, 8])` is [0, 1, 1].
  """
  return FirstFitTree(free, slots).place(sizes)
