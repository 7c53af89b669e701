"""Where the decoder's arrays live on a mesh with explicit axes (sharding in types).

On a mesh of `Explicit` axes (`jax.sharding.AxisType`: what `jax.make_mesh` makes by default,
and the trainer's mesh, `train.sharding.make_mesh`) every array's type carries its sharding, and
JAX refuses an op whose output sharding it cannot infer (a matmul contracting a dimension split
on both sides, a gather from a split table). The decoder therefore says where each array lives:

- activations `[B, S, E]`: rows and slots split as the batch's token ids are (`P(rows, slots)`,
  `layout_of`), the model dimension E whole on every device;
- a projection out of E (q, k, v, gate, up, the output head): its kernel, stored split over
  `fsdp` (and `tensor`, `train.sharding.param_spec`), is gathered over `fsdp` right before the
  matmul (ZeRO-3) and keeps its output dimension split over `tensor` (Megatron's column split),
  so the output is `P(rows, slots, "tensor")`;
- a projection back to E (o, down): the kernel, gathered likewise, keeps its input dimension
  split over `tensor` (Megatron's row split) and the matmul names its output `P(rows, slots,
  None)`: the partial products are summed over `tensor`;
- the heads are split over `tensor` only when both H and K divide by it, the feed-forward
  dimension when F does, the vocabulary when V does (`Layout.split`); otherwise that dimension
  is whole on every device and its work is repeated there;
- the embedding table is gathered whole for the lookup, and the logits leave the model with the
  vocabulary whole (the loss reads each token's label logit).

The gradient of a gather is the matching reduction (`reshard` transposes to `reshard`), so the
gradients come back in the parameters' own shardings. With no mesh, or on `Auto` axes,
`layout_of` is None and the decoder runs the plain Flax modules (the jit partitioner then
decides); every function here computes what the plain module computes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from segpack import mesh as mesh_lib
from segpack.mesh import BATCH_AXES, CONTEXT_AXIS, TENSOR_AXIS


def context_size(mesh: Any) -> int:
  """Devices that split every row's slots (the `context` axis; 1 for a mesh without it)."""
  return int(dict(getattr(mesh, "shape", {})).get(CONTEXT_AXIS, 1))


@dataclasses.dataclass(frozen=True)
class Layout:
  """The shardings of one decoder call on a mesh with explicit axes.

  Attributes:
    mesh: the (abstract) mesh of the activations' type.
    rows: the spec entry that splits the rows (B) of the activations.
    slots: the spec entry that splits the slots (S).
    tensor: devices of the explicit `tensor` axis (1: the mesh has none).
  """

  mesh: Any
  rows: Any
  slots: Any
  tensor: int

  def split(self, size: int) -> str | None:
    """`TENSOR_AXIS` for a dimension of `size` that divides over more than one tensor device,
    else None (the dimension stays whole)."""
    return TENSOR_AXIS if self.tensor > 1 and size % self.tensor == 0 else None

  def activations(self, *trailing: Any) -> NamedSharding:
    """`P(rows, slots, *trailing)` on the mesh."""
    return NamedSharding(self.mesh, P(self.rows, self.slots, *trailing))

  def put(self, x: jax.Array, *spec: Any) -> jax.Array:
    """`x` resharded to `P(*spec)` (a no-op when it is sharded so already)."""
    return jax.sharding.reshard(x, NamedSharding(self.mesh, P(*spec)))


def mesh_of(x: jax.Array) -> Any:
  """The mesh of explicit axes `x` is typed with, or None: the concrete one of an array outside
  `jit` (what an eager `reshard` needs), else the abstract one of its type."""
  mesh = mesh_lib.explicit_mesh_of(x)
  if mesh is None or isinstance(x, jax.core.Tracer):
    return mesh
  return x.sharding.mesh


def layout_of(x_BxS: jax.Array) -> Layout | None:
  """The `Layout` of arrays split like `x` (`[B, S, ...]`), or None when `x` is not typed with a
  mesh of explicit axes (`mesh_of`)."""
  mesh = mesh_of(x_BxS)
  if mesh is None:
    return None
  spec = tuple(jax.typeof(x_BxS).sharding.spec) + (None, None)
  kinds = dict(zip(mesh.axis_names, mesh.axis_types))
  tensor = mesh.shape[TENSOR_AXIS] if kinds.get(TENSOR_AXIS) == AxisType.Explicit else 1
  return Layout(mesh=mesh, rows=spec[0], slots=spec[1], tensor=tensor)


