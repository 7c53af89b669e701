"""The cuDNN backend: JAX's cuDNN fused attention with its packed (ragged) layout.

The private JAX API (`jax._src.cudnn.fused_attention_stablehlo`) is used in this module only.

Algorithm:
  1. From `segment_ids` derive, per row, the start offset and the length of each segment (each
     non-zero run), in row order, into static `[B, N]` lengths and `[B, N + 1]` offsets padded
     with -1 (N = `cudnn_segment_bound`). Padding runs are not sequences.
  2. Call cuDNN with `q_seqlen = kv_seqlen` = lengths and `q_offsets = kv_offsets` = offsets and a
     padding (causal) mask: cuDNN then runs each segment as its own sequence.
  3. Zero the output, and in the backward dQ, dK and dV, at every slot outside the first N
     segments of its row (padding, and segments past the N-th): cuDNN never writes those slots.

  Example: ids `[0, 1, 1, 0, 2, 2, 2, 0]`, N = 3 give lengths `[2, 3, -1]` and offsets
  `[1, 4, -1, -1]`; slots 0, 3 and 7 are in no sequence and come back as zeros.

The static bound N. JAX sizes the packed layout as `B * N` sequences of the full row length S:
the softmax statistics are `[B * N, H, S]` float32 and the backward's cuDNN workspace grows as
`B * N * H * S * D` (measured on an H100, jax 0.11.2, cuDNN 9.19: 516 GiB at B = 2, N = S = 4096,
H = 16, K = 4, D = 128, i.e. 8.06 bytes per element; 66 GiB at H = K = 8, D = 64, 4.1 bytes). So N
must be the data's bound, not S: `cudnn_segment_bound=round_segment_bound(
PackedDataset.segment_bound)`, the plan's most documents in a row rounded up to a power of
two. Segment attention refuses to guess.

Slots outside every sequence. cuDNN skips every slot that is in no sequence, in O as in dQ, dK and
dV, so those slots keep whatever their buffer held: XLA zero-fills the cuDNN outputs on its
eager path, but not when the call is captured into a command buffer (openxla/xla PR 46500);
TransformerEngine zero-initialises O, dQ, dK and dV of its packed (THD) calls for the same reason
(NVIDIA/TransformerEngine PR 1009). With N = S and a padding tail, dV had a relative error of
0.096 on an H100 (dQ and dK 0.003), consistent with unwritten padding slots of dV flowing into the
value projection's gradient. The backward is therefore a `jax.custom_vjp` around JAX's cuDNN call
that selects zeros at those slots (a select, so stale NaN or Inf bits do not leak either). A
padding slot's true gradient is zero (its output is zeroed, so no cotangent reaches it), so this
changes nothing where cuDNN did write. The alternative, one cuDNN sequence per padding run, would
also leave no slot unwritten, but it adds a segment to every padded row, doubling the
power-of-two N (and the backward's memory, linear in N) whenever the documents alone reach a
power of two, and computes attention on padding. With the fix, dQ, dK and dV passed the full
`segpack bench gpu-report` grid on an H200 (S = 1000 to 8192, D = 64 to 256, GQA, causal and full,
bf16 and fp16, rows with padding gaps, padding tails and length-1 segments; docs/benchmarks.md);
the cause of the H100 error was not established.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from segpack.attention.checks import AttentionInputError
from segpack.attention.resources import next_pow2
from segpack.errors import UserError
from segpack.segments import segment_runs


class CudnnUnavailableError(UserError, RuntimeError):
  """cuDNN fused attention cannot run here (no CUDA GPU / cuDNN, or an unsupported GPU)."""


def round_segment_bound(max_segments: int) -> int:
  """The `cudnn_segment_bound` (static N) for rows holding at most `max_segments` documents.

  N bounds the segments (non-zero runs of `segment_ids`, i.e. documents or document chunks) of
  any row; padding runs do not count (they are no cuDNN sequence). The result is the next power
  of two >= `max_segments`, at least 2 (JAX's packed path needs N > 1), so that data sets with
  similar bounds share one compiled program.

  Example: 5 -> 8, 8 -> 8, 1 -> 2, 0 -> 2.

  Args:
    max_segments: the most segments in any row, e.g. `PackedDataset.segment_bound`.

  Returns:
    N, a power of two >= max(max_segments, 2).
  """
  if isinstance(max_segments, (bool, np.bool_)) or not isinstance(
      max_segments, (int, np.integer)) or max_segments < 0:
    raise AttentionInputError(
        f"round_segment_bound: `max_segments` must be an int >= 0, got {max_segments!r}")
  return max(2, next_pow2(int(max_segments)))


def _segment_rank(segment_ids_BxS: jax.Array, start_BxS: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """`(is_start_BxS, rank_BxS)`: where each segment starts, and every slot's segment's rank in
  its row (0-based; counting only non-zero runs; padding gets the rank of the segment before).
  `start_BxS`: the runs' starts (`segment_runs`), when the caller has them."""
  if start_BxS is None:
    start_BxS, _ = segment_runs(segment_ids_BxS)
  pos_S = jnp.arange(segment_ids_BxS.shape[1], dtype=jnp.int32)
  is_start_BxS = (segment_ids_BxS != 0) & (start_BxS == pos_S)
  return is_start_BxS, jnp.cumsum(is_start_BxS, axis=1) - 1


def packed_layout(segment_ids_BxS: jax.Array, *, cudnn_segment_bound: int
                  ) -> tuple[jax.Array, jax.Array]:
  """Segment lengths and offsets in cuDNN's packed layout.

  Example: ids `[0, 1, 1, 0, 2, 2, 2, 0]`, N = 3 give lengths `[2, 3, -1]` and offsets
  `[1, 4, -1, -1]` (the padding runs at slots 0, 3 and 7 are no sequence).

  Args:
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    cudnn_segment_bound: N, the static bound on segments per row. Segments past the N-th in a row
      are dropped (`count_segments` tells whether that happens).

  Returns:
    `(seqlen_BxN, offsets_BxN1)` int32: length and first slot of every segment in row order,
    -1 past the last segment; offsets have one more column, always -1 at the end.
  """
  b, s = segment_ids_BxS.shape
  n = cudnn_segment_bound
  start_BxS, end_BxS = segment_runs(segment_ids_BxS)
  is_start_BxS, rank_BxS = _segment_rank(segment_ids_BxS, start_BxS)
  slot_BxS = jnp.where(is_start_BxS & (rank_BxS < n), rank_BxS, n + 1)  # n + 1: dropped
  rows_BxS = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
  seqlen_BxN = jnp.full((b, n), -1, jnp.int32).at[rows_BxS, slot_BxS].set(
      (end_BxS - start_BxS).astype(jnp.int32), mode="drop")
  offsets_BxN1 = jnp.full((b, n + 1), -1, jnp.int32).at[rows_BxS, slot_BxS].set(
      jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), mode="drop")
  return seqlen_BxN, offsets_BxN1


