"""segpack.segments.segment_runs, the one helper that finds runs of segment ids, against a naive
slot-by-slot walk, on NumPy and JAX inputs (eager and jitted); and its users that read runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack import interop
from segpack.attention import checks, cudnn
from segpack.segments import SegmentIdsError, segment_runs


def naive_runs(ids_BxS):
  """`(start, end)` of every slot's run, by walking left and right from the slot."""
  ids_BxS = np.asarray(ids_BxS)
  start = np.zeros(ids_BxS.shape, np.int64)
  end = np.zeros(ids_BxS.shape, np.int64)
  for b, row in enumerate(ids_BxS.tolist()):
    for j, sid in enumerate(row):
      lo = j
      while lo > 0 and row[lo - 1] == sid:
        lo -= 1
      hi = j + 1
      while hi < len(row) and row[hi] == sid:
        hi += 1
      start[b, j], end[b, j] = lo, hi
  return start, end


def random_ids(rng, b, s):
  """Rows of short runs: ids drawn from a few values (padding runs and reopened ids included)."""
  values = rng.integers(0, 4, (b, s))
  repeats = rng.integers(1, 5, (b, s))
  return np.stack([np.repeat(v, r)[:s] for v, r in zip(values, repeats)]).astype(np.int32)


def test_the_docstring_example():
  start, end = segment_runs(np.array([[1, 1, 2, 0]]))
  assert start.tolist() == [[0, 0, 2, 3]] and end.tolist() == [[2, 2, 3, 4]]


@pytest.mark.parametrize("kind", ["numpy", "jax", "jit"])
def test_runs_equal_the_naive_walk(kind):
  rng = np.random.default_rng(0)
  fn = {"numpy": segment_runs, "jax": lambda x: segment_runs(jnp.asarray(x)),
        "jit": lambda x: jax.jit(segment_runs)(jnp.asarray(x))}[kind]
  for s in (1, 2, 7, 64):
    ids = random_ids(rng, 5, s)
    start, end = fn(ids)
    want_start, want_end = naive_runs(ids)
    assert isinstance(start, np.ndarray) == (kind == "numpy")
    assert np.asarray(start).dtype == np.int32
    np.testing.assert_array_equal(np.asarray(start), want_start)
    np.testing.assert_array_equal(np.asarray(end), want_end)


def test_empty_rows_and_bad_input():
  start, end = segment_runs(np.zeros((3, 0), np.int32))
  assert start.shape == end.shape == (3, 0)
  with pytest.raises(SegmentIdsError, match=r"integer \[B, S\].*shape \(4,\)"):
    segment_runs(np.zeros(4, np.int32))
  with pytest.raises(SegmentIdsError, match="float"):
    segment_runs(np.zeros((1, 4)))


def test_the_runs_users_agree_with_the_naive_walk():
  """position_ids, cuDNN's segment count and the contiguity check read runs through it."""
  rng = np.random.default_rng(1)
  ids = random_ids(rng, 6, 40)
  want_start, _ = naive_runs(ids)
  slots = np.arange(ids.shape[1])
  np.testing.assert_array_equal(interop.position_ids(ids),
                                np.where(ids != 0, slots - want_start, 0))
  new_segment = (want_start == slots) & (ids != 0)
  np.testing.assert_array_equal(np.asarray(cudnn.count_segments(jnp.asarray(ids))),
                                new_segment.sum(axis=1))
  reopened = [r for r, row in enumerate(ids)
              if len({int(v) for v in row[new_segment[r]]}) < int(new_segment[r].sum())]
  found = checks.find_noncontiguous(ids)
  assert (found is None) == (not reopened) and (found is None or found[0] == reopened[0])
