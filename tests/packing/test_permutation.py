"""Tests for segpack.packing.permutation: the one epoch permutation, the order unpacked random
sampling draws, used for the rows of `pack_dataset` and the examples of minibatch packing."""

import numpy as np
import pytest

import segpack
from segpack.data.options import SpecialTokens
from segpack.packing import LongDocs
from segpack.packing.permutation import epoch_permutation
from segpack.packing.minibatch_planner import MinibatchPlanner


def recipe(n, seed, epoch):
  """What unpacked sampling draws, as the docs write it."""
  return np.random.default_rng(np.random.SeedSequence([seed, epoch])).permutation(n)


@pytest.mark.parametrize("n, seed, epoch", [(1, 0, 0), (10, 0, 1), (1000, 7, 3), (57, 2**40, 9)])
def test_epoch_permutation_is_the_documented_recipe(n, seed, epoch):
  got = epoch_permutation(n, seed=seed, epoch=epoch)
  assert np.array_equal(got, recipe(n, seed, epoch))
  assert sorted(got.tolist()) == list(range(n))
  assert not np.array_equal(epoch_permutation(n, seed=seed, epoch=epoch + 1), got) or n < 3


def test_rows_of_an_epoch_are_the_plan_rows_in_that_order():
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 1000, int(rng.integers(1, 40))).astype(np.int32) for _ in range(80)]
  kw = dict(seq_len=32, num_epochs=2, special_tokens=SpecialTokens(bos_id=1, eos_id=2))
  plain = segpack.pack_dataset(docs, shuffle=False, **kw)
  shuffled = segpack.pack_dataset(docs, seed=5, **kw)
  n = plain.rows_in_epoch(0)
  for epoch in range(2):
    for j, r in enumerate(recipe(n, 5, epoch).tolist()):
      got, want = shuffled[epoch * n + j], plain[r]
      assert all(np.array_equal(got[k], want[k]) for k in want)


def test_minibatch_examples_are_drawn_in_the_same_order():
  lengths = np.random.default_rng(1).integers(0, 30, 60)  # the empty documents are left out
  planner = MinibatchPlanner(lengths, seq_len=16, strategy="ffd", long_docs=LongDocs(),
                             extra_tokens=2, seed=5, shuffle=True,
                             examples_per_batch=4, tokens_per_batch=None, drop_remainder=False)
  examples = np.flatnonzero(lengths > 0)
  for epoch in range(3):
    want = examples[recipe(examples.size, 5, epoch)]
    assert np.array_equal(planner.order(epoch), want)
    assert np.array_equal(planner.plan(epoch).examples, want)
