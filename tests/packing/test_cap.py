"""Tests for segpack.packing.cap: the segments-per-row cap, against the contract's invariants."""

import dataclasses

import numpy as np
import pytest

from segpack import packing
from segpack.packing.cap import cap_segments_per_row


def _plan(row_splits, doc, length, seq_len=8):
  return packing.Plan(seq_len=seq_len, overlap=0, extra_tokens=0, strategy="ffd",
                      row_splits=np.asarray(row_splits, np.int64),
                      doc=np.asarray(doc, np.int32), start=np.zeros(len(doc), np.int32),
                      length=np.asarray(length, np.uint16), stats={"tokens": int(sum(length))})


def _pieces(p):
  return sorted(zip(p.doc.tolist(), p.start.tolist(), p.length.tolist()))


def test_cap_post_pass_example():
  plan = _plan([0, 3, 4], [0, 1, 2, 3], [3, 2, 1, 4])
  capped = cap_segments_per_row(plan, 2)  # the docstring's example
  assert capped.row_splits.tolist() == [0, 2, 4]
  assert capped.doc.tolist() == [3, 2, 0, 1]
  assert capped.length.tolist() == [4, 1, 3, 2]


@pytest.mark.parametrize("cap", [1, 2, 3, 8])
def test_cap_post_pass_invariants(cap):
  rng = np.random.default_rng(cap)
  lengths = np.concatenate([rng.integers(1, 8, 300), rng.integers(20, 140, 60)])
  plan = packing.plan(lengths, 64, extra_tokens=2)
  capped = cap_segments_per_row(plan, cap)
  assert _pieces(capped) == _pieces(plan)  # every piece exactly once
  for r in range(capped.num_rows):
    a, b = int(capped.row_splits[r]), int(capped.row_splits[r + 1])
    assert 1 <= b - a <= cap
    assert sum(int(n) for n in capped.length[a:b]) <= 64
  assert capped.num_rows >= -(-len(capped.doc) // cap)
  assert cap_segments_per_row(capped, cap) is capped  # already within the cap


def test_capped_plan_is_the_plan_with_new_rows_and_statistics():
  lengths = np.random.default_rng(5).integers(1, 6, 1000)
  plan = packing.plan(lengths, 64, long_docs=packing.LongDocs(overlap=3), extra_tokens=2)
  capped = cap_segments_per_row(plan, 4)
  assert isinstance(capped, packing.Plan)
  assert (capped.seq_len, capped.overlap, capped.extra_tokens, capped.strategy) == (
      64, 3, 2, "ffd")
  per_row = np.diff(capped.row_splits)
  tokens = int(capped.length.sum())
  assert capped.stats == dict(
      plan.stats, max_segments_per_row=4, rows_before_cap=plan.num_rows, rows=capped.num_rows,
      slots=64 * capped.num_rows, utilization=tokens / (64 * capped.num_rows),
      segments_per_row_mean=float(per_row.mean()), segments_per_row_max=int(per_row.max()))
  assert capped.stats["tokens"] == tokens == int(plan.length.sum())
  assert "max_segments_per_row" not in plan.stats  # the input is not modified


def test_memory_mapped_plan_is_capped_in_memory(tmp_path):
  plan = _plan([0, 3, 4], [0, 1, 2, 3], [3, 2, 1, 4])
  plan.save(tmp_path / "p")
  loaded = packing.Plan.load(tmp_path / "p", mmap=True)
  capped = cap_segments_per_row(loaded, 2)
  assert not isinstance(capped.doc, np.memmap)
  assert capped.doc.tolist() == [3, 2, 0, 1]
  assert dataclasses.replace(capped).stats["rows"] == 2


def test_pool_goes_first_fit_longest_first():
  # seq_len 8, cap 3: row 0 = pieces 0..3 of 2, 2, 1, 1 slots is over the cap and dissolved;
  # rows 1 and 2 hold one piece of 7 slots each, more than the whole pool (6), so no swap.
  plan = _plan([0, 4, 5, 6], [0, 1, 2, 3, 4, 5], [2, 2, 1, 1, 7, 7], seq_len=8)
  capped = cap_segments_per_row(plan, 3)
  rows = [[d for d, _, _ in capped.row(r)] for r in range(capped.num_rows)]
  # First fit, longest first: pieces 0, 1, 2 fill the emptied row 0 up to the cap (room 3 left,
  # but no segment slot), so piece 3 goes to the leftmost row with room, row 1.
  assert rows == [[0, 1, 2], [4, 3], [5]]