def covered_slots(segment_ids_BxS: jax.Array, *, cudnn_segment_bound: int) -> jax.Array:
  """`[B, S]` bool: the slots inside one of the first N segments of their row, i.e. the slots
  of some cuDNN sequence (all others are padding or dropped segments, which cuDNN never writes)."""
  _, rank_BxS = _segment_rank(segment_ids_BxS)
  return (segment_ids_BxS != 0) & (rank_BxS < cudnn_segment_bound)


def count_segments(segment_ids_BxS: jax.Array) -> jax.Array:
  """The sequences cuDNN would see in every row, `[B]`: the non-zero runs (padding is none)."""
  is_start_BxS, _ = _segment_rank(segment_ids_BxS)
  return is_start_BxS.sum(axis=1)


def _raise_if_too_many(counts, n: int) -> None:
  counts = np.asarray(counts)
  if counts.max(initial=0) > n:
    row = int(np.argmax(counts))
    raise AttentionInputError(
        f"segment_attention(implementation='cudnn', check_segments=True): row {row} has "
        f"{int(counts[row])} segments, more than `cudnn_segment_bound`={n}")


def check_segment_count(segment_ids_BxS: jax.Array, *, cudnn_segment_bound: int) -> None:
  """Raises `AttentionInputError` if a row has more than N segments (now, or when run under jit)."""
  counts_B = count_segments(segment_ids_BxS)
  if isinstance(counts_B, jax.core.Tracer):
    jax.debug.callback(_raise_if_too_many, counts_B, cudnn_segment_bound)
  else:
    _raise_if_too_many(counts_B, cudnn_segment_bound)


def _fused_attention_module():
  try:
    from jax._src.cudnn import fused_attention_stablehlo  # optional: private, absent in some JAX
  except ImportError as e:  # pragma: no cover - depends on the JAX build
    raise CudnnUnavailableError(
        f"segment_attention(implementation='cudnn'): this JAX ({jax.__version__}) has no cuDNN "
        f"fused attention module: {e}") from e
  return fused_attention_stablehlo


