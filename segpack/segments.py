"""Runs of segment ids: where each slot's run starts and ends (the one helper that finds them).

A *run* is a maximal stretch of equal ids along a row's slots; padding (id 0) forms runs too. In a
packed row every non-zero id is one run, a segment. `segment_runs` accepts NumPy or JAX arrays and
returns the same kind (JAX arrays: jit-compatible, static shapes; anything else is read by NumPy).
The attention kernels' block ranges and cuDNN's packed layout, `segpack.interop.position_ids`, the
input checks, the attention cost and the benchmarks' bounds all find runs through it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from segpack.errors import UserError

__all__ = ["SegmentIdsError", "segment_runs"]


class SegmentIdsError(UserError, ValueError):
  """Segment ids of the wrong shape or type (the message echoes them)."""


def segment_runs(segment_ids_BxS: Any) -> tuple[Any, Any]:
  """Start (inclusive) and end (exclusive) slot of the run holding every slot.

  Algorithm: a slot starts a run when its id differs from the previous slot's (or it is slot
  0), and ends one when the next slot's differs (or it is the last slot); a slot's start is the
  latest start at or before it (a running maximum), its end the earliest end after it (a
  running minimum from the right).

  Example: ids `[1, 1, 2, 0]` give starts `[0, 0, 2, 3]` and ends `[2, 2, 3, 4]`.

  Args:
    segment_ids_BxS: integer `[B, S]` ids, a JAX array or anything NumPy reads.

  Returns:
    `(start_BxS, end_BxS)`, int32, JAX for a JAX input, else NumPy.

  Raises:
    SegmentIdsError: the ids are not an integer `[B, S]` array.
  """
  xp = jnp if isinstance(segment_ids_BxS, jax.Array) else np
  ids_BxS = xp.asarray(segment_ids_BxS)
  if ids_BxS.ndim != 2 or not xp.issubdtype(ids_BxS.dtype, xp.integer):
    raise SegmentIdsError(f"segment_runs: segment_ids_BxS must be integer [B, S], got shape "
                          f"{tuple(ids_BxS.shape)} and dtype {ids_BxS.dtype}")
  b, s = ids_BxS.shape
  if s == 0:
    return xp.zeros((b, 0), xp.int32), xp.zeros((b, 0), xp.int32)
  pos_S = xp.arange(s, dtype=xp.int32)
  change_BxS1 = ids_BxS[:, 1:] != ids_BxS[:, :-1]
  edge_Bx1 = xp.ones_like(ids_BxS[:, :1], dtype=bool)  # the rows' sharding, on any mesh
  is_start_BxS = xp.concatenate([edge_Bx1, change_BxS1], axis=1)
  is_end_BxS = xp.concatenate([change_BxS1, edge_Bx1], axis=1)
  starts_BxS = xp.where(is_start_BxS, pos_S, 0).astype(xp.int32)
  ends_BxS = xp.where(is_end_BxS, pos_S + 1, s).astype(xp.int32)
  if xp is np:
    start_BxS = np.maximum.accumulate(starts_BxS, axis=1)
    end_BxS = np.minimum.accumulate(ends_BxS[:, ::-1], axis=1)[:, ::-1]
  else:
    start_BxS = jax.lax.cummax(starts_BxS, axis=1)
    end_BxS = jax.lax.cummin(ends_BxS, axis=1, reverse=True)
  return start_BxS, end_BxS
