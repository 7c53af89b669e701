"""Tests for segpack.packing.first_fit (and first-fit-decreasing built on it), against naive loops
written out here: each item scans the rows from the left."""

import numpy as np
import pytest

from segpack.packing import ffd
from segpack.packing.first_fit import FirstFitTree, first_fit


def naive_first_fit(sizes, free, slots=None):
  free = list(free)
  slots = None if slots is None else list(slots)
  out = []
  for need in sizes:
    for r in range(len(free)):
      if free[r] >= need and (slots is None or slots[r] > 0):
        free[r] -= need
        if slots is not None:
          slots[r] -= 1
        out.append(r)
        break
    else:
      return None
  return out


def naive_ffd(sizes, seq_len):
  """Textbook FFD: longest first (ties by index), each into the first open row with room."""
  rows, room = [], []
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    for r in range(len(rows)):
      if room[r] >= sizes[i]:
        rows[r].append(i)
        room[r] -= sizes[i]
        break
    else:
      rows.append([i])
      room.append(seq_len - sizes[i])
  return rows


def placement_rows(placement):
  rows = [[] for _ in range(int(placement.bins.max()) + 1)]
  order = np.lexsort((placement.rank, placement.bins))
  for k in order.tolist():
    rows[int(placement.bins[k])].append(int(placement.order[k]))
  return rows


@pytest.mark.parametrize("num_rows", [1, 3, 17, 256, 257, 700])  # both tree constructions
def test_first_fit_equals_the_naive_scan(num_rows):
  rng = np.random.default_rng(num_rows)
  for _ in range(20):
    free = rng.integers(0, 50, num_rows)
    sizes = rng.integers(1, 30, int(rng.integers(1, 3 * num_rows + 2))).tolist()
    assert first_fit(sizes, free) == naive_first_fit(sizes, free)
    slots = rng.integers(0, 3, num_rows)
    assert first_fit(sizes, free, slots=slots) == naive_first_fit(sizes, free, slots)
    fits = sizes[:max(1, len(sizes) // 4)]
    assert first_fit(fits, free + 100) == naive_first_fit(fits, free + 100) is not None


def test_tree_operations_equal_the_naive_scan():
  rng = np.random.default_rng(7)
  free = rng.integers(0, 100, 300).tolist()
  is_open = [True] * len(free)
  tree = FirstFitTree(free)
  for _ in range(2000):
    need = int(rng.integers(0, 120))
    want = next((r for r, f in enumerate(free) if is_open[r] and f >= need), -1)
    assert tree.find(need) == want
    if rng.random() < 0.9 and want >= 0:
      tree.take(want, need)
      free[want] -= need
    else:
      r = int(rng.integers(0, len(free)))
      tree.set(r, -1)  # closes row r
      is_open[r] = False
  assert [tree.free(r) for r in range(len(tree)) if is_open[r]] == [
      f for f, o in zip(free, is_open) if o]


def test_place_is_all_or_nothing():
  tree = FirstFitTree([5, 3], slots=[1, 2])
  assert tree.place([4, 3, 3]) is None  # the second 3 fits nowhere: nothing is placed
  assert [tree.free(0), tree.free(1)] == [5, 3]
  assert tree.place([4, 3]) == [0, 1]
  assert tree.find(1) == -1  # row 0 has no segment slot left, row 1 no room


def test_docstring_examples():
  assert first_fit([4, 4, 3], [5, 8]) == [0, 1, 1]
  tree = FirstFitTree([3, 8, 5])
  assert tree.find(4) == 1
  tree.take(1, 4)
  assert tree.find(5) == 2


@pytest.mark.parametrize("n", [1, 2, 7, 64, 256, 257, 1000])  # both paths of the FFD
def test_first_fit_decreasing_equals_the_textbook_loop(n):
  rng = np.random.default_rng(n)
  for seq_len in (10, 64, 1000):
    for sizes in (rng.integers(1, seq_len + 1, n),  # many ties of equal length, too:
                  rng.choice(rng.integers(1, seq_len + 1, 3), n)):
      placement = ffd.first_fit_decreasing(sizes, seq_len)
      assert placement_rows(placement) == naive_ffd(sizes.tolist(), seq_len)
