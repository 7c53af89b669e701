"""Tests for segpack.packing.cap: the segments-per-row cap, against the contract's invariants."""

import numpy as np
import pytest

from segpack import packing
from segpack.packing.cap import cap_segments_per_row
from segpack.packing.plan import PlanArrays


def test_cap_post_pass_example():
  plan = PlanArrays(seq_len=8, overlap=0, row_splits=np.array([0, 3, 4]),
                         doc=np.array([0, 1, 2, 3]), start=np.zeros(4, np.int32),
                         length=np.array([3, 2, 1, 4], np.int32))
  capped = cap_segments_per_row(plan, 2)  # the docstring's example
  assert capped.row_splits.tolist() == [0, 2, 4]
  assert capped.doc.tolist() == [3, 2, 0, 1]


@pytest.mark.parametrize("cap", [1, 2, 3, 8])
def test_cap_post_pass_invariants(cap):
  rng = np.random.default_rng(cap)
  lengths = np.concatenate([rng.integers(1, 8, 300), rng.integers(20, 140, 60)])
  plan = packing.plan(lengths, 64, extra_tokens=2)
  arrays = PlanArrays(seq_len=64, overlap=0, row_splits=plan.row_splits, doc=plan.doc,
                           start=plan.start, length=plan.length)
  capped = cap_segments_per_row(arrays, cap)
  pieces = lambda a: sorted(zip(a.doc.tolist(), a.start.tolist(), a.length.tolist()))
  assert pieces(capped) == pieces(arrays)  # every piece exactly once
  for r in range(capped.num_rows):
    a, b = int(capped.row_splits[r]), int(capped.row_splits[r + 1])
    assert 1 <= b - a <= cap
    assert sum(int(n) for n in capped.length[a:b]) <= 64
  assert capped.num_rows >= -(-len(capped.doc) // cap)
  assert cap_segments_per_row(capped, cap) is capped  # already within the cap
