"""The cuDNN backend: JAX's cuDNN fused attention with its packed (ragged) layout.

The private JAX API (`jax._src.cudnn.fused_attention_stablehlo`) is used in this module only.

Algorithm:
  1. From `segment_ids` derive, per row, the start offset and the length of each segment, in row
     order, into static `[B, N]` lengths and `[B, N + 1]` offsets padded with -1 (N =
     `max_segments_per_row`).
  2. Call cuDNN with `q_seqlen = kv_seqlen` = lengths and `q_offsets = kv_offsets` = offsets and a
     padding (causal) mask: cuDNN then runs each segment as its own sequence.
  3. Zero the output at padding slots (cuDNN leaves slots outside every segment undefined).

  Example: ids `[1, 1, 1, 2, 2, 0]`, N = 3 give lengths `[3, 2, -1]` and offsets `[0, 3, -1, -1]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from segpack.attention import blocks
from segpack.attention.checks import AttentionInputError


class CudnnUnavailableError(RuntimeError):
  """cuDNN fused attention cannot run here (no CUDA GPU / cuDNN, or an unsupported GPU)."""


def packed_layout(segment_ids_BxS: jax.Array, *, max_segments_per_row: int
                  ) -> tuple[jax.Array, jax.Array]:
  """Segment lengths and offsets in cuDNN's packed layout.

  Args:
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    max_segments_per_row: N, the static bound on segments per row. Segments past the N-th in a row
      are dropped (`count_segments` tells whether that happens).

  Returns:
    `(seqlen_BxN, offsets_BxN1)` int32: length and first slot of every segment in row order,
    -1 past the last segment; offsets have one more column, always -1 at the end.
  """
  b, s = segment_ids_BxS.shape
  n = max_segments_per_row
  start_BxS, end_BxS = blocks.segment_bounds(segment_ids_BxS)
  prev_BxS = jnp.pad(segment_ids_BxS[:, :-1], ((0, 0), (1, 0)))
  is_start_BxS = (segment_ids_BxS != 0) & (segment_ids_BxS != prev_BxS)
  rank_BxS = jnp.cumsum(is_start_BxS, axis=1) - 1
  slot_BxS = jnp.where(is_start_BxS & (rank_BxS < n), rank_BxS, n + 1)  # n + 1: dropped
  rows_BxS = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
  seqlen_BxN = jnp.full((b, n), -1, jnp.int32).at[rows_BxS, slot_BxS].set(
      (end_BxS - start_BxS).astype(jnp.int32), mode="drop")
  offsets_BxN1 = jnp.full((b, n + 1), -1, jnp.int32).at[rows_BxS, slot_BxS].set(
      jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), mode="drop")
  return seqlen_BxN, offsets_BxN1


def count_segments(segment_ids_BxS: jax.Array) -> jax.Array:
  """Number of segments (non-zero runs) in every row, `[B]`."""
  prev_BxS = jnp.pad(segment_ids_BxS[:, :-1], ((0, 0), (1, 0)))
  return ((segment_ids_BxS != 0) & (segment_ids_BxS != prev_BxS)).sum(axis=1)


def _raise_if_too_many(counts, n: int) -> None:
  counts = np.asarray(counts)
  if counts.max(initial=0) > n:
    row = int(np.argmax(counts))
    raise AttentionInputError(
        f"segment_attention(implementation='cudnn', check_segments=True): row {row} has "
        f"{int(counts[row])} segments, more than `max_segments_per_row`={n}")


def check_segment_count(segment_ids_BxS: jax.Array, *, max_segments_per_row: int) -> None:
  """Raises `AttentionInputError` if a row has more than N segments (now, or when run under jit)."""
  counts_B = count_segments(segment_ids_BxS)
  if isinstance(counts_B, jax.core.Tracer):
    jax.debug.callback(_raise_if_too_many, counts_B, max_segments_per_row)
  else:
    _raise_if_too_many(counts_B, max_segments_per_row)


def _fused_attention_module():
  try:
    from jax._src.cudnn import fused_attention_stablehlo  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - depends on the JAX build
    raise CudnnUnavailableError(
        f"segment_attention(implementation='cudnn'): this JAX ({jax.__version__}) has no cuDNN "
        f"fused attention module: {e}") from e
  return fused_attention_stablehlo


def segment_attention_cudnn(
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
    max_segments_per_row: int | None = None,
    check_segments: bool = False,
) -> jax.Array:
  """Segment attention through cuDNN's packed layout (Hopper or newer, cuDNN >= 9.x).

  Args:
    q_BxSxHxD: queries (bf16 or f16 for cuDNN).
    k_BxSxKxD: keys.
    v_BxSxKxD: values.
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    causal: causal within each segment.
    scale: logit scale.
    max_segments_per_row: static N (default S); at least 2 is passed to cuDNN. Segments past the
      N-th of a row are silently dropped unless `check_segments`.
    check_segments: raise if a row has more than N segments.

  Returns:
    `out_BxSxHxD`, zero at padding slots.

  Raises:
    CudnnUnavailableError: no cuDNN / GPU, or the GPU or dtype cannot run the packed layout.
    AttentionInputError: a bad `max_segments_per_row`.
  """
  s = segment_ids_BxS.shape[1]
  n = s if max_segments_per_row is None else max_segments_per_row
  if not isinstance(n, int) or n < 1:
    raise AttentionInputError(
        "segment_attention(implementation='cudnn'): `max_segments_per_row` must be a positive int, "
        f"got {max_segments_per_row!r}")
  fa = _fused_attention_module()
  try:
    fa.check_cudnn_version()
  except RuntimeError as e:
    raise CudnnUnavailableError(
        "segment_attention(implementation='cudnn') needs a CUDA GPU with cuDNN (install "
        f"jax[cuda12]); default backend is {jax.default_backend()!r}: {e}") from e
  if check_segments:
    check_segment_count(segment_ids_BxS, max_segments_per_row=n)
  seqlen_BxN, offsets_BxN1 = packed_layout(segment_ids_BxS, max_segments_per_row=max(n, 2))
  mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  try:
    out_BxSxHxD = fa.dot_product_attention(
        q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, q_seqlen=seqlen_BxN, kv_seqlen=seqlen_BxN,
        q_offsets=offsets_BxN1, kv_offsets=offsets_BxN1, scale=scale, mask_type=mask_type)
  except NotImplementedError as e:
    raise CudnnUnavailableError(
        f"segment_attention(implementation='cudnn'): cuDNN refused q {q_BxSxHxD.shape} "
        f"{q_BxSxHxD.dtype}, k {k_BxSxKxD.shape}: {e}") from e
  valid_BxS = segment_ids_BxS != 0
  return jnp.where(valid_BxS[:, :, None, None], out_BxSxHxD, 0).astype(q_BxSxHxD.dtype)
