"""The device mesh and the shardings of parameters, optimizer state and batches.

One mesh with axes `data`, `fsdp`, `context` and `tensor` (the names of `segpack.mesh`). Batches
are split over `data` x `fsdp` (rows) and `context` (the slots of every row: context parallelism,
each device holding S / context consecutive slots of the row in context order,
`train.context_batches`); parameters are split over `fsdp` (ZeRO-3 style: gathered for the
matmul) and `tensor` (Megatron style: the head/feed-forward dimension) by explicit rules on the
parameter path; a dimension that does not divide by its mesh axis is replicated instead. The
shardings are derived from abstract shapes (`jax.eval_shape` / `nnx.eval_shape`), never from
materialised arrays. The mesh's axes are `Explicit` (sharding in types, `jax.make_mesh`'s
default); `train.model.layout` names the shardings of the decoder's ops on it.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from segpack.errors import UserError
from segpack.mesh import BATCH_AXES, CONTEXT_AXIS, DATA_AXIS, FSDP_AXIS, MESH_AXES, TENSOR_AXIS

AXES = MESH_AXES  # the mesh's axes, in order (names shared with `segment_attention`'s defaults)


class MeshConfigError(UserError, ValueError):
  """The mesh shape does not fit the devices, or the batch does not fit the mesh."""


def mesh_shape(*, data: int, fsdp: int, tensor: int, num_devices: int,
               context: int = 1) -> tuple[int, int, int, int]:
  """Resolves a `-1` (at most one) to fill `num_devices` and checks the product.

  Returns:
    The sizes in mesh order, `(data, fsdp, context, tensor)`.

  Raises:
    MeshConfigError: more than one `-1`, a non-positive size, or a product != `num_devices`.
  """
  sizes = {DATA_AXIS: data, FSDP_AXIS: fsdp, CONTEXT_AXIS: context, TENSOR_AXIS: tensor}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise MeshConfigError(f"mesh: at most one axis may be -1, got {sizes}")
  bad = {k: v for k, v in sizes.items() if v != -1 and (not isinstance(v, int) or v < 1)}
  if bad:
    raise MeshConfigError(f"mesh: axis sizes must be positive ints or -1, got {bad}")
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if num_devices % fixed:
      raise MeshConfigError(
          f"mesh: {num_devices} devices are not divisible by the fixed axes {sizes} "
          f"(product {fixed})")
    sizes[free[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise MeshConfigError(
        f"mesh: axes {sizes} need {math.prod(sizes.values())} devices, but there are "
        f"{num_devices}")
  return tuple(sizes[a] for a in AXES)


def make_mesh(*, data: int = -1, fsdp: int = 1, tensor: int = 1, context: int = 1,
              devices: Sequence[Any] | None = None) -> Mesh:
  """Builds the `("data", "fsdp", "context", "tensor")` mesh over `devices` (default: all).

  Its axes are `Explicit` (`jax.sharding.AxisType`), what `jax.make_mesh` makes by default: every
  array's type carries its sharding, and the decoder names the sharding of each op whose output
  JAX cannot infer (`train.model.layout`: the ZeRO-3 gathers of `fsdp`-split kernels, the Megatron
  splits over `tensor`, the embedding lookup, the whole-vocabulary logits). `segment_attention`
  runs its kernels under `shard_map` on it (`segpack.attention.sharded.run_shard_map`).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(data=data, fsdp=fsdp, tensor=tensor, context=context,
                     num_devices=len(devices))
  explicit = (jax.sharding.AxisType.Explicit,) * len(AXES)  # named: not left to the default
  if devices == list(jax.devices()):
    return jax.make_mesh(shape, AXES, devices=devices, axis_types=explicit)
  return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=explicit)


