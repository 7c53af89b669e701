"""The device mesh axis names, shared by `segment_attention`'s defaults and the trainer.

One mesh with four axes: rows of a batch are split over `data` x `fsdp`, the slots of every row
over `context` (context parallelism: each device holds S / context slots of a row), parameters
over `fsdp` (ZeRO-3 style) and `tensor` (Megatron style: heads and the feed-forward dimension).
Attention splits its batch over `BATCH_AXES`, its heads over `TENSOR_AXIS` and, when given
`context_axis=CONTEXT_AXIS`, its sequence over `CONTEXT_AXIS`.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["BATCH_AXES", "CONTEXT_AXIS", "DATA_AXIS", "FSDP_AXIS", "MESH_AXES", "TENSOR_AXIS",
           "explicit_mesh_of", "replicated", "whole_slots"]

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
# The axis that splits the sequence of a row (context parallelism, `segment_attention`'s
# `context_axis`); the attention splits over it only when `context_axis` names it.
CONTEXT_AXIS = "context"
# Every axis of the trainer's mesh, in mesh order (`train.sharding.make_mesh`).
MESH_AXES = (DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS, TENSOR_AXIS)
# The axes that split the rows of a batch.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)


def explicit_mesh_of(x: jax.Array):
  """The (abstract) mesh of `x`'s sharding when it has explicit axes (what `jax.make_mesh` makes
  by default), else None: on such a mesh an op whose output sharding JAX cannot infer must be
  told it."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if mesh is None or jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
    return None
  return mesh


def whole_slots(x_BxS: jax.Array) -> jax.Array:
  """`x` (slots on axis 1) with its slots unsplit, on a mesh with explicit axes (what
  `jax.make_mesh` makes by default): every query meets every key of its row, so the key side is
  gathered over a split slot axis, as the partitioner does by itself on auto axes. Elsewhere `x`
  as it is."""
  mesh = explicit_mesh_of(x_BxS)
  if mesh is None:
    return x_BxS
  sharding = jax.typeof(x_BxS).sharding
  spec = list(sharding.spec) + [None] * (x_BxS.ndim - len(sharding.spec))
  if spec[1] is None:
    return x_BxS
  spec[1] = None
  return jax.sharding.reshard(x_BxS, jax.sharding.NamedSharding(mesh, P(*spec)))


def replicated(x: jax.Array) -> jax.Array:
  """`x` whole on every device, on a mesh with explicit axes (what `jax.make_mesh` makes by
  default): for a reduction into a few buckets (a scatter whose indices are split would leave
  JAX to guess the output's sharding). Elsewhere `x` as it is."""
  mesh = explicit_mesh_of(x)
  if mesh is None:
    return x
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, P()))