def _cudnn_call(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, seqlen_BxN, offsets_BxN1, mask_type, scale):
  fa = _fused_attention_module()
  return fa.dot_product_attention(
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, q_seqlen=seqlen_BxN, kv_seqlen=seqlen_BxN,
      q_offsets=offsets_BxN1, kv_offsets=offsets_BxN1, scale=scale, mask_type=mask_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _cudnn_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, seqlen_BxN, offsets_BxN1, covered_BxS,
                     mask_type: Any, scale: float):
  """JAX's cuDNN call; its backward zeroes dQ, dK, dV outside `covered_BxS`."""
  del covered_BxS  # The forward's output is masked by the caller.
  return _cudnn_call(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, seqlen_BxN, offsets_BxN1, mask_type, scale)


def _cudnn_attention_fwd(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, seqlen_BxN, offsets_BxN1, covered_BxS,
                         mask_type, scale):
  call = lambda q, k, v: _cudnn_call(q, k, v, seqlen_BxN, offsets_BxN1, mask_type, scale)
  out_BxSxHxD, vjp = jax.vjp(call, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD)
  return out_BxSxHxD, (vjp, covered_BxS)


def _cudnn_attention_bwd(mask_type, scale, residuals, dout_BxSxHxD):
  del mask_type, scale
  vjp, covered_BxS = residuals
  keep_BxSx1x1 = covered_BxS[:, :, None, None]
  grads = tuple(jnp.where(keep_BxSx1x1, g, jnp.zeros((), g.dtype)) for g in vjp(dout_BxSxHxD))
  return grads + (None, None, None)


_cudnn_attention.defvjp(_cudnn_attention_fwd, _cudnn_attention_bwd)


def _check_bound(cudnn_segment_bound: Any, shape: tuple[int, ...]) -> int:
  """The validated N; refuses None with the memory law (no default is safe)."""
  b, s = shape
  if cudnn_segment_bound is None:
    raise AttentionInputError(
        "segment_attention(implementation='cudnn') needs `cudnn_segment_bound`, the static "
        "bound N on segments per row: JAX sizes cuDNN's packed layout as B*N sequences of the "
        "full row length S, and the backward's memory grows as B*N*H*S*D (measured on an "
        "H100: 516 GiB at B=2, N=S=4096, H=16, K=4, D=128), so N = S is no usable default "
        f"(here B={b}, S={s}). Pass the plan's bound, "
        "`segpack.attention.round_segment_bound(dataset.segment_bound)` for a "
        "`pack_dataset` result (its most segments in a row rounded up to a power of two)")
  if isinstance(cudnn_segment_bound, bool) or not isinstance(cudnn_segment_bound, int) or (
      cudnn_segment_bound < 1):
    raise AttentionInputError(
        "segment_attention(implementation='cudnn'): `cudnn_segment_bound` must be a positive int, "
        f"got {cudnn_segment_bound!r}")
  return cudnn_segment_bound


def segment_attention_cudnn(
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
    cudnn_segment_bound: int | None = None,
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
    cudnn_segment_bound: required static N, the bound on segments (non-zero runs) per row;
      use `round_segment_bound(PackedDataset.segment_bound)`. The backward's memory grows
      as B*N*H*S*D (see the module docstring), so there is no default. At least 2 is passed to
      cuDNN. Segments past the N-th of a row are dropped (zero output and gradients) unless
      `check_segments`.
    check_segments: raise if a row has more than N segments.

  Returns:
    `out_BxSxHxD`, zero at padding slots (and at the slots of dropped segments).

  Raises:
    CudnnUnavailableError: no cuDNN / GPU, or the GPU or dtype cannot run the packed layout.
    AttentionInputError: `cudnn_segment_bound` missing or not a positive int.
  """
  n = _check_bound(cudnn_segment_bound, segment_ids_BxS.shape)
  fa = _fused_attention_module()
  try:
    fa.check_cudnn_version()
  except RuntimeError as e:
    raise CudnnUnavailableError(
        "segment_attention(implementation='cudnn') needs a CUDA GPU with cuDNN (install "
        f"jax[cuda12]); default backend is {jax.default_backend()!r}: {e}") from e
  if check_segments:
    check_segment_count(segment_ids_BxS, cudnn_segment_bound=n)
  n = max(n, 2)
  seqlen_BxN, offsets_BxN1 = packed_layout(segment_ids_BxS, cudnn_segment_bound=n)
  covered_BxS = covered_slots(segment_ids_BxS, cudnn_segment_bound=n)
  mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  try:
    out_BxSxHxD = _cudnn_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, seqlen_BxN, offsets_BxN1,
                                   covered_BxS, mask_type, scale)
  except NotImplementedError as e:
    raise CudnnUnavailableError(
        f"segment_attention(implementation='cudnn'): cuDNN refused q {q_BxSxHxD.shape} "
        f"{q_BxSxHxD.dtype}, k {k_BxSxKxD.shape}: {e}") from e
  return jnp.where(covered_BxS[:, :, None, None], out_BxSxHxD, 0).astype(q_BxSxHxD.dtype)
