"""Tests for segpack.packing.plan: the Plan, its on-disk form and its pickling."""

import os
import pickle

import numpy as np
import pytest

from segpack import packing
from segpack.data.options import SpecialTokens
from segpack.data.rows import RowBuilder


def test_memory_mapped_plan_pickles_as_file_references(tmp_path):
  lengths = np.random.default_rng(0).integers(1, 60, 5000)
  packing.plan(lengths, 64, extra_tokens=2).save(tmp_path / "p")
  plan = packing.Plan.load(tmp_path / "p", mmap=True)
  blob = pickle.dumps(plan)
  assert len(blob) < 4_000 < plan.doc.nbytes  # the arrays are not in the pickle
  back = pickle.loads(blob)
  assert isinstance(back, packing.Plan) and isinstance(back.doc, np.memmap)
  for name in ("row_splits", "doc", "start", "length"):
    assert np.array_equal(getattr(back, name), getattr(plan, name)), name
  assert (back.seq_len, back.overlap, back.extra_tokens, back.strategy, back.stats) == (
      plan.seq_len, plan.overlap, plan.extra_tokens, plan.strategy, plan.stats)


def test_in_memory_plan_pickles_its_arrays():
  plan = packing.plan(np.arange(1, 300), 64, strategy="bfd", long_docs=packing.LongDocs(overlap=3),
                      extra_tokens=1)
  blob = pickle.dumps(plan)
  assert len(blob) > plan.nbytes
  back = pickle.loads(blob)
  assert not isinstance(back.doc, np.memmap)
  assert [back.row(r) for r in range(back.num_rows)] == [plan.row(r) for r in
                                                           range(plan.num_rows)]
  assert (back.overlap, back.extra_tokens, back.strategy) == (3, 1, "bfd")


def test_save_and_load_round_trip(tmp_path):
  p = packing.plan(np.arange(1, 50), 16, strategy="bfd", long_docs=packing.LongDocs(overlap=2),
                   extra_tokens=2)
  p.save(tmp_path / "plan")
  p.save(tmp_path / "plan")  # replacing an existing plan works
  q = packing.Plan.load(tmp_path / "plan", mmap=True)
  assert isinstance(q.doc, np.memmap)
  for name in ("row_splits", "doc", "start", "length"):
    np.testing.assert_array_equal(getattr(p, name), getattr(q, name))
  assert (q.seq_len, q.overlap, q.extra_tokens, q.strategy) == (16, 2, 2, "bfd")
  assert q.stats == p.stats
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary left over


def test_load_errors_name_the_file(tmp_path):
  with pytest.raises(packing.PlanError, match="plan.json"):
    packing.Plan.load(tmp_path / "missing")
  p = packing.plan(np.arange(1, 10), 16)
  p.save(tmp_path / "plan")
  os.remove(tmp_path / "plan" / "doc.npy")
  with pytest.raises(packing.PlanError, match="doc.npy"):
    packing.Plan.load(tmp_path / "plan")


def test_a_plan_of_the_old_dtypes_is_refused(tmp_path):
  """int64 `doc` and int32 `length` (plans of before the compact dtypes) are refused by name,
  even with matching checksums; the compact plan itself loads."""
  p = packing.plan(np.arange(1, 50), 16)
  for name, dtype in (("doc", np.int64), ("length", np.int32)):
    old = packing.Plan(seq_len=p.seq_len, overlap=p.overlap, extra_tokens=p.extra_tokens,
                       strategy=p.strategy, stats=p.stats, row_splits=p.row_splits,
                       **{k: (getattr(p, k).astype(dtype) if k == name else getattr(p, k))
                          for k in ("doc", "start", "length")})
    old.save(tmp_path / name)
    with pytest.raises(packing.PlanError, match=f"{name} is {np.dtype(dtype).name}, expected"):
      packing.Plan.load(tmp_path / name)
  p.save(tmp_path / "compact")
  packing.Plan.load(tmp_path / "compact")


def test_plan_docstring_example_and_save_without_overwrite(tmp_path):
  p = packing.plan(np.array([5, 3, 6]), 8)
  assert p.row_splits.tolist() == [0, 1, 3] and p.doc.tolist() == [2, 0, 1]
  assert p.length.tolist() == [6, 5, 3] and p.start.tolist() == [0, 0, 0]
  assert p.save(tmp_path / "plan", overwrite=False)
  other = packing.plan(np.array([1, 2]), 8)
  assert not other.save(tmp_path / "plan", overwrite=False)  # the first plan stays
  assert packing.Plan.load(tmp_path / "plan").doc.tolist() == [2, 0, 1]
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def test_plan_arrays_are_compact():
  lengths = np.random.default_rng(3).integers(0, 200, 3000)
  p = packing.plan(lengths, 64, long_docs=packing.LongDocs(overlap=4), extra_tokens=2)
  assert (p.row_splits.dtype, p.doc.dtype, p.start.dtype, p.length.dtype) == (
      np.int64, np.int32, np.int32, np.uint16)
  assert p.nbytes == 8 * (p.num_rows + 1) + (4 + 4 + 2) * p.num_pieces
  wide = packing.plan(np.array([70_000, 5, 65_536]), 65_536)  # lengths above uint16
  assert wide.length.dtype == np.int32
  assert sorted(wide.length.tolist()) == [5, 4464, 65_536, 65_536]


def test_cached_plan_is_memory_mapped_and_rows_equal_the_in_memory_plan(tmp_path):
  rng = np.random.default_rng(4)
  lengths = rng.integers(0, 150, 800)  # some split (seq_len 64), some empty
  docs = [rng.integers(3, 1000, n).astype(np.int32) for n in lengths]
  kwargs = dict(long_docs=packing.LongDocs(overlap=3), extra_tokens=2)
  in_memory = packing.plan(lengths, 64, **kwargs)
  mapped = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", **kwargs)
  again = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", **kwargs)  # reloaded
  for plan in (mapped, again):
    for name in ("row_splits", "doc", "start", "length"):
      array = getattr(plan, name)
      assert isinstance(array, np.memmap) and not array.flags.owndata, name
  special = SpecialTokens(bos_id=1, eos_id=2)
  want = RowBuilder(docs, in_memory, special=special, doc_lengths=lengths)
  got = RowBuilder(docs, again, special=special, doc_lengths=lengths)
  rows = list(range(in_memory.num_rows)) + [-1]
  assert again.num_rows == in_memory.num_rows
  expected, built = want.build(rows), got.build(rows)
  for name in expected:
    np.testing.assert_array_equal(built[name], expected[name])
  for r in (0, in_memory.num_rows // 2, in_memory.num_rows - 1):
    single = got.build_row(r)
    for name in expected:
      np.testing.assert_array_equal(single[name], expected[name][r])
  # The builder reads the memory maps in place: its arrays are views of the mapped files.
  views = got._plan_views()  # pylint: disable=protected-access
  for name in ("row_splits", "doc", "start", "length"):
    assert np.shares_memory(getattr(views, name), getattr(again, name)), name
