"""Segment ids -> the layouts of flash-attention-style varlen APIs.

Both functions accept NumPy or JAX arrays of shape `[S]` or `[B, S]` (segment ids 1..k in row
order, 0 = padding, as `segpack.pack_dataset` produces them) and return the same kind of array.
NumPy inputs are computed with NumPy; JAX inputs with `jax.numpy`, jit-compatible with static
output shapes.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from segpack.errors import UserError
from segpack.segments import segment_runs


class InteropError(UserError, ValueError):
  """Invalid input to an interop function (the message names the argument and the value)."""


def _namespace(x: Any):
  """(array module, array) for `x`: NumPy for NumPy arrays and Python sequences, else jax.numpy."""
  if isinstance(x, (np.ndarray, np.generic, list, tuple)):
    return np, np.asarray(x)
  return jnp, jnp.asarray(x)


def _as_batched(xp, segment_ids: Any, name: str):
  if segment_ids.ndim not in (1, 2):
    raise InteropError(f"{name}: segment_ids must have shape [S] or [B, S], got shape "
                       f"{tuple(segment_ids.shape)}")
  if not xp.issubdtype(segment_ids.dtype, xp.integer):
    raise InteropError(f"{name}: segment_ids must be integers, got dtype {segment_ids.dtype}")
  return segment_ids[None] if segment_ids.ndim == 1 else segment_ids


def cu_seqlens(segment_ids: Any, max_segments: int) -> Any:
  """Cumulative segment lengths per row, static shape, for varlen attention kernels.

  Algorithm:
    1. Count the slots of every segment id 1..max_segments per row (a per-row histogram;
       padding slots, id 0, fall in a bin that is dropped).
    2. `cu[b] = [0, n_1, n_1 + n_2, ..., n_1 + ... + n_max]`: the running sum of the counts.
       Missing segments count 0, so a row with k < max_segments segments repeats its last offset
       (the row's number of real slots) up to the static length.

  Example: segment_ids `[1, 1, 2, 2, 2, 0]`, max_segments 3 -> `[0, 2, 5, 5]`.

  Segment ids must be contiguous and numbered 1..k in row order (the pipeline's contract). With
  NumPy input, a segment id above `max_segments` raises `InteropError`; under `jit` it cannot be
  checked and such segments are left out of the offsets (use the pipeline's
  `max_segments_per_row` to guarantee the bound).

  Args:
    segment_ids: int `[S]` or `[B, S]`.
    max_segments: static upper bound N on segments per row.

  Returns:
    int32 `[N + 1]` or `[B, N + 1]` (matching the input's rank).
  """
  if isinstance(max_segments, bool) or not isinstance(max_segments, (int, np.integer)) or (
      max_segments < 1):
    raise InteropError(f"cu_seqlens: max_segments must be an int >= 1, got {max_segments!r}")
  xp, ids = _namespace(segment_ids)
  ids_BxS = _as_batched(xp, ids, "cu_seqlens")
  n = int(max_segments)
  if xp is np:
    top = int(ids_BxS.max()) if ids_BxS.size else 0
    if top > n:
      raise InteropError(f"cu_seqlens: segment_ids hold segment id {top} > max_segments={n}")
    if ids_BxS.size and int(ids_BxS.min()) < 0:
      raise InteropError(f"cu_seqlens: segment_ids must be >= 0, got {int(ids_BxS.min())}")
  batch = ids_BxS.shape[0]
  bins = xp.clip(ids_BxS, 0, n + 1).astype(xp.int32)  # bin 0 padding, n + 1 overflow
  flat = (xp.arange(batch, dtype=xp.int32)[:, None] * (n + 2) + bins).reshape(-1)
  if xp is np:
    counts = np.bincount(flat, minlength=batch * (n + 2))
  else:
    counts = xp.zeros(batch * (n + 2), dtype=xp.int32).at[flat].add(1)
  counts_BxN = counts.reshape(batch, n + 2)[:, 1:n + 1].astype(xp.int32)
  cu_BxN1 = xp.concatenate(
      [xp.zeros((batch, 1), dtype=xp.int32), xp.cumsum(counts_BxN, axis=1, dtype=xp.int32)],
      axis=1)
  return cu_BxN1[0] if ids.ndim == 1 else cu_BxN1


def position_ids(segment_ids: Any) -> Any:
  """Positions restarting at 0 at every segment, 0 on padding (the pipeline's
  `segment_positions`, for APIs that take position ids instead of segment ids).

  Algorithm: `position[i] = i - start[i]`, where `start[i]` is the first slot of the run of
  equal ids holding slot `i` (`segpack.segments.segment_runs`), and 0 where the id is 0.

  Example: `[1, 1, 1, 2, 2, 0, 0]` -> `[0, 1, 2, 0, 1, 0, 0]`.

  Args:
    segment_ids: int `[S]` or `[B, S]`.

  Returns:
    int32 positions of the same shape.
  """
  xp, ids = _namespace(segment_ids)
  ids_BxS = _as_batched(xp, ids, "position_ids")
  slot_S = xp.arange(ids_BxS.shape[1], dtype=xp.int32)
  start_BxS, _ = segment_runs(ids_BxS)
  pos_BxS = xp.where(ids_BxS != 0, slot_S[None, :] - start_BxS, 0).astype(xp.int32)
  return pos_BxS[0] if ids.ndim == 1 else pos_BxS
