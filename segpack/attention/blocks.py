"""Block ranges for the segment flash kernel, computed in plain `jnp` outside the kernel.

Segments are contiguous runs, so the keys a query block needs form one interval, and so do the
queries a key block serves. `q_block_ranges` and `kv_block_ranges` turn segment ids into those
intervals, in blocks, plus the sub-interval of blocks that lie inside one segment and (causal)
entirely at or below the diagonal: those need no element-wise mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from segpack.segments import segment_runs

_BIG = 2**30


def _cdiv(a: jax.Array, b: int) -> jax.Array:
  return (a + b - 1) // b


def _one_segment(seg_BxNxC: jax.Array) -> jax.Array:
  """True where a block's slots all hold the same non-padding segment."""
  return (seg_BxNxC.min(-1) == seg_BxNxC.max(-1)) & (seg_BxNxC[..., 0] != 0)


def q_block_ranges(
    segment_ids_BxS: jax.Array, *, block_q: int, block_k: int, causal: bool) -> jax.Array:
  """Key/value block ranges of every query block.

  Args:
    segment_ids_BxS: segment ids, S a multiple of `block_q` and `block_k`.
    block_q: query block.
    block_k: key/value block.
    causal: whether keys after the query are hidden.

  Returns:
    int32 `[B, S // block_q, 4]`: `kv_lo, kv_hi` (the key blocks to visit, `[kv_lo, kv_hi)`;
    empty for an all-padding block) and `full_lo, full_hi` (the sub-range needing no mask; both
    equal `kv_hi` when there is none).
  """
  b, s = segment_ids_BxS.shape
  start_BxS, end_BxS = segment_runs(segment_ids_BxS)
  pos_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return _q_ranges(segment_ids_BxS, pos_BxS, start_BxS, end_BxS, block_q=block_q,
                   block_k=block_k, causal=causal)


def kv_block_ranges(
    segment_ids_BxS: jax.Array, *, block_q: int, block_k: int, causal: bool) -> jax.Array:
  """Query block ranges of every key/value block (for the dK/dV kernel).

  Args:
    segment_ids_BxS, block_q, block_k, causal: as in `q_block_ranges`.

  Returns:
    int32 `[B, S // block_k, 4]`: `q_lo, q_hi` (the query blocks that see this key block) and
    `full_lo, full_hi` (the sub-range needing no mask; both equal `q_hi` when there is none).
  """
  return _kv_ranges(segment_ids_BxS, lambda slot_BxN: slot_BxN, block_q=block_q,
                    block_k=block_k, causal=causal)


