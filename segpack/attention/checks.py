"""Input validation shared by every `segment_attention` backend.

Every check raises `AttentionInputError` (a `ValueError`) or `AttentionTypeError` (a `TypeError`)
whose message names the argument and echoes the offending value.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from segpack.errors import UserError
from segpack.segments import segment_runs

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class AttentionInputError(UserError, ValueError):
  """A `segment_attention` argument has a bad shape or value."""


class AttentionTypeError(UserError, TypeError):
  """A `segment_attention` argument has a bad dtype."""


class NonContiguousSegmentsError(AttentionInputError):
  """`segment_ids` holds a segment id in more than one run, or a `slot_index` or
  `prefix_segment_ids` invariant is broken (checked mode only)."""


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """Static sizes of one `segment_attention` call.

  Attributes:
    batch: B, rows.
    seq_len: S, slots per row.
    num_heads: H, query heads.
    num_kv_heads: K, key/value heads.
    head_dim: D.
  """

  batch: int
  seq_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int

  @property
  def group(self) -> int:
    """G = H // K, the query heads sharing one key/value head."""
    return self.num_heads // self.num_kv_heads


def validate_inputs(
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
) -> AttentionShape:
  """Checks ranks, shapes and dtypes of a `segment_attention` call.

  Args:
    q_BxSxHxD: queries.
    k_BxSxKxD: keys.
    v_BxSxKxD: values.
    segment_ids_BxS: integer segment ids, 0 = padding.

  Returns:
    The static sizes of the call.

  Raises:
    AttentionInputError: on a bad rank or a shape mismatch, or H not a multiple of K.
    AttentionTypeError: on a dtype outside f32/bf16/f16, mismatched q/k/v dtypes, or non-integer
      segment ids.
  """
  for name, x in (("q", q_BxSxHxD), ("k", k_BxSxKxD), ("v", v_BxSxKxD)):
    if x.ndim != 4:
      raise AttentionInputError(
          f"segment_attention: `{name}` must have rank 4 [B, S, heads, D], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
      raise AttentionTypeError(
          f"segment_attention: `{name}` dtype must be float32, bfloat16 or float16, got {x.dtype}")
  if not (q_BxSxHxD.dtype == k_BxSxKxD.dtype == v_BxSxKxD.dtype):
    raise AttentionTypeError(
        "segment_attention: `q`, `k`, `v` must share one dtype, got "
        f"{q_BxSxHxD.dtype}, {k_BxSxKxD.dtype}, {v_BxSxKxD.dtype}")
  if k_BxSxKxD.shape != v_BxSxKxD.shape:
    raise AttentionInputError(
        f"segment_attention: `k` shape {k_BxSxKxD.shape} != `v` shape {v_BxSxKxD.shape}")
  b, s, h, d = q_BxSxHxD.shape
  kb, ks, kh, kd = k_BxSxKxD.shape
  if (kb, ks, kd) != (b, s, d):
    raise AttentionInputError(
        f"segment_attention: `k` shape {k_BxSxKxD.shape} must be [B, S, K, D] = [{b}, {s}, K, {d}] "
        f"to match `q` shape {q_BxSxHxD.shape}")
  if kh == 0 or h % kh:
    raise AttentionInputError(
        f"segment_attention: query heads H={h} must be a multiple of key/value heads K={kh}")
  _check_ids("segment_ids", segment_ids_BxS, batch=b, seq_len=s)
  if d == 0 or s == 0:
    raise AttentionInputError(
        f"segment_attention: empty sequence or head dimension in `q` shape {q_BxSxHxD.shape}")
  return AttentionShape(batch=b, seq_len=s, num_heads=h, num_kv_heads=kh, head_dim=d)


def find_noncontiguous(segment_ids: np.ndarray) -> tuple[int, int, int] | None:
  """Finds a segment id that occurs in more than one run.

  Args:
    segment_ids: int `[B, S]` array.

  Returns:
    `(row, position, segment_id)` of the first slot that reopens an earlier segment, or None when
    every non-zero id forms one contiguous run in its row.
  """
  seg = np.asarray(segment_ids)
  start_BxS, _ = segment_runs(seg)
  is_start_BxS = start_BxS == np.arange(seg.shape[1])
  for row in range(seg.shape[0]):
    r = seg[row]
    starts = np.flatnonzero(is_start_BxS[row])
    ids = r[starts]
    nonzero = ids != 0
    ids_nz, starts_nz = ids[nonzero], starts[nonzero]
    uniq, first = np.unique(ids_nz, return_index=True)
    if len(uniq) != len(ids_nz):
      dup = np.ones(len(ids_nz), bool)
      dup[first] = False
      i = int(np.flatnonzero(dup)[0])
      return row, int(starts_nz[i]), int(ids_nz[i])
  return None


def _raise_if_noncontiguous(segment_ids: np.ndarray) -> None:
  found = find_noncontiguous(segment_ids)
  if found is not None:
    row, pos, sid = found
    raise NonContiguousSegmentsError(
        f"segment_attention(check_segments=True): `segment_ids` row {row} reopens segment {sid} at "
        f"position {pos}; every non-zero id must form one contiguous run")


def check_contiguous(segment_ids_BxS: jax.Array) -> None:
  """Raises `NonContiguousSegmentsError` if a segment id occurs in two runs of a row.

  On a concrete array the check runs now, in NumPy. Under `jax.jit` it runs on the host when the
  computation runs (`jax.debug.callback`), and the error then surfaces wrapped in JAX's runtime
  error with the same message.

  Args:
    segment_ids_BxS: integer segment ids.
  """
  if isinstance(segment_ids_BxS, jax.core.Tracer):
    jax.debug.callback(_raise_if_noncontiguous, segment_ids_BxS)
  else:
    _raise_if_noncontiguous(np.asarray(segment_ids_BxS))


def default_scale(head_dim: int, scale: float | None) -> float:
  """The softmax scale: `scale`, or `1/sqrt(head_dim)` when None."""
  if scale is None:
    return float(1.0 / np.sqrt(head_dim))
  if not np.isfinite(scale):
    raise AttentionInputError(f"segment_attention: `scale` must be finite, got {scale!r}")
  return float(scale)


def find_bad_slots(segment_ids: np.ndarray, slot_index: np.ndarray,
                   context_size: int) -> str | None:
  """Describes the first broken `slot_index` invariant, or None when all hold.

  The invariants: every row of `slot_index` is a permutation of `0..S-1`; the segment ids put back
  in slot order form one contiguous run per non-zero id; and, when `context_size > 1`, each of the
  `context_size` equal shares of a row (one device's slots) holds ascending slot indices.

  Args:
    segment_ids: int `[B, S]`, in the (reordered) order of the call.
    slot_index: int `[B, S]`, each slot's index in the row before reordering.
    context_size: devices along the context axis (1 without one).
  """
  seg, slot = np.asarray(segment_ids), np.asarray(slot_index)
  b, s = seg.shape
  if s % context_size:
    return f"has S={s} slots per row, not divisible by the context axis size {context_size}"
  for row in range(b):
    if not np.array_equal(np.sort(slot[row]), np.arange(s)):
      return f"row {row} is not a permutation of 0..{s - 1}: {slot[row].tolist()}"
    share = slot[row].reshape(context_size, s // context_size)
    bad = np.flatnonzero((np.diff(share, axis=1) <= 0).any(axis=1))
    if bad.size and context_size > 1:
      return (f"row {row}: the slots of context device {int(bad[0])} are not ascending: "
              f"{share[bad[0]].tolist()}")
  natural = np.zeros_like(seg)
  np.put_along_axis(natural, slot.astype(np.int64), seg, axis=1)
  found = find_noncontiguous(natural)
  if found is not None:
    row, pos, sid = found
    return f"row {row} reopens segment {sid} at slot index {pos} (in slot order)"
  return None


def _raise_if_bad_slots(segment_ids: np.ndarray, slot_index: np.ndarray,
                        context_size: int) -> None:
  problem = find_bad_slots(segment_ids, slot_index, context_size)
  if problem is not None:
    raise NonContiguousSegmentsError(
        f"segment_attention(check_segments=True): `slot_index` {problem}; every row must be a "
        "permutation, every non-zero segment one contiguous run in slot order, and each context "
        "device's slots ascending")


def check_slots(segment_ids_BxS: jax.Array, slot_index_BxS: jax.Array, *,
                context_size: int) -> None:
  """Raises `NonContiguousSegmentsError` if the `slot_index` invariants do not hold.

  Concrete arrays are checked now, traced ones when the computation runs (host callback), as in
  `check_contiguous`.

  Args:
    segment_ids_BxS: integer segment ids, in the order of the call.
    slot_index_BxS: integer slot indices.
    context_size: devices along the context axis (1 without one).
  """
  if isinstance(segment_ids_BxS, jax.core.Tracer) or isinstance(slot_index_BxS, jax.core.Tracer):
    jax.debug.callback(functools.partial(_raise_if_bad_slots, context_size=context_size),
                       segment_ids_BxS, slot_index_BxS)
  else:
    _raise_if_bad_slots(np.asarray(segment_ids_BxS), np.asarray(slot_index_BxS), context_size)


def find_bad_prefix(segment_ids: np.ndarray, prefix_segment_ids: np.ndarray) -> str | None:
  """Describes the first broken `prefix_segment_ids` invariant, or None when all hold.

  The invariants, for every non-zero segment of a row (segments being contiguous): its prefix
  id is the same on all its slots; a non-zero prefix id names a segment of the row that lies
  entirely before it and whose own prefix id is 0 (one level).

  Args:
    segment_ids: int `[B, S]`, contiguous segments.
    prefix_segment_ids: int `[B, S]`, 0 = no prefix.
  """
  seg, pre = np.asarray(segment_ids), np.asarray(prefix_segment_ids)
  start_BxS, end_BxS = segment_runs(seg)
  for row in range(seg.shape[0]):
    starts = np.flatnonzero((start_BxS[row] == np.arange(seg.shape[1])) & (seg[row] != 0))
    runs = {int(seg[row, a]): (int(a), int(end_BxS[row, a])) for a in starts}
    for sid, (a, e) in runs.items():
      values = np.unique(pre[row, a:e])
      if len(values) > 1:
        return f"row {row}: segment {sid} (slots {a}..{e - 1}) has prefix ids {values.tolist()}"
      p = int(values[0])
      if p == 0:
        continue
      if p not in runs:
        return f"row {row}: segment {sid} names prefix segment {p}, which is not in the row"
      pa, pe = runs[p]
      if pe > a:
        return (f"row {row}: segment {sid} (slots {a}..{e - 1}) names prefix segment {p} "
                f"(slots {pa}..{pe - 1}), which does not lie entirely before it")
      if pre[row, pa] != 0:
        return (f"row {row}: segment {sid} names prefix segment {p}, which has a prefix itself "
                f"({int(pre[row, pa])})")
  return None


def _raise_if_bad_prefix(segment_ids: np.ndarray, prefix_segment_ids: np.ndarray) -> None:
  _raise_if_noncontiguous(segment_ids)
  problem = find_bad_prefix(segment_ids, prefix_segment_ids)
  if problem is not None:
    raise NonContiguousSegmentsError(
        f"segment_attention(check_segments=True): `prefix_segment_ids` {problem}; a non-zero "
        "prefix id must be constant over its segment and name an earlier segment of the row "
        "that has no prefix itself")


def check_prefix(segment_ids_BxS: jax.Array, prefix_segment_ids_BxS: jax.Array) -> None:
  """Raises `NonContiguousSegmentsError` if the segments are not contiguous or a
  `prefix_segment_ids` invariant (`find_bad_prefix`) does not hold.

  Concrete arrays are checked now, traced ones when the computation runs (host callback), as in
  `check_contiguous`.

  Args:
    segment_ids_BxS: integer segment ids.
    prefix_segment_ids_BxS: integer prefix segment ids, 0 = none.
  """
  arrays = (segment_ids_BxS, prefix_segment_ids_BxS)
  if any(isinstance(x, jax.core.Tracer) for x in arrays):
    jax.debug.callback(_raise_if_bad_prefix, *arrays)
  else:
    _raise_if_bad_prefix(*(np.asarray(x) for x in arrays))


def validate_prefix_ids(prefix_segment_ids_BxS: jax.Array, shape: AttentionShape) -> jax.Array:
  """Checks the shape and dtype of `prefix_segment_ids` and returns it as int32.

  Raises:
    AttentionInputError: a shape other than `[B, S]`.
    AttentionTypeError: a non-integer dtype.
  """
  _check_ids("prefix_segment_ids", prefix_segment_ids_BxS, batch=shape.batch,
             seq_len=shape.seq_len)
  return prefix_segment_ids_BxS.astype(jnp.int32)


def validate_slot_index(slot_index_BxS: jax.Array, shape: AttentionShape) -> jax.Array:
  """Checks the shape and dtype of `slot_index` and returns it as int32.

  Raises:
    AttentionInputError: a shape other than `[B, S]`.
    AttentionTypeError: a non-integer dtype.
  """
  _check_ids("slot_index", slot_index_BxS, batch=shape.batch, seq_len=shape.seq_len)
  return slot_index_BxS.astype(jnp.int32)


def _check_ids(name: str, ids_BxS: jax.Array, *, batch: int, seq_len: int) -> None:
  """Refuses the argument `name` unless it is an integer `[B, S]` array.

  Raises:
    AttentionInputError: a shape other than `[batch, seq_len]`.
    AttentionTypeError: a non-integer dtype.
  """
  if tuple(ids_BxS.shape) != (batch, seq_len):
    raise AttentionInputError(
        f"segment_attention: `{name}` shape {tuple(ids_BxS.shape)} must be [B, S] = "
        f"[{batch}, {seq_len}]")
  if not jnp.issubdtype(ids_BxS.dtype, jnp.integer):
    raise AttentionTypeError(
        f"segment_attention: `{name}` must be an integer array, got {ids_BxS.dtype}")
