"""Sharded segment attention: the per-device call wrapped in `jax.shard_map`.

Rows are independent and so are heads, so attention needs no communication when the batch is
split over the batch axes and the heads over the tensor axis (by default the names of
`segpack.mesh`: batch over `("data", "fsdp")`, heads over `"tensor"`): every device runs the kernel
on its `[B / batch, S, H / tensor, D]` block (and `[B / batch, S, K / tensor, D]` keys and values;
the grouped-query pairing `h // G` is preserved because both head dims are split into contiguous
chunks). The sequence axis is not split here; `context_parallel.py` splits it (context parallelism).

Both kinds of mesh axes work (`jax.sharding.AxisType`): on `Auto` axes (the jit partitioner's
sharding propagation) `shard_map` splits its inputs by its `in_specs`; on `Explicit` axes (what
`jax.make_mesh` makes by default) an array's type carries its sharding and `shard_map` accepts
only inputs typed as its `in_specs`, so `run_shard_map` first reshards every input to them
(`jax.sharding.reshard`, over the explicit axes only when a mesh mixes both kinds).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from segpack.attention.checks import AttentionInputError
from segpack.mesh import BATCH_AXES, TENSOR_AXIS


AxisNames = str | tuple[str, ...] | None


def axis_size(mesh: Mesh, axis: AxisNames, arg: str) -> int:
  """Devices along one mesh axis name, or the product over a tuple of names (None: 1).

  Raises:
    AttentionInputError: a name that is not an axis of `mesh` (the error names `arg`).
  """
  names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
  size = 1
  for name in names:
    if name not in mesh.shape:
      raise AttentionInputError(
          f"segment_attention: `{arg}`={axis!r} names {name!r}, not an axis of the mesh "
          f"{dict(mesh.shape)} (pass `{arg}` naming axes of this mesh, or None to replicate)")
    size *= mesh.shape[name]
  return size


def check_divisible(mesh: Mesh, q_BxSxHxD: jax.Array, k_BxSxKxD: jax.Array, *,
                    batch_axis: AxisNames, head_axis: AxisNames,
                    context_axis: str | None = None) -> None:
  """Checks that every mesh axis divides the dimension it splits: B by `batch_axis`, S by
  `context_axis` (if any), H and K by `head_axis`.

  Raises:
    AttentionInputError: an unknown axis, or a dimension its axis does not divide.
  """
  b, s, h, _ = q_BxSxHxD.shape
  dims = [("batch B", b, batch_axis, "batch_axis")]
  if context_axis is not None:
    dims.append(("sequence S", s, context_axis, "context_axis"))
  dims += [("query heads H", h, head_axis, "head_axis"),
           ("key/value heads K", k_BxSxKxD.shape[2], head_axis, "head_axis")]
  for name, size, axis, arg in dims:
    n = axis_size(mesh, axis, arg)
    if size % n:
      raise AttentionInputError(
          f"segment_attention: {name}={size} is not divisible by mesh axis {axis!r} of size {n}")


def explicit_spec(spec: P, mesh: Mesh) -> P:
  """`spec` keeping only the mesh's `Explicit` axes (a dimension left with none: None)."""
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  entries = []
  for entry in spec:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(name for name in names if name in explicit)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return P(*entries)


def run_shard_map(per_device: Callable[..., jax.Array], *args: jax.Array, mesh: Mesh,
                  in_specs: tuple[P, ...], out_specs: P) -> jax.Array:
  """`jax.shard_map(per_device, ...)(*args)` on a mesh of `Auto` or `Explicit` axes (or both).

  With explicit axes, each input is first resharded to its spec's explicit axes
  (`jax.sharding.reshard`; a no-op when it is already sharded so, and the transpose reshards
  the cotangent back), since `shard_map` refuses an explicitly sharded input typed otherwise.
  """
  if AxisType.Explicit in mesh.axis_types:
    args = tuple(jax.sharding.reshard(x, NamedSharding(mesh, explicit_spec(spec, mesh)))
                 for x, spec in zip(args, in_specs))
  return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)


def shard_attention(
    attention_fn: Callable[..., jax.Array],
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    *rows_BxS: jax.Array,
    mesh: Mesh,
    batch_axis: AxisNames = BATCH_AXES,
    head_axis: AxisNames = TENSOR_AXIS,
    **kwargs: Any,
) -> jax.Array:
  """Runs `attention_fn(q, k, v, segment_ids, *rows, **kwargs)` per device under `shard_map`.

  Args:
    attention_fn: a single-device backend, e.g. `segment_attention_pallas`.
    q_BxSxHxD: queries; B divisible by the `batch_axis` size, H by the `head_axis` size.
    k_BxSxKxD: keys; K divisible by the `head_axis` size.
    v_BxSxKxD: values.
    segment_ids_BxS: segment ids.
    *rows_BxS: more `[B, S]` arrays for `attention_fn`, split like `segment_ids` (e.g. the
      slot indices).
    mesh: the device mesh, of `Auto` or `Explicit` axes.
    batch_axis: mesh axis (or tuple of axes) splitting the batch, or None; default
      `segpack.mesh.BATCH_AXES`, `("data", "fsdp")`.
    head_axis: mesh axis (or tuple of axes) splitting the heads, or None; default
      `segpack.mesh.TENSOR_AXIS`, `"tensor"`.
    **kwargs: passed to `attention_fn`.

  Returns:
    `out_BxSxHxD`, sharded like `q` (`P(batch_axis, None, head_axis, None)`).

  Raises:
    AttentionInputError: an unknown axis, or a dimension its axis does not divide.
  """
  check_divisible(mesh, q_BxSxHxD, k_BxSxKxD, batch_axis=batch_axis, head_axis=head_axis)
  heads_spec = P(batch_axis, None, head_axis, None)
  seg_spec = P(batch_axis, None)

  def per_device(q, k, v, *rows):
    return attention_fn(q, k, v, *rows, **kwargs)

  rows = (segment_ids_BxS,) + rows_BxS
  return run_shard_map(per_device, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, *rows, mesh=mesh,
                       in_specs=(heads_spec,) * 3 + (seg_spec,) * len(rows),
                       out_specs=heads_spec)