def _q_ranges(seg_q_BxQ: jax.Array, q_pos_BxQ: jax.Array, start_BxQ: jax.Array,
              end_BxQ: jax.Array, *, block_q: int, block_k: int, causal: bool) -> jax.Array:
  """Key/value block ranges of every query block, from each query's slot and segment run.

  Args:
    seg_q_BxQ: segment ids of the queries, Q a multiple of `block_q`.
    q_pos_BxQ: int32 slot index of every query in the row of keys.
    start_BxQ: first slot of each query's segment run in the row of keys.
    end_BxQ: one past the last slot of that run.
    block_q, block_k, causal: as in `q_block_ranges`.

  Returns:
    int32 `[B, Q // block_q, 4]` as `q_block_ranges`.
  """
  b, sq = seg_q_BxQ.shape
  nq = sq // block_q
  valid_BxQ = seg_q_BxQ != 0
  reach_BxQ = q_pos_BxQ + 1 if causal else end_BxQ
  lo_BxN = jnp.where(valid_BxQ, start_BxQ, _BIG).reshape(b, nq, block_q).min(-1)
  hi_BxN = jnp.where(valid_BxQ, reach_BxQ, 0).reshape(b, nq, block_q).max(-1)
  any_BxN = hi_BxN > 0
  kv_lo_BxN = jnp.where(any_BxN, lo_BxN // block_k, 0)
  kv_hi_BxN = jnp.where(any_BxN, _cdiv(hi_BxN, block_k), 0)
  one_BxN = _one_segment(seg_q_BxQ.reshape(b, nq, block_q))
  q0_BxN = q_pos_BxQ.reshape(b, nq, block_q).min(-1)
  full_lo_BxN = jnp.maximum(kv_lo_BxN, _cdiv(start_BxQ[:, ::block_q], block_k))
  full_hi_BxN = jnp.minimum(kv_hi_BxN, end_BxQ[:, ::block_q] // block_k)
  if causal:
    full_hi_BxN = jnp.minimum(full_hi_BxN, (q0_BxN + 1) // block_k)
  return _with_full(kv_lo_BxN, kv_hi_BxN, full_lo_BxN, full_hi_BxN, one_BxN)


def _kv_ranges(seg_k_BxS: jax.Array, to_query: Callable[[jax.Array], jax.Array], *,
               block_q: int, block_k: int, causal: bool) -> jax.Array:
  """Query block ranges of every key/value block, queries found by `to_query`.

  Args:
    seg_k_BxS: segment ids of the keys in row order, S a multiple of `block_k`.
    to_query: maps slot positions `[B, N]` to query indices: how many queries lie before each
      slot (the identity when the queries are the row itself).
    block_q, block_k, causal: as in `q_block_ranges`.

  Returns:
    int32 `[B, S // block_k, 4]` as `kv_block_ranges`.
  """
  b, sk = seg_k_BxS.shape
  nk = sk // block_k
  start_BxS, end_BxS = segment_runs(seg_k_BxS)
  pos_S = jnp.arange(sk, dtype=jnp.int32)
  valid_BxS = seg_k_BxS != 0
  first_BxS = jnp.broadcast_to(pos_S, (b, sk)) if causal else start_BxS
  lo_BxN = jnp.where(valid_BxS, first_BxS, _BIG).reshape(b, nk, block_k).min(-1)
  hi_BxN = jnp.where(valid_BxS, end_BxS, 0).reshape(b, nk, block_k).max(-1)
  idx_lo_BxN = to_query(lo_BxN)
  idx_hi_BxN = to_query(hi_BxN)
  any_BxN = idx_hi_BxN > idx_lo_BxN
  q_lo_BxN = jnp.where(any_BxN, idx_lo_BxN // block_q, 0)
  q_hi_BxN = jnp.where(any_BxN, _cdiv(idx_hi_BxN, block_q), 0)
  one_BxN = _one_segment(seg_k_BxS.reshape(b, nk, block_k))
  seg_lo_BxN = to_query(start_BxS[:, ::block_k])
  seg_hi_BxN = to_query(end_BxS[:, ::block_k])
  full_lo_BxN = jnp.maximum(q_lo_BxN, _cdiv(seg_lo_BxN, block_q))
  if causal:
    last_k_BxN = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32) * block_k + block_k - 1, (b, nk))
    full_lo_BxN = jnp.maximum(full_lo_BxN, _cdiv(to_query(last_k_BxN), block_q))
  full_hi_BxN = jnp.minimum(q_hi_BxN, seg_hi_BxN // block_q)
  return _with_full(q_lo_BxN, q_hi_BxN, full_lo_BxN, full_hi_BxN, one_BxN)


def _with_full(lo_BxN: jax.Array, hi_BxN: jax.Array, full_lo_BxN: jax.Array,
               full_hi_BxN: jax.Array, one_BxN: jax.Array) -> jax.Array:
  """The ranges stacked `[B, N, 4]`; an empty or mixed-segment full range set to `[hi, hi)`."""
  has_full_BxN = one_BxN & (full_hi_BxN > full_lo_BxN)
  full_lo_BxN = jnp.where(has_full_BxN, full_lo_BxN, hi_BxN)
  full_hi_BxN = jnp.where(has_full_BxN, full_hi_BxN, hi_BxN)
  return jnp.stack([lo_BxN, hi_BxN, full_lo_BxN, full_hi_BxN], axis=-1).astype(jnp.int32)


def tiles_computed(segment_ids_BxS: jax.Array, *, block_q: int, block_k: int,
                   causal: bool) -> jax.Array:
  """Number of (query block, key block) tiles the forward kernel visits, per row `[B]`."""
  r = q_block_ranges(segment_ids_BxS, block_q=block_q, block_k=block_k, causal=causal)
  return (r[..., 1] - r[..., 0]).sum(-1)


def _searchsorted_rows(sorted_BxQ: jax.Array, values_BxN: jax.Array) -> jax.Array:
  """Per row, how many of `sorted_BxQ` (ascending) are below each value (`side="left"`)."""
  return jax.vmap(lambda a, x: jnp.searchsorted(a, x, side="left"))(
      sorted_BxQ, values_BxN).astype(jnp.int32)


def slot_q_block_ranges(
    seg_q_BxQ: jax.Array, q_pos_BxQ: jax.Array, seg_k_BxS: jax.Array, *, block_q: int,
    block_k: int, causal: bool) -> jax.Array:
  """`q_block_ranges` for queries placed at slot positions over keys in row order.

  The keys are a whole row in natural (slot) order; the queries are any subset of its slots,
  `q_pos_BxQ` their slot indices (ascending; padding queries beyond the row). A query `i` needs
  the keys `[start[q_pos[i]], q_pos[i] + 1)` (causal) or `[start, end)` of its segment in row
  coordinates. With `q_pos = arange(S)` and `seg_q = seg_k` the result equals `q_block_ranges`.

  Args:
    seg_q_BxQ: segment ids of the queries, Q a multiple of `block_q`.
    q_pos_BxQ: int32 slot index of every query in the row of keys.
    seg_k_BxS: segment ids of the keys in row order, S a multiple of `block_k`.
    block_q, block_k, causal: as in `q_block_ranges`.

  Returns:
    int32 `[B, Q // block_q, 4]` as `q_block_ranges`.
  """
  sk = seg_k_BxS.shape[1]
  start_BxS, end_BxS = segment_runs(seg_k_BxS)
  at_BxQ = jnp.clip(q_pos_BxQ, 0, sk - 1)
  start_BxQ = jnp.take_along_axis(start_BxS, at_BxQ, axis=1)
  end_BxQ = jnp.take_along_axis(end_BxS, at_BxQ, axis=1)
  return _q_ranges(seg_q_BxQ, q_pos_BxQ, start_BxQ, end_BxQ, block_q=block_q,
                   block_k=block_k, causal=causal)


def slot_kv_block_ranges(
    seg_q_BxQ: jax.Array, q_pos_BxQ: jax.Array, seg_k_BxS: jax.Array, *, block_q: int,
    block_k: int, causal: bool) -> jax.Array:
  """`kv_block_ranges` for queries placed at ascending slot positions over keys in row order.

  A key block needs the queries whose slots lie in `[min j (causal) or min start[j],
  max end[j])` over its keys `j`; the queries being ascending, that is one interval of query
  indices (`searchsorted`), and so are the queries inside one segment and at or after the key
  block's last key. With `q_pos = arange(S)` and `seg_q = seg_k` the result equals
  `kv_block_ranges`.

  Args:
    seg_q_BxQ: segment ids of the queries, Q a multiple of `block_q` (only its shape is read).
    q_pos_BxQ: int32 slot index of every query, ascending per row (padding queries last, beyond
      the row).
    seg_k_BxS: segment ids of the keys in row order, S a multiple of `block_k`.
    block_q, block_k, causal: as in `q_block_ranges`.

  Returns:
    int32 `[B, S // block_k, 4]` as `kv_block_ranges`.
  """
  del seg_q_BxQ
  return _kv_ranges(seg_k_BxS, functools.partial(_searchsorted_rows, q_pos_BxQ),
                    block_q=block_q, block_k=block_k, causal=causal)
