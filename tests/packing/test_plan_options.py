"""`segpack.PlanOptions`: a bad field is refused when the options are made, by name and value;
its plans are `packing.plan`'s and `packing.load_or_plan`'s with the same settings, piece for
piece, under the same cache directory (the cache key did not change)."""

import dataclasses
import os

import numpy as np
import pytest

import segpack
from segpack import packing


@pytest.mark.parametrize("fields, message", [
    (dict(seq_len="16"), "seq_len must be an int >= 1, got '16'"),
    (dict(seq_len=0), "seq_len must be an int >= 1, got 0"),
    (dict(seq_len=True), "seq_len must be an int >= 1, got True"),
    (dict(strategy="fdd"), "unknown strategy 'fdd'; valid strategies: ffd, bfd, greedy"),
    (dict(long_docs="split"), "long_docs must be a segpack.LongDocs, got 'split'"),
    (dict(long_docs=segpack.LongDocs(mode="drop")),
     "long_docs.mode must be one of split, truncate, got 'drop'"),
    (dict(long_docs=segpack.LongDocs(overlap=16)),
     r"long_docs.overlap must be an int in \[0, seq_len\) = \[0, 16\), got 16"),
    (dict(long_docs=segpack.LongDocs(min_len=-1)), "long_docs.min_len must be an int >= 0, got -1"),
    (dict(max_segments_per_row=0), "max_segments_per_row must be None or an int >= 1, got 0"),
    (dict(max_segments_per_row=True),
     "max_segments_per_row must be None or an int >= 1, got True"),
    (dict(batch_size=0), "batch_size must be an int >= 1, got 0"),
    (dict(pad_multiple=2.0), "pad_multiple must be an int >= 1, got 2.0"),
])
def test_a_bad_field_is_refused_by_name_and_value(fields, message):
  with pytest.raises(segpack.PipelineConfigError, match=f"^PlanOptions: {message}") as info:
    segpack.PlanOptions(**{"seq_len": 16, **fields})
  assert len(str(info.value).splitlines()) == 1
  assert isinstance(info.value, segpack.errors.UserError)


def test_frozen_keyword_only_and_exported():
  options = segpack.PlanOptions(seq_len=16)
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.seq_len = 32
  with pytest.raises(TypeError):
    segpack.PlanOptions(16)  # pylint: disable=too-many-function-args
  with pytest.raises(TypeError, match="seq_len"):
    segpack.PlanOptions()  # pylint: disable=missing-kwoa
  assert segpack.PlanOptions is packing.PlanOptions and "PlanOptions" in segpack.__all__
  assert options == segpack.PlanOptions(seq_len=16) and len({options, options}) == 1
  assert (options.strategy, options.long_docs, options.max_segments_per_row,
          options.batch_size, options.pad_multiple) == ("ffd", segpack.LongDocs(), None, 8, 128)
  with pytest.raises(segpack.PipelineConfigError, match="seq_len must be an int >= 1, got 0"):
    dataclasses.replace(options, seq_len=0)  # checked again when replaced


def _pieces(plan):
  return [np.asarray(getattr(plan, name)).tolist()
          for name in ("row_splits", "doc", "start", "length")]


@pytest.mark.parametrize("strategy", sorted(packing.STRATEGIES))
@pytest.mark.parametrize("cap", [None, 3])
def test_its_plans_are_the_packing_functions_plans(strategy, cap, tmp_path):
  rng = np.random.default_rng(7)
  lengths = rng.integers(0, 90, 200)
  long_docs = segpack.LongDocs(overlap=3, min_len=2)
  options = segpack.PlanOptions(seq_len=64, strategy=strategy, long_docs=long_docs,
                                max_segments_per_row=cap, batch_size=4, pad_multiple=16)
  kw = dict(strategy=strategy, long_docs=long_docs, extra_tokens=2, batch_size=4,
            pad_multiple=16)
  want = packing.plan(lengths, 64, **kw)
  if cap is not None:
    want = packing.cap.cap_segments_per_row(want, cap)
  got = options.plan(lengths, extra_tokens=2)
  assert _pieces(got) == _pieces(want) and got.stats == want.stats
  cached = options.load_or_plan(lengths, extra_tokens=2, cache_dir=tmp_path / "a", key="k")
  direct = packing.load_or_plan(lengths, 64, cache_dir=tmp_path / "b", key="k",
                                max_segments_per_row=cap, **kw)
  assert _pieces(cached) == _pieces(direct) == _pieces(want)
  assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))
  assert packing.plan_key("k", 64, **kw) in os.listdir(tmp_path / "a")


@pytest.mark.parametrize("strategy", packing.planner.TIE_SEED_STRATEGIES)
def test_its_repack_planner_is_the_packing_one(strategy):
  lengths = np.random.default_rng(3).integers(1, 40, 300)
  options = segpack.PlanOptions(seq_len=32, strategy=strategy)
  mine = options.repack_planner(lengths, extra_tokens=1, seed=4)
  theirs = packing.RepackPlanner(lengths, 32, seed=4, strategy=strategy, extra_tokens=1)
  for epoch in (1, 2):
    assert _pieces(mine.plan(epoch)) == _pieces(theirs.plan(epoch))
    assert _pieces(options.plan(lengths, extra_tokens=1, tie_seed=(4, epoch))) == _pieces(
        theirs.plan(epoch))
  with pytest.raises(segpack.PipelineConfigError, match="max_segments_per_row=2"):
    dataclasses.replace(options, max_segments_per_row=2).repack_planner(
        lengths, extra_tokens=1, seed=4)
