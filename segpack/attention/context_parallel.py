"""Context parallelism for segment attention: a row's slots split over a mesh axis (all-gather).

With `segment_attention(..., mesh=mesh, context_axis="context")` the sequence dimension of `q`,
`k`, `v`, `segment_ids` and `slot_index` is split over the context axis: each device holds `S / cp`
consecutive slots of the (possibly reordered) row. Each device all-gathers the keys, values,
segment ids and slot indices of the whole row over the context axis, then computes attention for
its own queries against the whole row (a backend taking separate query and key arrays: the mask
is `seg_q == seg_k != 0` and, causal, `slot_k <= slot_q`). Autodiff transposes the all-gather
into a reduce-scatter (`psum_scatter`) of dK and dV: every device's share of the row receives the
sum of the gradients every device computed for it. Documents are never padded or cut: a document
may start and end anywhere on any device.

`context_comm_bytes` counts what this moves per layer.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from segpack.attention.checks import AttentionInputError
from segpack.attention.sharded import AxisNames, axis_size, check_divisible, run_shard_map
from segpack.errors import ArgumentError
from segpack.mesh import BATCH_AXES, TENSOR_AXIS

# Bytes of one segment id and of one slot index as they travel (int32).
ID_BYTES = 4

__all__ = ["context_attention", "context_comm_bytes", "context_size", "row_order"]


def context_size(mesh: Mesh, context_axis: str) -> int:
  """Devices along `context_axis` of `mesh`.

  Raises:
    AttentionInputError: `context_axis` not one name, or not an axis of `mesh`.
  """
  if not isinstance(context_axis, str):
    raise AttentionInputError(
        f"segment_attention: `context_axis` must be one mesh axis name or None, got "
        f"{context_axis!r}")
  return axis_size(mesh, context_axis, "context_axis")


def row_order(slot_index_BxS: jax.Array) -> tuple[Callable, Callable]:
  """`(to_row, from_row)`: put `[B, S, ...]` arrays in row (slot index) order and back.

  `to_row(x)[b, slot_index[b, i]] = x[b, i]`, as a gather by the inverse permutation (built with
  one scatter); `from_row` gathers by `slot_index`. Both are gathers, whose transposes are
  scatter-adds, so gradients flow through them.
  """
  b, s = slot_index_BxS.shape
  order_BxS = jnp.zeros((b, s), jnp.int32).at[jnp.arange(b)[:, None], slot_index_BxS].set(
      jnp.arange(s, dtype=jnp.int32)[None])  # order[slot] = where that slot sits

  def take(x, index_BxS):
    return jnp.take_along_axis(x, index_BxS.reshape((b, s) + (1,) * (x.ndim - 2)), axis=1)

  return (lambda x: take(x, order_BxS)), (lambda x: take(x, slot_index_BxS))


def context_attention(
    attention_fn: Callable[..., jax.Array],
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    slot_index_BxS: jax.Array,
    *,
    mesh: Mesh,
    batch_axis: AxisNames = BATCH_AXES,
    head_axis: AxisNames = TENSOR_AXIS,
    context_axis: str | None = None,
    **kwargs: Any,
) -> jax.Array:
  """Runs a slot-placed backend per device under `shard_map`, the sequence over `context_axis`.

  Per device: `attention_fn(q, k_all, v_all, seg, seg_all, slot, slot_all, **kwargs)`, where
  `q`, `seg` and `slot` are the device's `S / cp` slots and `k_all`, `v_all`, `seg_all`,
  `slot_all` the whole row (all-gathered over `context_axis`; without a context axis the
  device's own arrays, i.e. the whole row).

  Args:
    attention_fn: a backend with the signature of `xla.segment_attention_xla_slots`.
    q_BxSxHxD: queries; B divisible by the batch axes, S by the context axis, H by the head axes.
    k_BxSxKxD: keys; K divisible by the head axes.
    v_BxSxKxD: values.
    segment_ids_BxS: segment ids.
    slot_index_BxS: int32 slot index of every slot in the row before reordering.
    mesh: the device mesh, of `Auto` or `Explicit` axes.
    batch_axis: mesh axis (or tuple of axes) splitting the batch, or None.
    head_axis: mesh axis (or tuple of axes) splitting the heads, or None.
    context_axis: mesh axis splitting the sequence, or None.
    **kwargs: passed to `attention_fn`.

  Returns:
    `out_BxSxHxD`, sharded like `q` (`P(batch_axis, context_axis, head_axis, None)`).

  Raises:
    AttentionInputError: an unknown axis, or a dimension its axis does not divide.
  """
  if context_axis is not None:
    context_size(mesh, context_axis)  # one axis name of this mesh
  check_divisible(mesh, q_BxSxHxD, k_BxSxKxD, batch_axis=batch_axis, head_axis=head_axis,
                  context_axis=context_axis)
  heads_spec = P(batch_axis, context_axis, head_axis, None)
  rows_spec = P(batch_axis, context_axis)

  def gather(x):
    if context_axis is None:
      return x
    return jax.lax.all_gather(x, context_axis, axis=1, tiled=True)

  def per_device(q, k, v, seg, slot):
    return attention_fn(q, gather(k), gather(v), seg, gather(seg), slot, gather(slot), **kwargs)

  return run_shard_map(
      per_device, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, slot_index_BxS, mesh=mesh,
      in_specs=(heads_spec, heads_spec, heads_spec, rows_spec, rows_spec), out_specs=heads_spec)


def context_comm_bytes(*, seq_len: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                       context_size: int, batch: int = 1) -> dict[str, int]:
  """Bytes one device sends (and receives) per attention layer with all-gather context parallelism.

  A ring all-gather or reduce-scatter of an array of `n` bytes moves `n (cp - 1) / cp` bytes in
  and out of every device. Forward: the all-gather of K and V (`S * kv_heads * head_dim` elements
  each) and of the int32 segment ids and slot indices. Backward: the reduce-scatter of dK and dV
  (in the dtype of K and V). When the backward recomputes the forward (rematerialisation) the
  all-gathers run again; that is not counted here.

  Args:
    seq_len: S, slots per row (the whole row, over every device of the context axis).
    kv_heads: K, key/value heads on the device (after any head split).
    head_dim: D.
    dtype_bytes: bytes per element of K and V (2 for bf16).
    context_size: cp, devices along the context axis.
    batch: rows per device.

  Returns:
    `{"all_gather_kv", "all_gather_ids", "reduce_scatter_dkv", "forward", "backward", "total"}`,
    bytes per device per layer; all zero when `context_size == 1`.

  Raises:
    ValueError: a non-positive size, or `seq_len` not divisible by `context_size`.
  """
  sizes = dict(seq_len=seq_len, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
               context_size=context_size, batch=batch)
  for name, value in sizes.items():
    if not isinstance(value, int) or value < 1:
      raise ArgumentError(f"context_comm_bytes: `{name}` must be a positive int, got {value!r}")
  if seq_len % context_size:
    raise ArgumentError(f"context_comm_bytes: `seq_len`={seq_len} is not divisible by "
                     f"`context_size`={context_size}")
  moved = batch * seq_len * (context_size - 1) // context_size  # slots received per device
  kv = 2 * moved * kv_heads * head_dim * dtype_bytes
  ids = 2 * moved * ID_BYTES
  return {"all_gather_kv": kv, "all_gather_ids": ids, "reduce_scatter_dkv": kv,
          "forward": kv + ids, "backward": kv, "total": 2 * kv + ids}
