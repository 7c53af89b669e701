"""segpack.data.attention_cost, the one definition of causal attention cost, against a naive
count of (query, key) pairs written with loops; on NumPy and JAX inputs, rows in row order and
in context-parallel order, plans; and the costs its users report (balance, context order, model
FLOPs, the attention benchmark) against the same count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack import packing
from segpack.bench import attention as bench_attention
from segpack.data import context_order
from segpack.data.attention_cost import (AttentionCostError, query_costs, row_attention_cost,
                                         segment_pairs)
from train.model import flops


def naive_query_costs(ids_BxS):
  """Per slot, the keys k <= j with the slot's own non-zero id, counted one by one."""
  ids_BxS = np.asarray(ids_BxS)
  out = np.zeros(ids_BxS.shape, np.int64)
  for b, row in enumerate(ids_BxS.tolist()):
    for j, sid in enumerate(row):
      if sid != 0:
        out[b, j] = sum(1 for k in range(j + 1) if row[k] == sid)
  return out


def packed_rows(rng, b, s):
  """Contiguous rows: ids 1..n in row order, random lengths, then padding."""
  ids = np.zeros((b, s), np.int32)
  for r in range(b):
    at, sid = 0, 1
    while at < s and rng.random() < 0.9:
      n = int(rng.integers(1, s // 3 + 2))
      ids[r, at:at + n] = sid
      at, sid = at + n, sid + 1
  return ids


def test_the_docstring_example():
  ids = np.array([[1, 1, 1, 2, 2, 0]])
  assert query_costs(ids).tolist() == [[1, 2, 3, 1, 2, 0]]
  assert row_attention_cost(ids).tolist() == [9]
  assert segment_pairs([3, 2]).tolist() == [6, 3]


@pytest.mark.parametrize("kind", ["numpy", "jax", "jit"])
def test_query_costs_equal_the_naive_count(kind):
  rng = np.random.default_rng(0)
  fn = {"numpy": query_costs, "jax": lambda x, **kw: query_costs(jnp.asarray(x), **kw),
        "jit": lambda x, **kw: jax.jit(lambda y: query_costs(y, **kw))(jnp.asarray(x))}[kind]
  for s in (1, 5, 48):
    contiguous = packed_rows(rng, 4, s)
    scattered = rng.integers(0, 4, (3, s)).astype(np.int32)  # ids reopened: context order
    for ids in (contiguous, scattered, np.concatenate([contiguous, scattered])):
      np.testing.assert_array_equal(np.asarray(fn(ids)), naive_query_costs(ids))
    np.testing.assert_array_equal(np.asarray(fn(contiguous, contiguous=True)),
                                  naive_query_costs(contiguous))
  assert np.asarray(fn(np.zeros((2, 0), np.int32))).shape == (2, 0)


def test_row_costs_of_ids_and_plans_equal_the_naive_count():
  rng = np.random.default_rng(1)
  ids = np.concatenate([packed_rows(rng, 6, 64), rng.integers(0, 5, (3, 64)).astype(np.int32)])
  want = naive_query_costs(ids).sum(axis=1)
  np.testing.assert_array_equal(row_attention_cost(ids), want)
  np.testing.assert_array_equal(np.asarray(row_attention_cost(jnp.asarray(ids))), want)
  plan = packing.plan(rng.integers(1, 40, 80), 64, strategy="ffd")
  rows = np.zeros((plan.num_rows, 64), np.int32)
  for r in range(plan.num_rows):
    at = 0
    for sid, p in enumerate(range(plan.row_splits[r], plan.row_splits[r + 1]), start=1):
      rows[r, at:at + plan.length[p]] = sid
      at += plan.length[p]
  np.testing.assert_array_equal(row_attention_cost(plan), naive_query_costs(rows).sum(axis=1))


def test_the_users_report_the_same_costs():
  rng = np.random.default_rng(2)
  ids = packed_rows(rng, 4, 32)
  pairs = int(naive_query_costs(ids).sum())
  assert float(flops.attention_pairs(jnp.asarray(ids))) == pairs
  index = context_order.context_order(segment_ids_BxS=ids, context_size=2, balance="documents")
  reordered = np.take_along_axis(ids, index, axis=1)
  assert float(flops.attention_pairs(jnp.asarray(reordered), reordered=True)) == pairs
  costs = context_order.device_costs(segment_ids_BxS=ids, slot_index_BxS=index, context_size=2)
  assert int(costs.sum()) == pairs
  assert bench_attention.useful_flops(ids, heads=1, head_dim=1) == 4.0 * pairs


def test_bad_ids_are_named():
  with pytest.raises(AttentionCostError, match=r"query_costs: segment_ids_BxS must be integer"):
    query_costs(np.zeros((2, 3)))
  with pytest.raises(AttentionCostError, match=r"shape \(3,\)"):
    query_costs(np.zeros(3, np.int32))
  with pytest.raises(AttentionCostError, match="negative id -1"):
    row_attention_cost(np.array([[1, -1]]))
