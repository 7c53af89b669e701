"""`segment_attention`: validates its inputs, then runs one backend (optionally under `shard_map`).

The backends: `xla.py` (a dense mask, the oracle), `pallas.py` (a flash-attention kernel that
visits only its segments' blocks) and `cudnn.py` (JAX's cuDNN fused attention, packed layout).
With a `mesh`, `sharded.py` runs the backend per device.

The rules about backends are written here and nowhere else (the trainer calls these functions):

- `resolve_implementation`: which backend runs (None: Pallas on a GPU, or cuDNN with one warning
  where JAX has no Pallas Triton backend; XLA elsewhere); every
  setting goes to a backend that uses it (`pallas=` to Pallas, `cudnn_segment_bound=` to cuDNN),
  else it is refused; for a named platform, the backend can run there (Pallas on the CPU only in
  interpret mode); Pallas outside interpret mode needs JAX's Pallas Triton backend.
- `backend_mesh`: the kernel backends run per device under a model's mesh; XLA is left to the jit
  partitioner.
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

from segpack.attention import cudnn
from segpack.attention import pallas as pallas_lib
from segpack.attention.checks import AttentionInputError, check_contiguous, check_prefix
from segpack.attention.checks import check_slots, default_scale, validate_inputs
from segpack.attention.checks import validate_prefix_ids, validate_slot_index
from segpack.attention.context_parallel import context_attention, context_size, row_order
from segpack.attention.pallas import PallasOptions
from segpack.attention.sharded import shard_attention
from segpack.attention.xla import segment_attention_xla, segment_attention_xla_slots
from segpack.mesh import BATCH_AXES, TENSOR_AXIS

Implementation = Literal["xla", "pallas", "cudnn"]
IMPLEMENTATIONS = ("xla", "pallas", "cudnn")
# JAX platform names of a GPU (`jax.default_backend()` says "gpu"; lowering names "cuda", "rocm").
GPU_PLATFORMS = ("gpu", "cuda", "rocm")

__all__ = [
    "IMPLEMENTATIONS",
    "Implementation",
    "PallasOptions",
    "backend_mesh",
    "default_implementation",
    "resolve_implementation",
    "segment_attention",
]


@functools.cache
def _warn_no_triton() -> None:
  """Says once per process that `implementation=None` runs cuDNN instead of Pallas on a GPU."""
  warnings.warn(f"segment_attention: this JAX {jax.__version__} has no Pallas Triton backend "
                "(jax.experimental.pallas.triton), so implementation=None runs 'cudnn' instead "
                "of 'pallas' on the GPU", stacklevel=3)


def default_implementation(*, platform: str | None = None) -> str:
  """The backend `implementation=None` picks: `"pallas"` on a GPU, `"xla"` elsewhere.

  On a GPU with a JAX that has no Pallas Triton backend (`jax.experimental.pallas.triton`,
  deprecated from JAX 0.11), `"cudnn"`, with one warning per process.

  Args:
    platform: a JAX platform name ("cpu", "gpu", "tpu", ...); None: `jax.default_backend()`.
  """
  platform = jax.default_backend() if platform is None else platform
  if platform not in GPU_PLATFORMS:
    return "xla"
  if pallas_lib.has_triton():
    return "pallas"
  _warn_no_triton()
  return "cudnn"


def _named(implementation: str | None, impl: str) -> str:
  """How an error names the implementation: as given, and what None resolved to."""
  if implementation is None:
    return f"implementation=None (here {impl!r})"
  return f"implementation={impl!r}"


def resolve_implementation(
    *,
    implementation: str | None = None,
    platform: str | None = None,
    pallas: PallasOptions | None = None,
    cudnn_segment_bound: int | None = None,
) -> str:
  """The backend a `segment_attention` call runs, its settings checked against it.

  Rules:
    1. `implementation=None` is `default_implementation(platform=platform)`.
    2. A setting goes only to the backend that uses it: `pallas` to "pallas",
       `cudnn_segment_bound` to "cudnn". Given to another backend it is refused, not ignored; the
       check applies to the resolved backend, so `implementation=None` with `pallas` is refused
       where None means XLA (pass `implementation="pallas"` to mean Pallas).
    3. Only when `platform` is given: "pallas" on "cpu" needs `pallas.interpret=True` (the
       Triton kernels need a GPU). Without a platform nothing is checked against one, so a CPU
       host can still lower for a GPU (`lowering_platforms=("cuda",)`); lowered for the CPU
       without interpret mode, the kernel then fails with one line naming
       `PallasOptions(interpret=True)` (`pallas.cpu_guard`).
    4. "pallas" without interpret mode needs JAX's Pallas Triton backend; a JAX without it
       refuses an explicit "pallas" in one line naming "cudnn" and "xla" (None picks "cudnn" on
       a GPU then, rule 1).

  Example: `resolve_implementation(implementation="pallas", platform="cpu",
  pallas=PallasOptions(interpret=True))` is "pallas"; without `pallas` it raises.

  Args:
    implementation: "xla", "pallas", "cudnn" or None.
    platform: where the call runs ("cpu", "gpu", ...), or None (see rule 3).
    pallas: the Pallas settings, or None.
    cudnn_segment_bound: cuDNN's static bound on segments per row, or None.

  Returns:
    "xla", "pallas" or "cudnn".

  Raises:
    AttentionInputError: an unknown implementation, a setting for another backend, Pallas on
      the CPU without interpret mode, or Pallas without interpret mode on a JAX without its
      Triton backend.
  """
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise AttentionInputError(
        f"segment_attention: `implementation` must be one of {IMPLEMENTATIONS} or None, got "
        f"{implementation!r}")
  impl = default_implementation(platform=platform) if implementation is None else implementation
  if pallas is not None and not isinstance(pallas, PallasOptions):
    raise AttentionInputError(
        f"segment_attention: `pallas` must be a PallasOptions or None, got {pallas!r}")
  if pallas is not None and impl != "pallas":
    raise AttentionInputError(
        f"segment_attention: `pallas`={pallas!r} is a Pallas setting, but "
        f"{_named(implementation, impl)} does not use it; pass implementation='pallas' or drop "
        "`pallas`")
  if cudnn_segment_bound is not None and impl != "cudnn":
    raise AttentionInputError(
        f"segment_attention: `cudnn_segment_bound`={cudnn_segment_bound!r} is a cuDNN setting, "
        f"but {_named(implementation, impl)} does not use it; pass implementation='cudnn' or "
        "drop `cudnn_segment_bound`")
  if platform == "cpu" and impl == "pallas" and not (pallas is not None and pallas.interpret):
    raise AttentionInputError(
        f"segment_attention: {_named(implementation, impl)} on the CPU needs "
        "`pallas.interpret=True` (pallas=PallasOptions(interpret=True): the GPU kernels in Pallas "
        f"interpret mode, slowly), got pallas={pallas!r}; or use implementation='xla'")
  interpret = pallas is not None and pallas.interpret
  if impl == "pallas" and not interpret and not pallas_lib.has_triton():
    raise AttentionInputError(pallas_lib.no_triton_message(_named(implementation, impl)))
  return impl


def backend_mesh(*, implementation: str | None,
                 mesh: jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
  """The `mesh=` for a `segment_attention` call whose inputs are sharded over `mesh`.

  The kernel backends (Pallas, cuDNN) are custom calls the jit partitioner cannot split: under
  the mesh they run per device in `shard_map`; without it their sharded inputs would be gathered
  onto every device. XLA's dense attention is ordinary jitted code that the partitioner splits
  by the inputs' shardings, so it gets None. The same holds on either kind of mesh axes
  (`jax.sharding.AxisType`): on `Explicit` axes the XLA ops carry their inputs' shardings, and
  `segment_attention` reshards the inputs of `shard_map` to its specs (`sharded.run_shard_map`).

  Args:
    implementation: "xla", "pallas", "cudnn" or None (resolved by `resolve_implementation`).
    mesh: the caller's mesh (of `Auto` or `Explicit` axes), or None.

  Returns:
    `mesh` for Pallas and cuDNN, None for XLA.
  """
  return None if resolve_implementation(implementation=implementation) == "xla" else mesh


def _backend(impl: str, *, slots: bool, pallas: PallasOptions | None,
             cudnn_segment_bound: int | None, check_segments: bool):
  """The backend function and its keyword settings (Pallas gets its `PallasOptions` whole);
  `slots`: the slot-placed variant (XLA and Pallas only)."""
  if impl == "xla":
    return (segment_attention_xla_slots if slots else segment_attention_xla), {}
  if impl == "pallas":
    fn = (pallas_lib.segment_attention_pallas_slots if slots
          else pallas_lib.segment_attention_pallas)
    return fn, dict(pallas=pallas)
  return cudnn.segment_attention_cudnn, dict(cudnn_segment_bound=cudnn_segment_bound,
                                             check_segments=check_segments)


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    slot_index: jax.Array | None = None,
    prefix_segment_ids: jax.Array | None = None,
    causal: bool = True,
    scale: float | None = None,
    implementation: Implementation | None = None,
    pallas: PallasOptions | None = None,
    cudnn_segment_bound: int | None = None,
    check_segments: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | tuple[str, ...] | None = BATCH_AXES,
    head_axis: str | tuple[str, ...] | None = TENSOR_AXIS,
    context_axis: str | None = None,
) -> jax.Array:
  """Attention in which a query sees only keys of its own segment (document).

  Args:
    q: queries `[B, S, H, D]`, float32, bfloat16 or float16.
    k: keys `[B, S, K, D]`, same dtype; H must be a multiple of K (grouped-query attention).
    v: values `[B, S, K, D]`, same dtype.
    segment_ids: integer `[B, S]`; each non-zero id one contiguous run (a document), 0 = padding.
      With `slot_index`, contiguous in slot order.
    slot_index: optional integer `[B, S]`: each slot's index in the row before any reordering
      (context parallelism reorders rows into chunks); None: `arange(S)`. The causal mask is
      `slot_index[k] <= slot_index[q]`. Invariants (checked by `check_segments=True`): each row
      a permutation of `0..S-1`; every non-zero segment one contiguous run in slot order; with a
      context axis of more than one device, the slots of each of its devices ascending (without
      one, any permutation: the rows are attended in row order and the output put back). Not
      with cuDNN.
    prefix_segment_ids: optional integer `[B, S]`: shared prefixes (preference pairs whose
      prompt is stored once). Slot `q` holds the id of the segment its segment continues (its
      prompt), 0 = none. Query `q` sees key `k` iff `segment_ids[q] != 0`, `k <= q` when causal,
      and `segment_ids[k] == segment_ids[q]` or (`prefix_segment_ids[q] != 0` and
      `segment_ids[k] == prefix_segment_ids[q]`). Example: `segment_ids = [1 1 1 2 2 3 3 3 4 4
      5 5 0 0]`, `prefix_segment_ids = [0 0 0 1 1 1 1 1 0 0 4 4 0 0]`: segments 2 and 3 (chosen,
      rejected) both see prompt 1 and themselves, never each other; the prompt sees itself only;
      segment 5 sees prompt 4. Invariants (checked by `check_segments=True`): a non-zero prefix
      id is constant over its segment, names a segment of the row that lies entirely before it
      and has no prefix itself (one level). XLA and Pallas (which visits the prompt's blocks
      too); not with cuDNN, `slot_index` or `context_axis`. None: no prefixes, every code path
      as without the argument.
    causal: also hide keys after the query.
    scale: logit scale, default `1/sqrt(D)`.
    implementation: `"xla"`, `"pallas"`, `"cudnn"` or None (Pallas on a GPU, XLA elsewhere).
    pallas: Pallas only: the kernel settings (`PallasOptions`: blocks, warps, stages, shared
      memory, interpret mode); None: the defaults. Refused with another backend
      (`resolve_implementation`).
    cudnn_segment_bound: cuDNN only and required there: the static bound N on segments
      (non-zero runs) per row, e.g. `round_segment_bound(PackedDataset.segment_bound)`.
      cuDNN's backward memory grows as B*N*H*S*D (516 GiB measured at B=2, N=S=4096, H=16,
      D=128), so N = S is no default; without it the call raises `AttentionInputError`.
      Refused with another backend.
    check_segments: verify that every non-zero segment id forms one contiguous run (the Pallas and
      cuDNN backends silently assume it), the `slot_index` invariants when given or with a
      context axis, the `prefix_segment_ids` invariants when given, and, for cuDNN, that no row
      has more than `cudnn_segment_bound` segments.
      Concrete inputs are checked now; traced inputs when the computation runs (host callback).
    mesh: run sharded on this mesh under `shard_map` (works inside `jax.jit` with `NamedSharding`
      inputs): the batch split over `batch_axis`, the heads over `head_axis`, the sequence over
      `context_axis`. Its axes may be `Auto` or `Explicit` (`jax.make_mesh`'s default), or
      both; on explicit axes the inputs are resharded to those splits first.
    batch_axis: mesh axis, or tuple of axes, for the batch (None: replicated); default
      `segpack.mesh.BATCH_AXES`, `("data", "fsdp")`, the trainer's mesh.
    head_axis: mesh axis, or tuple of axes, for the heads (None: replicated); must divide H and K;
      default `segpack.mesh.TENSOR_AXIS`, `"tensor"`.
    context_axis: mesh axis splitting the sequence (context parallelism, e.g.
      `segpack.mesh.CONTEXT_AXIS`), needs `mesh`; S must be divisible by its size. Each device
      all-gathers the whole row's keys, values, segment ids and slot indices and attends for its
      own `S / cp` queries; dK and dV are reduce-scattered back. None: the sequence is not split.

  Returns:
    `[B, S, H, D]` in the dtype of `q`; zeros at padding queries.

  Raises:
    AttentionInputError: bad shapes, H not a multiple of K, a bad block size, an unknown
      implementation, a setting for another backend, cuDNN without a positive
      `cudnn_segment_bound` or with `slot_index`/`context_axis`, `context_axis` without `mesh`,
      `prefix_segment_ids` with cuDNN, `slot_index` or `context_axis`.
    AttentionTypeError: bad dtypes.
    NonContiguousSegmentsError: with `check_segments=True`, a segment id in two runs, or a broken
      `slot_index` or `prefix_segment_ids` invariant.
  """
  shape = validate_inputs(q, k, v, segment_ids)
  scale = default_scale(shape.head_dim, scale)
  impl = resolve_implementation(implementation=implementation, pallas=pallas,
                                cudnn_segment_bound=cudnn_segment_bound)
  if context_axis is not None and mesh is None:
    raise AttentionInputError(
        f"segment_attention: `context_axis`={context_axis!r} needs `mesh` (the mesh that has "
        "that axis), got mesh=None")
  if prefix_segment_ids is not None:
    _refuse_prefix(impl, slot_index=slot_index, context_axis=context_axis)
  cp = 1 if context_axis is None else context_size(mesh, context_axis)
  if impl == "cudnn" and (slot_index is not None or context_axis is not None):
    raise AttentionInputError(
        "segment_attention: implementation='cudnn' supports neither `slot_index` nor "
        "`context_axis` (its packed layout needs every document's slots in row order on one "
        "device); use implementation='pallas' or 'xla' for context parallelism")
  fn, kwargs = _backend(impl, slots=cp > 1, pallas=pallas,
                        cudnn_segment_bound=cudnn_segment_bound, check_segments=check_segments)
  kwargs.update(causal=causal, scale=scale)
  if prefix_segment_ids is not None:
    prefix_BxS = validate_prefix_ids(prefix_segment_ids, shape)
    if check_segments:
      check_prefix(segment_ids, prefix_BxS)
    return _row_attention(_with_prefix(fn), q, k, v, segment_ids, prefix_BxS, mesh=mesh,
                          batch_axis=batch_axis, head_axis=head_axis, **kwargs)
  if slot_index is None and cp == 1:
    if check_segments:
      check_contiguous(segment_ids)
    return _row_attention(fn, q, k, v, segment_ids, mesh=mesh, batch_axis=batch_axis,
                          head_axis=head_axis, **kwargs)
  if slot_index is None:
    slot_index = jnp.broadcast_to(
        jnp.arange(shape.seq_len, dtype=jnp.int32), (shape.batch, shape.seq_len))
  slot_index = validate_slot_index(slot_index, shape)
  if check_segments:
    check_slots(segment_ids, slot_index, context_size=cp)
  if cp == 1:  # whole rows on every device: attend in row order, put the output back
    return _row_attention(_in_row_order(fn), q, k, v, segment_ids, slot_index, mesh=mesh,
                          batch_axis=batch_axis, head_axis=head_axis, **kwargs)
  return context_attention(fn, q, k, v, segment_ids, slot_index, mesh=mesh,
                           batch_axis=batch_axis, head_axis=head_axis,
                           context_axis=context_axis, **kwargs)


def _refuse_prefix(impl: str, *, slot_index, context_axis) -> None:
  """Refuses `prefix_segment_ids` where it is not implemented (cuDNN, reordered rows, context
  parallelism)."""
  if impl == "cudnn":
    raise AttentionInputError(
        "segment_attention: `prefix_segment_ids` is not supported by implementation='cudnn' "
        "(its packed layout gives every query the keys of one sequence only); use "
        "implementation='pallas' or 'xla'")
  given = [name for name, x in (("slot_index", slot_index), ("context_axis", context_axis))
           if x is not None]
  if given:
    raise AttentionInputError(
        f"segment_attention: `prefix_segment_ids` cannot be combined with `{given[0]}` (shared "
        "prefixes are implemented for whole rows in row order only); drop one of them")


def _with_prefix(fn):
  """`fn` taking the prefix ids as a fifth positional array (a row input, split like the
  segment ids under a mesh) and passing them as its `prefix_segment_ids_BxS`."""
  def attend(q, k, v, segment_ids, prefix_BxS, **kwargs):
    return fn(q, k, v, segment_ids, prefix_segment_ids_BxS=prefix_BxS, **kwargs)
  return attend


def _in_row_order(fn):
  """`fn` on whole rows in any slot order: put in row (slot index) order, attend, put back.

  Under a mesh this runs per device (rows are whole on every device, so the reordering moves
  nothing between devices, and no gather meets an explicitly sharded array).
  """
  def attend(q, k, v, segment_ids, slot_index, **kwargs):
    to_row, from_row = row_order(slot_index)
    return from_row(fn(to_row(q), to_row(k), to_row(v), to_row(segment_ids), **kwargs))
  return attend


def _row_attention(fn, q, k, v, *rows, mesh, batch_axis, head_axis, **kwargs):
  """A backend on whole rows (`rows`: the segment ids, then any more `[B, S]` inputs of `fn`):
  directly, or per device under `shard_map` with a mesh."""
  if mesh is None:
    return fn(q, k, v, *rows, **kwargs)
  return shard_attention(fn, q, k, v, *rows, mesh=mesh, batch_axis=batch_axis,
                         head_axis=head_axis, **kwargs)
