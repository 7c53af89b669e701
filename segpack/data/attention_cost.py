"""The causal attention cost of packed rows: the one definition, per query, per row, per plan row.

A query at slot `j` attends to the slots `k <= j` of its own segment (a segment is every slot of
one non-zero id in the row), so its cost is the number of those keys, its position in the
segment plus one; padding (id 0) costs 0. A row's cost is the sum over its queries, which is
`sum_i l_i (l_i + 1) / 2` over its segments of `l_i` slots: the (query, key) pairs a causal mask
inside each segment keeps, proportional to the row's attention FLOPs.

The rank balance of `StreamBatches` (`segpack.data.balance`), the context-parallel slot orders
(`segpack.data.context_order`), the trainer's model FLOPs (`train.model.flops`) and the attention
benchmarks all take their costs from here. The functions accept JAX arrays (jit-compatible,
int32) or anything else NumPy reads (computed with NumPy, int64).

Example: ids `[1, 1, 1, 2, 2, 0]` give query costs `[1, 2, 3, 1, 2, 0]` and the row cost 9
(6 + 3).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from segpack.errors import UserError
from segpack.packing.plan_format import Plan
from segpack.segments import segment_runs

__all__ = ["AttentionCostError", "query_costs", "row_attention_cost", "segment_pairs"]


class AttentionCostError(UserError, ValueError):
  """An attention-cost argument is invalid; the message names it and echoes the value."""


def _checked_ids(segment_ids_BxS: Any, where: str) -> tuple[Any, Any]:
  """`(array module, ids)`: jax.numpy for a JAX array, else NumPy; integer `[B, S]`, ids >= 0."""
  xp = jnp if isinstance(segment_ids_BxS, jax.Array) else np
  ids = xp.asarray(segment_ids_BxS)
  if ids.ndim != 2 or not xp.issubdtype(ids.dtype, xp.integer):
    raise AttentionCostError(
        f"{where}: segment_ids_BxS must be integer [B, S], got shape {tuple(ids.shape)} and "
        f"dtype {ids.dtype}")
  if xp is np and ids.size and ids.min() < 0:
    raise AttentionCostError(f"{where}: segment_ids_BxS has a negative id {ids.min()}")
  return xp, ids


def query_costs(segment_ids_BxS: Any, *, contiguous: bool = False) -> Any:
  """The causal attention cost of every query slot: the number of keys it attends to.

  Algorithm: sort each row's ids stably (slot order kept inside a segment), so every segment is
  one run (`segpack.segments.segment_runs`); a slot's cost is its position in its run plus one
  (0 on padding); the costs go back to the slots' own order.

  Args:
    segment_ids_BxS: integer segment ids, 0 on padding; a segment need not be contiguous (a row
      in context-parallel order).
    contiguous: the caller knows every non-zero id is one contiguous run (a row in row order):
      the sort is skipped. The result is then the same.

  Returns:
    `[B, S]`: int64 for NumPy input, int32 for JAX.

  Raises:
    AttentionCostError: the ids are not integer `[B, S]`, or (NumPy) hold a negative id.
  """
  xp, ids = _checked_ids(segment_ids_BxS, "query_costs")
  cost_dtype = xp.int64 if xp is np else xp.int32
  if ids.shape[1] == 0:
    return xp.zeros(ids.shape, cost_dtype)
  pos_S = xp.arange(ids.shape[1], dtype=xp.int32)
  if contiguous:
    start_BxS, _ = segment_runs(ids)
    return xp.where(ids != 0, pos_S - start_BxS + 1, 0).astype(cost_dtype)
  order_BxS = (np.argsort(ids, axis=1, kind="stable") if xp is np
               else jnp.argsort(ids, axis=1, stable=True))
  sorted_BxS = xp.take_along_axis(ids, order_BxS, axis=1)
  start_BxS, _ = segment_runs(sorted_BxS)
  rank_BxS = xp.where(sorted_BxS != 0, pos_S - start_BxS + 1, 0).astype(cost_dtype)
  back_BxS = (np.argsort(order_BxS, axis=1, kind="stable") if xp is np
              else jnp.argsort(order_BxS, axis=1, stable=True))  # the inverse permutation
  return xp.take_along_axis(rank_BxS, back_BxS, axis=1)


def segment_pairs(lengths: Any) -> Any:
  """The cost of whole segments of `lengths` slots: `l (l + 1) / 2`, the sum of their
  `query_costs` (1 + 2 + ... + l). NumPy in, int64 out."""
  lengths = np.asarray(lengths, dtype=np.int64)
  return lengths * (lengths + 1) // 2


def row_attention_cost(rows: Plan | Any) -> Any:
  """The causal attention cost of every row: the sum of its queries' `query_costs`.

  Example: a row with segments of 3 and 2 tokens and 3 padding slots costs 6 + 3 = 9.

  Args:
    rows: a `segpack.packing.Plan` (one cost per plan row, from its piece lengths by
      `segment_pairs`), or integer segment ids `[B, S]` (one cost per row; NumPy or JAX).

  Returns:
    `[num_rows]` (plan, int64) or `[B]` (segment ids: int64 for NumPy, int32 for JAX).

  Raises:
    AttentionCostError: `rows` is neither a Plan nor integer `[B, S]` ids >= 0.
  """
  if isinstance(rows, Plan):
    cumulative = np.concatenate([[0], np.cumsum(segment_pairs(rows.length), dtype=np.int64)])
    splits = np.asarray(rows.row_splits, dtype=np.int64)
    return cumulative[splits[1:]] - cumulative[splits[:-1]]
  _, ids = _checked_ids(rows, "row_attention_cost")
  costs_BxS = query_costs(ids)
  return costs_BxS.sum(axis=1, dtype=costs_BxS.dtype)
