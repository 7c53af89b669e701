"""`pack_dataset(repack="epoch")` and `packing.plan(tie_seed=...)`: a fresh plan every epoch.

Oracles: a naive count of the pieces each epoch's rows hold, the pairs of documents that share a
row (from the built rows' BOS tokens), and a second dataset built from scratch.
"""

import collections
import itertools

import numpy as np
import pytest

import segpack
from segpack import packing
from segpack.data.options import PipelineConfigError

SEQ_LEN = 64


def _docs(n=600, seed=0):
  """Documents whose first token is their own id + 10 (so a row names its documents)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 40, n)
  return [np.concatenate([[d + 10], np.full(k - 1, 7)]).astype(np.int32)
          for d, k in enumerate(lengths)]


def _pack(docs, **kwargs):
  return segpack.pack_dataset(docs, seq_len=SEQ_LEN, seed=5, num_epochs=4,
                              special_tokens=segpack.SpecialTokens(
                                  add_bos=False, add_eos=False, pad_id=0), **kwargs)


def _epoch_rows(ds, epoch):
  n = ds.rows_in_epoch(0)
  return ds.get_batch(np.arange(epoch * n, (epoch + 1) * n))


def _pieces(features):
  """Naively, the document of every piece (its first token - 10) in every row."""
  rows = []
  for ids, seg in zip(features["input_ids"], features["segment_ids"]):
    starts = [s for s in range(len(seg)) if seg[s] and (s == 0 or seg[s] != seg[s - 1])]
    rows.append([int(ids[s]) - 10 for s in starts])
  return rows


def _pairs(rows):
  return {tuple(sorted(p)) for row in rows for p in itertools.combinations(row, 2)}


def test_every_epoch_holds_every_document_once_and_plans_differ():
  docs = _docs()
  ds = _pack(docs, repack="epoch")
  fixed = _pack(docs)
  assert len(ds) == len(fixed)
  assert ds.rows_in_epoch(0) == fixed.rows_in_epoch(0)
  epoch_pairs = []
  for epoch in range(4):
    rows = _pieces(_epoch_rows(ds, epoch))
    count = collections.Counter(d for row in rows for d in row)
    assert count == collections.Counter(range(len(docs)))
    epoch_pairs.append(_pairs(rows))
  fixed_pairs = [_pairs(_pieces(_epoch_rows(fixed, e))) for e in range(2)]
  assert fixed_pairs[0] == fixed_pairs[1]  # the fixed plan: 100% of the pairs meet again
  assert epoch_pairs[0] == fixed_pairs[0]  # epoch 0 is the fixed plan
  for a, b in zip(epoch_pairs, epoch_pairs[1:]):
    assert a != b
    assert len(a & b) / len(a) < 0.5


def test_tie_seed_keeps_row_lengths_and_changes_pieces():
  lengths = np.random.default_rng(1).integers(1, 300, 5000)
  for strategy in packing.planner.TIE_SEED_STRATEGIES:
    base = packing.plan(lengths, 512, strategy=strategy)
    other = packing.plan(lengths, 512, strategy=strategy, tie_seed=(3, 1))
    again = packing.plan(lengths, 512, strategy=strategy, tie_seed=(3, 1))
    np.testing.assert_array_equal(base.row_splits, other.row_splits)
    np.testing.assert_array_equal(base.length, other.length)
    np.testing.assert_array_equal(other.doc, again.doc)
    assert (base.doc != other.doc).any()
    assert sorted(other.doc.tolist()) == list(range(len(lengths)))
    # The lengths really are the documents' (a naive check, not the planner's bookkeeping).
    np.testing.assert_array_equal(other.length, lengths[other.doc])
  with pytest.raises(packing.PackingArgumentError, match="greedy"):
    packing.plan(lengths, 512, strategy="greedy", tie_seed=1)
  with pytest.raises(packing.PackingArgumentError, match="tie_seed"):
    packing.plan(lengths, 512, tie_seed="x")


def test_resume_mid_epoch_two_replays_exactly():
  docs = _docs(300)
  ds = _pack(docs, repack="epoch")
  n = ds.rows_in_epoch(0)
  it = iter(ds.to_iter_dataset())
  for _ in range(2 * n + n // 2):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(n)]  # crosses into epoch 3
  fresh = _pack(docs, repack="epoch")
  it2 = iter(fresh.to_iter_dataset())
  it2.set_state(state)
  for a, b in zip(expected, (next(it2) for _ in range(n))):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_batches_across_epochs_match_single_rows():
  ds = _pack(_docs(200), repack="epoch")
  n = ds.rows_in_epoch(0)
  idx = np.arange(n - 3, n + 3)
  batch = ds.get_batch(idx)
  fresh = _pack(_docs(200), repack="epoch")
  for j, i in enumerate(idx):
    row = fresh[int(i)]
    for k in row:
      np.testing.assert_array_equal(batch[k][j], row[k])


def test_default_path_unchanged():
  docs = _docs(200)
  ds = _pack(docs)
  plan = packing.plan(np.array([len(d) for d in docs]), SEQ_LEN)
  n = ds.rows_in_epoch(0)
  for epoch in range(2):
    rows = _pieces(_epoch_rows(ds, epoch))
    order = segpack.packing.permutation.epoch_permutation(plan.num_rows, seed=5, epoch=epoch)
    want = [plan.doc[plan.row_splits[r]:plan.row_splits[r + 1]].tolist() for r in order]
    assert rows == want[:n]


def test_refused_combinations():
  docs = _docs(50)
  with pytest.raises(PipelineConfigError, match="strategy='greedy'"):
    _pack(docs, repack="epoch", strategy="greedy")
  with pytest.raises(PipelineConfigError, match="max_segments_per_row=3"):
    segpack.pack_dataset(docs, plan=segpack.PlanOptions(seq_len=SEQ_LEN, max_segments_per_row=3),
                         repack="epoch")
  with pytest.raises(PipelineConfigError, match="repack='yes'"):
    _pack(docs, repack="yes")
