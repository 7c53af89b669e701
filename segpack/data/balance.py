"""Global batches balanced by attention cost: which data-parallel rank takes which row.

A packed row's attention work grows with the sum of its segments' squared lengths, not with its
token count, so at long sequence lengths two rows of the same length can cost very different
amounts (one 32k-token document against forty 800-token ones: about 50x). Data-parallel ranks
synchronize every step, so the step takes as long as the rank with the most attention work.
This module reorders the rows of each global batch so the ranks' sums are close to the mean; the
batch's content is unchanged, every rank keeps the same number of rows. Pure NumPy.

Rows are costed by `segpack.data.attention_cost.row_attention_cost`.

- `assign_rows`: the balanced order of one global batch (or of many at once).
- `BalanceOptions`: the option of `segpack.StreamBatches(balance=...)`, which applies
  `assign_rows` to every global batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from segpack.data.options import PipelineConfigError
from segpack.errors import UserError

__all__ = ["BalanceOptions", "assign_rows"]


class BalanceError(UserError, ValueError):
  """A balancing argument is invalid; the message names it and echoes the value."""


def assign_rows(costs_R: np.ndarray, *, num_ranks: int) -> np.ndarray:
  """A permutation of one global batch's rows so that every rank's cost sum is close to the mean.

  Rank `r` takes the contiguous block `order[r*m:(r+1)*m]` of the result, `m = R / num_ranks`
  rows. The rule is longest-processing-time first with a row quota per rank:

  1. Sort the rows by cost, descending; equal costs keep row-index order (a stable sort).
  2. Give each row in that order to the rank with the smallest cost sum among the ranks that
     hold fewer than `m` rows (ties: the lowest rank).
  3. The result lists rank 0's rows, then rank 1's, ...; each rank's rows in row-index order.

  Worked example: costs [5, 1, 4, 2, 3, 3], 2 ranks of 3 rows. Descending: rows 0 (5), 2 (4),
  4 (3), 5 (3), 3 (2), 1 (1). Row 0 -> rank 0 (sums 5, 0); row 2 -> rank 1 (5, 4); row 4 ->
  rank 1 (5, 7); row 5 -> rank 0 (8, 7); row 3 -> rank 1 (8, 9), now full; row 1 -> rank 0
  (9, 9). Result [0, 1, 5, 2, 3, 4]: both ranks sum to 9 (a random split could give 12 and 6).

  The result depends on the costs only (deterministic). With two rows per rank it pairs the
  largest with the smallest row, which is optimal; in general it is a heuristic whose largest
  sum stays close to the optimum (tests/data/test_balance.py compares it with exhaustive search).
  The sums are exact for integer costs below 2**53.

  Args:
    costs_R: costs `[R]`, or `[G, R]` for `G` batches balanced independently (vectorized).
    num_ranks: ranks; must divide `R`.

  Returns:
    int64 permutation(s) of `range(R)`, the shape of `costs_R`.
  """
  costs = np.asarray(costs_R, dtype=np.float64)
  if costs.ndim not in (1, 2):
    raise BalanceError(f"assign_rows: costs_R must be [R] or [G, R], got shape {costs.shape}")
  if not isinstance(num_ranks, (int, np.integer)) or num_ranks <= 0:
    raise BalanceError(f"assign_rows: num_ranks must be a positive int, got {num_ranks!r}")
  costs_GxR = costs.reshape(-1, costs.shape[-1])
  g, r = costs_GxR.shape
  if r % num_ranks:
    raise BalanceError(f"assign_rows: num_ranks={num_ranks} does not divide the {r} rows")
  quota = r // num_ranks
  order_GxR = np.argsort(-costs_GxR, axis=1, kind="stable")
  loads_GxN = np.zeros((g, num_ranks))
  counts_GxN = np.zeros((g, num_ranks), dtype=np.int64)
  rank_GxR = np.zeros((g, r), dtype=np.int64)
  batches = np.arange(g)
  for step in range(r):
    rows_G = order_GxR[:, step]
    open_loads_GxN = np.where(counts_GxN < quota, loads_GxN, np.inf)
    rank_G = np.argmin(open_loads_GxN, axis=1)  # first minimum: the lowest rank
    loads_GxN[batches, rank_G] += costs_GxR[batches, rows_G]
    counts_GxN[batches, rank_G] += 1
    rank_GxR[batches, rows_G] = rank_G
  perm_GxR = np.argsort(rank_GxR, axis=1, kind="stable")
  return perm_GxR.reshape(costs.shape).astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BalanceOptions:
  """Balances every global batch of a `segpack.StreamBatches` over its data-parallel ranks.

  Attributes:
    num_ranks: data-parallel ranks that split the global batch (devices along the batch axes of
      the mesh, over all processes); divides the global batch size and is a multiple of the
      process count.
  """

  num_ranks: int

  def check(self, *, global_batch_size: int, process_count: int, fn: str) -> None:
    """Raises a `PipelineConfigError` naming the field unless the layout divides evenly."""
    n = self.num_ranks
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
      raise PipelineConfigError(f"{fn}: balance.num_ranks must be a positive int, got {n!r}")
    if global_batch_size % n or n % process_count:
      raise PipelineConfigError(
          f"{fn}: balance.num_ranks={n} must divide global_batch_size={global_batch_size} and "
          f"be a multiple of process_count={process_count}")
