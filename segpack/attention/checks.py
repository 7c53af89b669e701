"""Input validation shared by every `segment_attention` backend.

Every check raises `AttentionInputError` (a `ValueError`) or `AttentionTypeError` (a `TypeError`)
whose message names the argument and echoes the offending value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class AttentionInputError(ValueError):
  """A `segment_attention` argument has a bad shape or value."""


class AttentionTypeError(TypeError):
  """A `segment_attention` argument has a bad dtype."""


class NonContiguousSegmentsError(AttentionInputError):
  """`segment_ids` holds a segment id in more than one run (checked mode only)."""


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
  if segment_ids_BxS.shape != (b, s):
    raise AttentionInputError(
        f"segment_attention: `segment_ids` shape {segment_ids_BxS.shape} must be [B, S] = "
        f"[{b}, {s}]")
  if not jnp.issubdtype(segment_ids_BxS.dtype, jnp.integer):
    raise AttentionTypeError(
        f"segment_attention: `segment_ids` must be an integer array, got {segment_ids_BxS.dtype}")
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
  for row in range(seg.shape[0]):
    r = seg[row]
    starts = np.flatnonzero(np.concatenate([[True], r[1:] != r[:-1]]))
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
