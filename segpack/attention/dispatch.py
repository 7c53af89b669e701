"""`segment_attention`: validates its inputs, then runs one backend (optionally under `shard_map`).

The backends: `xla.py` (a dense mask, the oracle), `pallas.py` (a flash-attention kernel that
visits only its segments' blocks) and `cudnn.py` (JAX's cuDNN fused attention, packed layout).
With a `mesh`, `sharded.py` runs the backend per device.
"""

from __future__ import annotations

from typing import Literal

import jax

from segpack.attention import cudnn
from segpack.attention import pallas
from segpack.attention.checks import AttentionInputError, check_contiguous, default_scale
from segpack.attention.checks import validate_inputs
from segpack.attention.sharded import shard_attention
from segpack.attention.xla import segment_attention_xla
from segpack.mesh import BATCH_AXES, TENSOR_AXIS

Implementation = Literal["xla", "pallas", "cudnn"]
IMPLEMENTATIONS = ("xla", "pallas", "cudnn")

__all__ = ["IMPLEMENTATIONS", "Implementation", "default_implementation", "segment_attention"]


def default_implementation() -> str:
  """The backend `implementation=None` picks: `"pallas"` on a GPU, `"xla"` elsewhere."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    implementation: Implementation | None = None,
    block_q: int | Literal["auto"] = "auto",
    block_k: int | Literal["auto"] = "auto",
    block_q_bwd: int | Literal["auto"] | None = "auto",
    block_k_bwd: int | Literal["auto"] | None = "auto",
    num_warps: int | Literal["auto"] = "auto",
    num_stages: int | Literal["auto"] = "auto",
    smem_bytes: int | None = None,
    interpret: bool = False,
    check_segments: bool = False,
    max_segments_per_row: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = BATCH_AXES,
    head_axis: str | tuple[str, ...] | None = TENSOR_AXIS,
) -> jax.Array:
  """Attention in which a query sees only keys of its own segment (document).

  Args:
    q: queries `[B, S, H, D]`, float32, bfloat16 or float16.
    k: keys `[B, S, K, D]`, same dtype; H must be a multiple of K (grouped-query attention).
    v: values `[B, S, K, D]`, same dtype.
    segment_ids: integer `[B, S]`; each non-zero id one contiguous run (a document), 0 = padding.
    causal: also hide keys after the query.
    scale: logit scale, default `1/sqrt(D)`.
    implementation: `"xla"`, `"pallas"`, `"cudnn"` or None (Pallas on a GPU, XLA elsewhere).
    block_q: Pallas query block (a power of two >= 16) or "auto"; S is padded internally to a
      multiple of the largest block with padding slots.
    block_k: Pallas key/value block (a power of two >= 16) or "auto".
    block_q_bwd: Pallas backward query block, or "auto" (None means "auto").
    block_k_bwd: Pallas backward key/value block, or "auto" (None means "auto").
    num_warps: Pallas Triton warps of every kernel, or "auto" (per kernel).
    num_stages: Pallas Triton pipeline stages of every kernel, or "auto" (per kernel). "auto"
      settings come from a shared-memory model (`attention/resources.py`, docs/attention.md);
      explicit ones that the model says do not fit are refused before compiling.
    smem_bytes: Pallas: shared memory per block of the target GPU (None: the local GPU's, or an
      H100's when there is none).
    interpret: run the Pallas kernel in interpret mode (CPU).
    check_segments: verify that every non-zero segment id forms one contiguous run (the Pallas and
      cuDNN backends silently assume it) and, for cuDNN, that no row has more than
      `max_segments_per_row` segments. Concrete inputs are checked now; traced inputs when the
      computation runs (host callback).
    max_segments_per_row: cuDNN only and required there: the static bound N on segments
      (non-zero runs) per row, e.g. `cudnn.cudnn_segment_bound(PackedDataset.max_segments_in_row)`.
      cuDNN's backward memory grows as B*N*H*S*D (516 GiB measured at B=2, N=S=4096, H=16,
      D=128), so N = S is no default; without it the call raises `AttentionInputError`.
    mesh: run sharded on this mesh under `shard_map` (works inside `jax.jit` with `NamedSharding`
      inputs): the batch split over `batch_axis`, the heads over `head_axis`.
    batch_axis: mesh axis, or tuple of axes, for the batch (None: replicated); default
      `segpack.mesh.BATCH_AXES`, `("data", "fsdp")`, the trainer's mesh.
    head_axis: mesh axis, or tuple of axes, for the heads (None: replicated); must divide H and K;
      default `segpack.mesh.TENSOR_AXIS`, `"tensor"`.

  Returns:
    `[B, S, H, D]` in the dtype of `q`; zeros at padding queries.

  Raises:
    AttentionInputError: bad shapes, H not a multiple of K, a bad block size, an unknown
      implementation, or cuDNN without a positive `max_segments_per_row`.
    AttentionTypeError: bad dtypes.
    NonContiguousSegmentsError: with `check_segments=True`, a segment id in two runs.
  """
  shape = validate_inputs(q, k, v, segment_ids)
  scale = default_scale(shape.head_dim, scale)
  if check_segments:
    check_contiguous(segment_ids)
  impl = default_implementation() if implementation is None else implementation
  if impl == "xla":
    fn, kwargs = segment_attention_xla, {}
  elif impl == "pallas":
    fn = pallas.segment_attention_pallas
    kwargs = dict(block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd,
                  block_k_bwd=block_k_bwd, num_warps=num_warps, num_stages=num_stages,
                  smem_bytes=smem_bytes, interpret=interpret)
  elif impl == "cudnn":
    fn = cudnn.segment_attention_cudnn
    kwargs = dict(max_segments_per_row=max_segments_per_row, check_segments=check_segments)
  else:
    raise AttentionInputError(
        f"segment_attention: `implementation` must be one of {IMPLEMENTATIONS} or None, got "
        f"{implementation!r}")
  kwargs.update(causal=causal, scale=scale)
  if mesh is None:
    return fn(q, k, v, segment_ids, **kwargs)
  return shard_attention(fn, q, k, v, segment_ids, mesh=mesh, batch_axis=batch_axis,
                         head_axis=head_axis, **kwargs)
