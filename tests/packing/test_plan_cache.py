"""Tests for segpack.packing.cache: plans computed once per (documents, parameters), capped
plans cached beside them."""

import os

import numpy as np
import pytest

from segpack import packing
from segpack.packing import cache as cache_mod


def _boom(*args, **kwargs):
  raise AssertionError("planned or capped again instead of loading the cache")


def _pieces(p):
  return [p.row(r) for r in range(p.num_rows)]


def _many_short(seed=0):
  return np.random.default_rng(seed).integers(1, 6, 2000)  # many segments per row


def test_capped_plan_is_cached_beside_the_uncapped_one(tmp_path, monkeypatch):
  lengths = _many_short()
  first = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", extra_tokens=2,
                               max_segments_per_row=3)
  key = packing.plan_key("k", 64, extra_tokens=2)
  assert sorted(os.listdir(tmp_path)) == [key, key + "-maxseg3"]  # the names of earlier releases
  assert isinstance(first.doc, np.memmap)
  assert int(np.diff(first.row_splits).max()) <= 3
  uncapped = packing.plan(lengths, 64, extra_tokens=2)
  assert sorted(map(tuple, zip(first.doc.tolist(), first.length.tolist()))) == sorted(
      map(tuple, zip(uncapped.doc.tolist(), uncapped.length.tolist())))
  assert first.stats["max_segments_per_row"] == 3
  assert first.stats["rows_before_cap"] == uncapped.num_rows < first.num_rows
  monkeypatch.setattr(cache_mod._planner, "plan", _boom)
  monkeypatch.setattr(packing.cap, "cap_segments_per_row", _boom)
  again = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", extra_tokens=2,
                               max_segments_per_row=3)
  assert _pieces(again) == _pieces(first)
  plain = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", extra_tokens=2)
  assert _pieces(plain) == _pieces(uncapped)
  with pytest.raises(AssertionError, match="instead of loading"):  # another cap: not cached
    packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", extra_tokens=2,
                         max_segments_per_row=4)


def test_an_existing_capped_cache_entry_is_loaded(tmp_path, monkeypatch):
  lengths = _many_short(1)
  marker = packing.plan(lengths, 64, strategy="greedy", extra_tokens=2)  # recognizably other
  marker.save(tmp_path / (packing.plan_key("k", 64, extra_tokens=2) + "-maxseg5"))
  monkeypatch.setattr(cache_mod._planner, "plan", _boom)
  got = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="k", extra_tokens=2,
                             max_segments_per_row=5)
  assert got.strategy == "greedy" and _pieces(got) == _pieces(marker)


def test_capped_plan_without_a_cache_and_on_a_read_only_data_set(tmp_path, monkeypatch, caplog):
  lengths = _many_short(2)
  want = _pieces(packing.cap.cap_segments_per_row(packing.plan(lengths, 64), 2))
  assert _pieces(packing.load_or_plan(lengths, 64, cache_dir=None,
                                      max_segments_per_row=2)) == want

  def refuse(self, path, **kwargs):
    raise PermissionError(f"read-only: {path}")

  monkeypatch.setattr(packing.Plan, "save", refuse)
  got = packing.load_or_plan(lengths, 64, cache_dir=tmp_path / "ro", key="k",
                             max_segments_per_row=2)
  assert _pieces(got) == want and not isinstance(got.doc, np.memmap)
  assert "cannot write the plan cache" in caplog.text


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4"])
def test_bad_segment_cap_names_the_argument(tmp_path, bad):
  with pytest.raises(packing.PackingArgumentError, match=f"max_segments_per_row={bad!r}"):
    packing.load_or_plan(np.arange(1, 9), 16, cache_dir=tmp_path, max_segments_per_row=bad)


def test_cache_second_call_loads_instead_of_planning(tmp_path, monkeypatch):
  lengths = np.random.default_rng(0).integers(1, 100, 1000)
  first = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="fp-1", extra_tokens=2)

  def boom(*args, **kwargs):
    raise AssertionError("planned again instead of loading the cache")

  monkeypatch.setattr(cache_mod._planner, "plan", boom)
  second = packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="fp-1", extra_tokens=2)
  assert isinstance(second.doc, np.memmap)
  np.testing.assert_array_equal(first.doc, second.doc)
  np.testing.assert_array_equal(first.row_splits, second.row_splits)
  # Another key (changed shards) must plan again.
  with pytest.raises(AssertionError, match="planned again"):
    packing.load_or_plan(lengths, 64, cache_dir=tmp_path, key="fp-2", extra_tokens=2)


def test_cache_key_changes_with_every_parameter():
  base = dict(strategy="ffd", long_docs=packing.LongDocs(), extra_tokens=0)
  keys = {packing.plan_key("fp", 64, **base), packing.plan_key("fp2", 64, **base),
          packing.plan_key("fp", 128, **base)}
  for name, value in (("strategy", "bfd"), ("long_docs", packing.LongDocs(mode="truncate")),
                      ("long_docs", packing.LongDocs(min_len=1)),
                      ("long_docs", packing.LongDocs(overlap=1)), ("extra_tokens", 2)):
    keys.add(packing.plan_key("fp", 64, **{**base, name: value}))
  assert len(keys) == 8
  sp = dict(base, strategy="sorted_pad")
  assert (packing.plan_key("fp", 64, **sp, batch_size=4)
          != packing.plan_key("fp", 64, **sp, batch_size=8))


def test_cache_without_key_hashes_the_lengths(tmp_path):
  a = packing.load_or_plan(np.array([5, 6, 7]), 16, cache_dir=tmp_path)
  b = packing.load_or_plan(np.array([5, 6, 8]), 16, cache_dir=tmp_path)
  assert a.length.tolist() != b.length.tolist()
  assert len(os.listdir(tmp_path)) == 2


def test_corrupt_cache_is_replanned(tmp_path):
  lengths = np.arange(1, 17)
  packing.load_or_plan(lengths, 16, cache_dir=tmp_path, key="k")
  (entry,) = os.listdir(tmp_path)
  (tmp_path / entry / "plan.json").write_text("{not json")
  with pytest.warns(UserWarning, match="is damaged or stale .*plan.json.* replanning"):
    p = packing.load_or_plan(lengths, 16, cache_dir=tmp_path, key="k")
  assert p.num_pieces == 16
  packing.Plan.load(tmp_path / entry)  # repaired on disk


def test_unwritable_cache_returns_the_plan_uncached(tmp_path, monkeypatch, caplog):
  def refuse(self, path, **kwargs):
    raise PermissionError(f"read-only: {path}")

  monkeypatch.setattr(packing.Plan, "save", refuse)
  p = packing.load_or_plan(np.arange(1, 20), 16, cache_dir=tmp_path / "ro", key="k")
  assert p.num_pieces == 19 + 3  # 17, 18 and 19 are split in two
  assert "cannot write the plan cache" in caplog.text