def batch_partitions(mesh: Mesh) -> int:
  """Number of row shards of a batch (`data` x `fsdp`)."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch(batch_size: int, *, mesh: Mesh, grad_accum_steps: int = 1,
                process_count: int = 1) -> None:
  """Checks that the global batch splits evenly over processes, micro-batches and devices.

  Raises:
    MeshConfigError: naming the batch size and the number it must divide by.
  """
  parts = batch_partitions(mesh)
  if batch_size % process_count:
    raise MeshConfigError(
        f"train.batch_size={batch_size} is not divisible by the {process_count} processes")
  if batch_size % grad_accum_steps:
    raise MeshConfigError(
        f"train.batch_size={batch_size} is not divisible by "
        f"train.grad_accum_steps={grad_accum_steps}")
  _check_context_in_process(mesh)
  micro = batch_size // grad_accum_steps
  if micro % parts:
    raise MeshConfigError(
        f"micro-batch of {micro} rows (train.batch_size={batch_size} / grad_accum_steps="
        f"{grad_accum_steps}) is not divisible by the {parts} batch shards of the mesh "
        f"(data={mesh.shape[DATA_AXIS]} x fsdp={mesh.shape[FSDP_AXIS]}; {jax.device_count()} "
        "devices)")


def _check_context_in_process(mesh: Mesh) -> None:
  """Every row's `context` devices belong to one process (a process reads whole rows)."""
  processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
  axis = mesh.axis_names.index(CONTEXT_AXIS)
  if (processes != processes.take([0], axis=axis)).any():
    raise MeshConfigError(
        f"mesh.context={mesh.shape[CONTEXT_AXIS]} spans devices of several processes; each "
        "process reads whole rows, so a row's context devices must be one process's (make "
        "mesh.context at most the devices per process)")


# (path substring, spec per dimension). The first matching rule wins; paths look like
# "layers/0/attn/q/kernel". Kernels are [in, out].
_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("embed/embedding", (TENSOR_AXIS, FSDP_AXIS)),  # [V, E]
    ("attn/o/kernel", (TENSOR_AXIS, FSDP_AXIS)),  # [H*D, E]
    ("attn/", (FSDP_AXIS, TENSOR_AXIS)),  # q, k, v: [E, H*D] / [E, K*D]
    ("mlp/down/kernel", (TENSOR_AXIS, FSDP_AXIS)),  # [F, E]
    ("mlp/", (FSDP_AXIS, TENSOR_AXIS)),  # gate, up: [E, F]
    ("lm_head/kernel", (FSDP_AXIS, TENSOR_AXIS)),  # [E, V]
)


def param_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  """The `PartitionSpec` of the parameter at `path` (dims not divisible by the axis replicate)."""
  for pattern, axes in _RULES:
    if pattern in path and len(axes) == len(shape):
      spec = [a if a is not None and dim % mesh.shape[a] == 0 and mesh.shape[a] > 1 else None
              for a, dim in zip(axes, shape)]
      return P(*spec)
  return P()  # norms' scales and anything unknown: replicated


def path_str(path) -> str:
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def param_name(path: Any) -> str:
  """A parameter's tree path as one name, as `tensor_map` names it (`layers/0/attn/q/kernel`):
  `path_str` without nnx's trailing `value`."""
  return path_str(path).removesuffix("/value")


def flat_params(tree: Any) -> dict[str, Any]:
  """`{param_name(path): leaf}` of a parameter tree (arrays or shapes), in its leaves' order."""
  return {param_name(path): x for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def param_shardings(abstract_params: Any, mesh: Mesh) -> Any:
  """`NamedSharding`s for a pytree of parameter shapes (e.g. from `nnx.eval_shape`)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(path_str(path), x.shape, mesh)),
      abstract_params)


def opt_state_shardings(tx: optax.GradientTransformation, abstract_params: Any,
                        params_sharding: Any, mesh: Mesh) -> Any:
  """Shardings of `tx.init(params)`: moment trees follow their parameters, the rest replicates."""
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(
      tx, lambda _, sharding: sharding, abstract_opt, params_sharding,
      transform_non_params=lambda _: replicated)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over `data` x `fsdp`, slots over `context` (for every `[B, S]` feature)."""
  return NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))


def batch_shardings(mesh: Mesh, batch: dict[str, Any]) -> dict[str, NamedSharding]:
  """Every feature's sharding: `[B, S]` as `batch_sharding`; per-pair `[B, J]` features
  (`segpack.data.pairs`: `pair_*`, `ref_*`) rows over `data` x `fsdp`, pairs whole."""
  rows = NamedSharding(mesh, P(BATCH_AXES, None))
  return {k: rows if k.startswith(("pair_", "ref_")) else batch_sharding(mesh) for k in batch}


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles the global batch from every process's rows (this process's part is `local_batch`)."""
  shardings = batch_shardings(mesh, local_batch)
  return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v))
          for k, v in local_batch.items()}
