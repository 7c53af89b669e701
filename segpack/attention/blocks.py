"""Block ranges for the segment flash kernel, computed in plain `jnp` outside the kernel.

Segments are contiguous runs, so the keys a query block needs form one interval, and so do the
queries a key block serves. `q_block_ranges` and `kv_block_ranges` turn segment ids into those
intervals, in blocks, plus the sub-interval of blocks that lie inside one segment and (causal)
entirely at or below the diagonal: those need no element-wise mask.
"""

from __future__ import annotations

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
  nq = s // block_q
  start_BxS, end_BxS = segment_runs(segment_ids_BxS)
  pos_S = jnp.arange(s, dtype=jnp.int32)
  valid_BxS = segment_ids_BxS != 0
  reach_BxS = jnp.broadcast_to(pos_S + 1, (b, s)) if causal else end_BxS
  lo_BxN = jnp.where(valid_BxS, start_BxS, _BIG).reshape(b, nq, block_q).min(-1)
  hi_BxN = jnp.where(valid_BxS, reach_BxS, 0).reshape(b, nq, block_q).max(-1)
  any_BxN = hi_BxN > 0
  kv_lo_BxN = jnp.where(any_BxN, lo_BxN // block_k, 0)
  kv_hi_BxN = jnp.where(any_BxN, _cdiv(hi_BxN, block_k), 0)
  one_BxN = _one_segment(segment_ids_BxS.reshape(b, nq, block_q))
  q0_N = jnp.arange(nq, dtype=jnp.int32) * block_q
  seg_start_BxN = start_BxS[:, ::block_q]
  seg_end_BxN = end_BxS[:, ::block_q]
  full_lo_BxN = jnp.maximum(kv_lo_BxN, _cdiv(seg_start_BxN, block_k))
  full_hi_BxN = jnp.minimum(kv_hi_BxN, seg_end_BxN // block_k)
  if causal:
    full_hi_BxN = jnp.minimum(full_hi_BxN, (q0_N + 1) // block_k)
  has_full_BxN = one_BxN & (full_hi_BxN > full_lo_BxN)
  full_lo_BxN = jnp.where(has_full_BxN, full_lo_BxN, kv_hi_BxN)
  full_hi_BxN = jnp.where(has_full_BxN, full_hi_BxN, kv_hi_BxN)
  return jnp.stack([kv_lo_BxN, kv_hi_BxN, full_lo_BxN, full_hi_BxN], axis=-1).astype(jnp.int32)


def kv_block_ranges(
    segment_ids_BxS: jax.Array, *, block_q: int, block_k: int, causal: bool) -> jax.Array:
  """Query block ranges of every key/value block (for the dK/dV kernel).

  Args:
    segment_ids_BxS: segment ids, S a multiple of `block_q` and `block_k`.
    block_q: query block.
    block_k: key/value block.
    causal: whether keys after the query are hidden.

  Returns:
    int32 `[B, S // block_k, 4]`: `q_lo, q_hi` (the query blocks that see this key block) and
    `full_lo, full_hi` (the sub-range needing no mask; both equal `q_hi` when there is none).
  """
  b, s = segment_ids_BxS.shape
  nk = s // block_k
  start_BxS, end_BxS = segment_runs(segment_ids_BxS)
  pos_S = jnp.arange(s, dtype=jnp.int32)
  valid_BxS = segment_ids_BxS != 0
  first_BxS = jnp.broadcast_to(pos_S, (b, s)) if causal else start_BxS
  lo_BxN = jnp.where(valid_BxS, first_BxS, _BIG).reshape(b, nk, block_k).min(-1)
  hi_BxN = jnp.where(valid_BxS, end_BxS, 0).reshape(b, nk, block_k).max(-1)
  any_BxN = hi_BxN > 0
  q_lo_BxN = jnp.where(any_BxN, lo_BxN // block_q, 0)
  q_hi_BxN = jnp.where(any_BxN, _cdiv(hi_BxN, block_q), 0)
  one_BxN = _one_segment(segment_ids_BxS.reshape(b, nk, block_k))
  k0_N = jnp.arange(nk, dtype=jnp.int32) * block_k
  seg_start_BxN = start_BxS[:, ::block_k]
  seg_end_BxN = end_BxS[:, ::block_k]
  full_lo_BxN = jnp.maximum(q_lo_BxN, _cdiv(seg_start_BxN, block_q))
  if causal:
    full_lo_BxN = jnp.maximum(full_lo_BxN, _cdiv(k0_N + block_k - 1, block_q))
  full_hi_BxN = jnp.minimum(q_hi_BxN, seg_end_BxN // block_q)
  has_full_BxN = one_BxN & (full_hi_BxN > full_lo_BxN)
  full_lo_BxN = jnp.where(has_full_BxN, full_lo_BxN, q_hi_BxN)
  full_hi_BxN = jnp.where(has_full_BxN, full_hi_BxN, q_hi_BxN)
  return jnp.stack([q_lo_BxN, q_hi_BxN, full_lo_BxN, full_hi_BxN], axis=-1).astype(jnp.int32)


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
    block_q: query block.
    block_k: key/value block.
    causal: whether keys after the query are hidden.

  Returns:
    int32 `[B, Q // block_q, 4]` as `q_block_ranges`.
  """
  b, sq = seg_q_BxQ.shape
  sk = seg_k_BxS.shape[1]
  nq = sq // block_q
  start_BxS, end_BxS = segment_runs(seg_k_BxS)
  at_BxQ = jnp.clip(q_pos_BxQ, 0, sk - 1)
  start_BxQ = jnp.take_along_axis(start_BxS, at_BxQ, axis=1)
  end_BxQ = jnp.take_along_axis(end_BxS, at_BxQ, axis=1)
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
  has_full_BxN = one_BxN & (full_hi_BxN > full_lo_BxN)
  full_lo_BxN = jnp.where(has_full_BxN, full_lo_BxN, kv_hi_BxN)
  full_hi_BxN = jnp.where(has_full_BxN, full_hi_BxN, kv_hi_BxN)
  return jnp.stack([kv_lo_BxN, kv_hi_BxN, full_lo_BxN, full_hi_BxN], axis=-1).astype(jnp.int32)


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
    block_q: query block.
    block_k: key/value block.
    causal: whether keys after the query are hidden.

  Returns:
    int32 `[B, S // block_k, 4]` as `kv_block_ranges`.
  """
  b, sk = seg_k_BxS.shape
  del seg_q_BxQ
  nk = sk // block_k
  start_BxS, end_BxS = segment_runs(seg_k_BxS)
  pos_S = jnp.arange(sk, dtype=jnp.int32)
  valid_BxS = seg_k_BxS != 0
  first_BxS = jnp.broadcast_to(pos_S, (b, sk)) if causal else start_BxS
  lo_BxN = jnp.where(valid_BxS, first_BxS, _BIG).reshape(b, nk, block_k).min(-1)
  hi_BxN = jnp.where(valid_BxS, end_BxS, 0).reshape(b, nk, block_k).max(-1)
  idx_lo_BxN = _searchsorted_rows(q_pos_BxQ, lo_BxN)
  idx_hi_BxN = _searchsorted_rows(q_pos_BxQ, hi_BxN)
  any_BxN = idx_hi_BxN > idx_lo_BxN
  q_lo_BxN = jnp.where(any_BxN, idx_lo_BxN // block_q, 0)
  q_hi_BxN = jnp.where(any_BxN, _cdiv(idx_hi_BxN, block_q), 0)
  one_BxN = _one_segment(seg_k_BxS.reshape(b, nk, block_k))
  seg_lo_BxN = _searchsorted_rows(q_pos_BxQ, start_BxS[:, ::block_k])
  seg_hi_BxN = _searchsorted_rows(q_pos_BxQ, end_BxS[:, ::block_k])
  full_lo_BxN = jnp.maximum(q_lo_BxN, _cdiv(seg_lo_BxN, block_q))
  if causal:
    last_k_BxN = jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32) * block_k + block_k - 1, (b, nk))
    full_lo_BxN = jnp.maximum(
        full_lo_BxN, _cdiv(_searchsorted_rows(q_pos_BxQ, last_k_BxN), block_q))
  full_hi_BxN = jnp.minimum(q_hi_BxN, seg_hi_BxN // block_q)
  has_full_BxN = one_BxN & (full_hi_BxN > full_lo_BxN)
  full_lo_BxN = jnp.where(has_full_BxN, full_lo_BxN, q_hi_BxN)
  full_hi_BxN = jnp.where(has_full_BxN, full_hi_BxN, q_hi_BxN)
  return jnp.stack([q_lo_BxN, q_hi_BxN, full_lo_BxN, full_hi_BxN], axis=-1).astype(jnp.int32)