def on_mesh(mesh: Any, x_BxS: jax.Array | None) -> jax.Array | None:
  """`x` split as the trainer's batches (rows over `data` x `fsdp`, slots over `context`, each
  where it divides, else whole) when `mesh` has explicit axes and `x` is typed with none (NumPy
  inputs, or arguments that `jit`'s `in_shardings` places without typing them); else `x` as it
  is (None stays None).

  A decoder whose parameters are placed on such a mesh, or whose attention runs under
  `shard_map` on it (`train.model.config.attention_mesh`: the kernel backends, context parallelism),
  has arrays typed with it; typing the inputs alike keeps every op of the decoder on the
  explicit path. Inside `jit` the function's arguments must then be on that mesh too (placed,
  or `jit`'s `in_shardings`), as JAX requires of any function using such arrays."""
  if (x_BxS is None or mesh is None or AxisType.Explicit not in mesh.axis_types
      or mesh_lib.explicit_mesh_of(x_BxS) is not None):
    return x_BxS
  spec = []
  for size, axes in zip(x_BxS.shape, (BATCH_AXES, (CONTEXT_AXIS,))):
    axes = tuple(a for a in axes if a in mesh.axis_names)
    devices = math.prod(mesh.shape[a] for a in axes)
    spec.append(axes if axes and size % devices == 0 else None)
  return jax.sharding.reshard(x_BxS, NamedSharding(mesh, P(*spec)))


def dense(linear: nnx.Linear, x_BxSxI: jax.Array, layout: Layout | None, *,
          split_in: str | None = None, split_out: str | None = None,
          kernel_IxO: jax.Array | None = None) -> jax.Array:
  """`linear(x)`, on an explicit mesh with the kernel gathered over `fsdp` to `P(split_in,
  split_out)`.

  `split_out` (a column split) gives the output `P(rows, slots, split_out)`; `split_in` (a row
  split) must be how `x`'s last dimension is split, and its partial products are summed over it.
  The dtype promotion, precision and bias are `nnx.Linear`'s. With `layout` None: `linear(x)`.
  `kernel_IxO`: the kernel to use instead of `linear.kernel` (a dequantized base,
  `train.model.lora`).
  """
  if layout is None and kernel_IxO is None:
    return linear(x_BxSxI)
  bias = linear.bias[...] if linear.bias is not None else None
  x_BxSxI, kernel_IxO, bias = linear.promote_dtype(
      (x_BxSxI, linear.kernel[...] if kernel_IxO is None else kernel_IxO, bias),
      dtype=linear.dtype)
  contract = (((x_BxSxI.ndim - 1,), (0,)), ((), ()))
  if layout is None:
    y_BxSxO = jax.lax.dot_general(x_BxSxI, kernel_IxO, contract, precision=linear.precision,
                                  preferred_element_type=linear.preferred_element_type)
    return y_BxSxO if bias is None else y_BxSxO + bias
  kernel_IxO = layout.put(kernel_IxO, split_in, split_out)
  y_BxSxO = jax.lax.dot_general(
      x_BxSxI, kernel_IxO, contract, precision=linear.precision,
      preferred_element_type=linear.preferred_element_type,
      out_sharding=layout.activations(split_out))
  if bias is not None:
    y_BxSxO += jnp.reshape(layout.put(bias, split_out), (1,) * (y_BxSxO.ndim - 1) + (-1,))
  return y_BxSxO


def lookup(embed: nnx.Embed, ids_BxS: jax.Array, layout: Layout, dtype: Any) -> jax.Array:
  """The embeddings `[B, S, E]` of `ids`, split as the ids are, from the table gathered whole."""
  table_VxE = layout.put(embed.embedding[...], None, None)
  out_BxSxE = table_VxE.at[ids_BxS].get(out_sharding=layout.activations(None))
  return out_BxSxE.astype(dtype)


def attend(embed: nnx.Embed, x_BxSxE: jax.Array, layout: Layout) -> jax.Array:
  """`embed.attend(x)` (tied output head): logits `[B, S, V]` from the table gathered over
  `fsdp`, the vocabulary split over `tensor` when it divides."""
  x_BxSxE, table_VxE = embed.promote_dtype((x_BxSxE, embed.embedding[...]), dtype=embed.dtype)
  split = layout.split(table_VxE.shape[0])
  table_VxE = layout.put(table_VxE, split, None)
  return jnp.dot(x_BxSxE, table_VxE.T, out_sharding=layout.activations(split))


def micro_batches(batch: dict[str, jax.Array], accum: int) -> dict[str, jax.Array]:
  """`[A*M, S]` -> `[A, M, S]` with micro-batch `a` = rows `a, A + a, ...`, so each device's
  contiguous block of rows splits evenly over the micro-batches (no resharding).

  On an explicit mesh the reshape names its output sharding, `[A*M]`'s row split on `M`: left
  to infer it, JAX may put a one-device axis of the row split on `A`, which `lax.scan` refuses.
  """
  out = {}
  for name, x_BxS in batch.items():
    layout = layout_of(x_BxS)
    sharding = None if layout is None else NamedSharding(
        layout.mesh, P(layout.rows, None, layout.slots))
    x_MxAxS = jnp.reshape(x_BxS, (-1, accum, x_BxS.shape[-1]), out_sharding=sharding)
    out[name] = jnp.swapaxes(x_MxAxS, 0, 1)
  return out

