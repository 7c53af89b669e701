"""Block ranges for the segment flash kernel, computed in plain `jnp` outside the kernel.

Segments are contiguous runs, so the keys a query block needs form one interval, and so do the
queries a key block serves. `q_block_ranges` and `kv_block_ranges` turn segment ids into those
intervals, in blocks, plus the sub-interval of blocks that lie inside one segment and (causal)
entirely at or below the diagonal: those need no element-wise mask.

With shared prefixes (`prefix_ids_BxS`, `segment_attention(prefix_segment_ids=...)`) a branch's
queries also see their prompt segment, which lies before the branch: a query block's key interval
starts at the prompt's first slot (the blocks between the prompt and the branch, e.g. the sibling
branch, are visited with the mask), and a prompt's key block serves the queries up to the end of
its last branch (`prefix_runs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

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
    segment_ids_BxS: jax.Array, *, block_q: int, block_k: int, causal: bool,
    prefix_ids_BxS: jax.Array | None = None) -> jax.Array:
  """Key/value block ranges of every query block.

  Args:
    segment_ids_BxS: segment ids, S a multiple of `block_q` and `block_k`.
    block_q: query block.
    block_k: key/value block.
    causal: whether keys after the query are hidden.
    prefix_ids_BxS: optional shared-prefix ids (each slot's prompt segment, 0 = none): a query
      block's range then also covers its queries' prompt segments, and its mask-free sub-range
      starts at the prompt of a branch that directly follows it.

  Returns:
    int32 `[B, S // block_q, 4]`: `kv_lo, kv_hi` (the key blocks to visit, `[kv_lo, kv_hi)`;
    empty for an all-padding block) and `full_lo, full_hi` (the sub-range needing no mask; both
    equal `kv_hi` when there is none).
  """
  b, s = segment_ids_BxS.shape
  start_BxS, end_BxS = segment_runs(segment_ids_BxS)
  pos_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  first_BxS = free_BxS = None
  if prefix_ids_BxS is not None:
    runs = prefix_runs(segment_ids_BxS, prefix_ids_BxS)
    first_BxS, free_BxS = runs.first_key, runs.free_key
  return _q_ranges(segment_ids_BxS, pos_BxS, start_BxS, end_BxS, block_q=block_q,
                   block_k=block_k, causal=causal, first_BxQ=first_BxS, free_BxQ=free_BxS)


def kv_block_ranges(
    segment_ids_BxS: jax.Array, *, block_q: int, block_k: int, causal: bool,
    prefix_ids_BxS: jax.Array | None = None) -> jax.Array:
  """Query block ranges of every key/value block (for the dK/dV kernel).

  Args:
    segment_ids_BxS, block_q, block_k, causal: as in `q_block_ranges`.
    prefix_ids_BxS: optional shared-prefix ids: a prompt's key block then also serves the
      queries of its branches (up to the end of its last one), its mask-free sub-range those of
      a branch that directly follows it.

  Returns:
    int32 `[B, S // block_k, 4]`: `q_lo, q_hi` (the query blocks that see this key block) and
    `full_lo, full_hi` (the sub-range needing no mask; both equal `q_hi` when there is none).
  """
  reach_BxS = free_BxS = None
  if prefix_ids_BxS is not None:
    runs = prefix_runs(segment_ids_BxS, prefix_ids_BxS)
    reach_BxS, free_BxS = runs.last_query, runs.free_query
  return _kv_ranges(segment_ids_BxS, lambda slot_BxN: slot_BxN, block_q=block_q,
                    block_k=block_k, causal=causal, reach_BxS=reach_BxS, free_BxS=free_BxS)


class PrefixRuns(NamedTuple):
  """Per slot, where its shared prefix reaches (int32 `[B, S]` each; `prefix_runs`).

  Attributes:
    first_key: the first key the slot's query sees: its prompt's first slot, else its own
      segment's start.
    free_key: where its mask-free keys may start: its prompt's first slot when the prompt ends
      right where the slot's segment starts, else its own segment's start.
    last_query: one past the last query that sees the slot's key: the end of the last branch
      whose prompt is the slot's segment, else its own segment's end.
    free_query: where the queries that see all of a key block of the slot's segment may end:
      the end of a branch that starts right where the slot's segment ends, else its own end.
  """

  first_key: jax.Array
  free_key: jax.Array
  last_query: jax.Array
  free_query: jax.Array


def prefix_runs(segment_ids_BxS: jax.Array, prefix_ids_BxS: jax.Array) -> PrefixRuns:
  """Where every slot's prompt segment lies, and where every prompt's branches end.

  Algorithm: a stable argsort of each row's segment ids and a `searchsorted` of the prefix ids
  in the sorted ids give, per slot, the first slot holding its prefix id, the start of that
  segment (ids need not be ordered; a prefix id absent from the row, or 0, gives none). The
  ends of the branches are scattered (`max`) onto their prompts' first slots and read back at
  every slot's segment start. A prompt ending where a branch starts (`start - 1`, `end`) is
  found by looking at the neighbouring slot. Padding slots (segment 0) have no prefix.

  Example: ids `[1 1 1 2 2 3 3 3 4 4 5 5 0 0]` with prefix ids `[0 0 0 1 1 1 1 1 0 0 4 4 0 0]`
  give `first_key = [0 0 0 0 0 0 0 0 8 8 8 8 12 12]` and `last_query = [8 8 8 5 5 8 8 8 12 12
  12 12 14 14]`.

  Args:
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    prefix_ids_BxS: each slot's prompt segment id, 0 = none.

  Returns:
    `PrefixRuns` of int32 `[B, S]` arrays.
  """
  b, s = segment_ids_BxS.shape
  seg_BxS = segment_ids_BxS.astype(jnp.int32)
  pre_BxS = jnp.where(seg_BxS != 0, prefix_ids_BxS.astype(jnp.int32), 0)
  start_BxS, end_BxS = segment_runs(seg_BxS)
  order_BxS = jnp.argsort(seg_BxS, axis=1, stable=True).astype(jnp.int32)
  sorted_BxS = jnp.take_along_axis(seg_BxS, order_BxS, axis=1)
  at_BxS = jnp.clip(_searchsorted_rows(sorted_BxS, pre_BxS), 0, s - 1)
  found_BxS = (jnp.take_along_axis(sorted_BxS, at_BxS, axis=1) == pre_BxS) & (pre_BxS != 0)
  prompt_BxS = jnp.take_along_axis(start_BxS, jnp.take_along_axis(order_BxS, at_BxS, axis=1),
                                   axis=1)
  first_key_BxS = jnp.where(found_BxS, jnp.minimum(prompt_BxS, start_BxS), start_BxS)
  before_BxS = jnp.maximum(start_BxS - 1, 0)
  adjacent_BxS = (pre_BxS != 0) & (start_BxS > 0) & (
      jnp.take_along_axis(seg_BxS, before_BxS, axis=1) == pre_BxS)
  free_key_BxS = jnp.where(
      adjacent_BxS, jnp.take_along_axis(start_BxS, before_BxS, axis=1), start_BxS)
  rows_Bx1 = jnp.arange(b, dtype=jnp.int32)[:, None]
  branch_end_BxS = jnp.zeros((b, s), jnp.int32).at[
      rows_Bx1, jnp.where(found_BxS, prompt_BxS, 0)].max(jnp.where(found_BxS, end_BxS, 0))
  last_query_BxS = jnp.maximum(end_BxS, jnp.take_along_axis(branch_end_BxS, start_BxS, axis=1))
  after_BxS = jnp.minimum(end_BxS, s - 1)
  follows_BxS = (seg_BxS != 0) & (end_BxS < s) & (
      jnp.take_along_axis(pre_BxS, after_BxS, axis=1) == seg_BxS)
  free_query_BxS = jnp.where(
      follows_BxS, jnp.take_along_axis(end_BxS, after_BxS, axis=1), end_BxS)
  return PrefixRuns(first_key_BxS, free_key_BxS, last_query_BxS, free_query_BxS)


def _q_ranges(seg_q_BxQ: jax.Array, q_pos_BxQ: jax.Array, start_BxQ: jax.Array,
              end_BxQ: jax.Array, *, block_q: int, block_k: int, causal: bool,
              first_BxQ: jax.Array | None = None,
              free_BxQ: jax.Array | None = None) -> jax.Array:
  """Key/value block ranges of every query block, from each query's slot and segment run.

  Args:
    seg_q_BxQ: segment ids of the queries, Q a multiple of `block_q`.
    q_pos_BxQ: int32 slot index of every query in the row of keys.
    start_BxQ: first slot of each query's segment run in the row of keys.
    end_BxQ: one past the last slot of that run.
    block_q, block_k, causal: as in `q_block_ranges`.
    first_BxQ: the first key each query sees, when before its run (a shared prefix); None:
      `start_BxQ`.
    free_BxQ: where each query's mask-free keys may start (`PrefixRuns.free_key`); None:
      `start_BxQ`.

  Returns:
    int32 `[B, Q // block_q, 4]` as `q_block_ranges`.
  """
  b, sq = seg_q_BxQ.shape
  nq = sq // block_q
  valid_BxQ = seg_q_BxQ != 0
  reach_BxQ = q_pos_BxQ + 1 if causal else end_BxQ
  first_BxQ = start_BxQ if first_BxQ is None else first_BxQ
  free_BxQ = start_BxQ if free_BxQ is None else free_BxQ
  lo_BxN = jnp.where(valid_BxQ, first_BxQ, _BIG).reshape(b, nq, block_q).min(-1)
  hi_BxN = jnp.where(valid_BxQ, reach_BxQ, 0).reshape(b, nq, block_q).max(-1)
  any_BxN = hi_BxN > 0
  kv_lo_BxN = jnp.where(any_BxN, lo_BxN // block_k, 0)
  kv_hi_BxN = jnp.where(any_BxN, _cdiv(hi_BxN, block_k), 0)
  one_BxN = _one_segment(seg_q_BxQ.reshape(b, nq, block_q))
  q0_BxN = q_pos_BxQ.reshape(b, nq, block_q).min(-1)
  full_lo_BxN = jnp.maximum(kv_lo_BxN, _cdiv(free_BxQ[:, ::block_q], block_k))
  full_hi_BxN = jnp.minimum(kv_hi_BxN, end_BxQ[:, ::block_q] // block_k)
  if causal:
    full_hi_BxN = jnp.minimum(full_hi_BxN, (q0_BxN + 1) // block_k)
  return _with_full(kv_lo_BxN, kv_hi_BxN, full_lo_BxN, full_hi_BxN, one_BxN)


def _kv_ranges(seg_k_BxS: jax.Array, to_query: Callable[[jax.Array], jax.Array], *,
               block_q: int, block_k: int, causal: bool, reach_BxS: jax.Array | None = None,
               free_BxS: jax.Array | None = None) -> jax.Array:
  """Query block ranges of every key/value block, queries found by `to_query`.

  Args:
    seg_k_BxS: segment ids of the keys in row order, S a multiple of `block_k`.
    to_query: maps slot positions `[B, N]` to query indices: how many queries lie before each
      slot (the identity when the queries are the row itself).
    block_q, block_k, causal: as in `q_block_ranges`.
    reach_BxS: one past the last query that sees each key, when beyond its run (a shared
      prefix, `PrefixRuns.last_query`); None: the run's end.
    free_BxS: where the queries seeing all of a key block of each key's segment may end
      (`PrefixRuns.free_query`); None: the run's end.

  Returns:
    int32 `[B, S // block_k, 4]` as `kv_block_ranges`.
  """
  b, sk = seg_k_BxS.shape
  nk = sk // block_k
  start_BxS, end_BxS = segment_runs(seg_k_BxS)
  pos_S = jnp.arange(sk, dtype=jnp.int32)
  valid_BxS = seg_k_BxS != 0
  first_BxS = jnp.broadcast_to(pos_S, (b, sk)) if causal else start_BxS
  reach_BxS = end_BxS if reach_BxS is None else reach_BxS
  free_BxS = end_BxS if free_BxS is None else free_BxS
  lo_BxN = jnp.where(valid_BxS, first_BxS, _BIG).reshape(b, nk, block_k).min(-1)
  hi_BxN = jnp.where(valid_BxS, reach_BxS, 0).reshape(b, nk, block_k).max(-1)
  idx_lo_BxN = to_query(lo_BxN)
  idx_hi_BxN = to_query(hi_BxN)
  any_BxN = idx_hi_BxN > idx_lo_BxN
  q_lo_BxN = jnp.where(any_BxN, idx_lo_BxN // block_q, 0)
  q_hi_BxN = jnp.where(any_BxN, _cdiv(idx_hi_BxN, block_q), 0)
  one_BxN = _one_segment(seg_k_BxS.reshape(b, nk, block_k))
  seg_lo_BxN = to_query(start_BxS[:, ::block_k])
  seg_hi_BxN = to_query(free_BxS[:, ::block_k])
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
                   causal: bool, prefix_ids_BxS: jax.Array | None = None) -> jax.Array:
  """Number of (query block, key block) tiles the forward kernel visits, per row `[B]`
  (with `prefix_ids_BxS`, shared prefixes: those the kernel visits with them)."""
  r = q_block_ranges(segment_ids_BxS, block_q=block_q, block_k=block_k, causal=causal,
                     prefix_ids_BxS=prefix_ids_BxS)
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
