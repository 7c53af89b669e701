"""The frozen base of a run with adapters: imported from `model.init_from`, perhaps quantized,
and its fingerprint.

Algorithm of `load_base` (`train.hf.weights.load_params`, with quantization):
  1. The tensors of the Hugging Face directory are checked against the model's parameters in
     their original shapes (a quantized kernel's codes `[I/2, O]` stand for `[I, O]`).
  2. Each parameter is made with `jax.make_array_from_callback` on its sharding. A float one
     reads its device slice (`train.hf.weights.slice_reader`). A quantized one (codes or
     scales) reads the rows of the original tensor its slice covers, widened to whole blocks of
     64 rows (`quantize.source_rows`), quantizes them on the host and keeps its slice: host
     memory holds one slice of one tensor at a time, as for a float import.

`fingerprint` digests what the base holds on the devices: per tensor, sums modulo 2**32 of
functions of each element's bits (exact integer arithmetic, so neither the mesh nor the order of
a reduction changes it), with the tensor's path, shape and dtype. A checkpoint records it and a
resume on another base is refused (`train.checkpoint.Checkpointer`). The sums ignore order, so
a base whose tensors hold the same values in another order would pass; any other change of a
value, a dtype or a shape does not.

Example: `model.lora.base_dtype="nf4"` on a layer of `d_model` 64: `layers/0/attn/q/kernel` is
`uint8 [32, 64]` and `layers/0/attn/q/kernel_scale` `float32 [1, 64]`, both read from
`model.layers.0.self_attn.q_proj.weight` (`[64, 64]`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.model import quantize as quantize_lib
from train.hf import weights as hf_weights
from train import sharding as sharding_lib

SCALE_SUFFIX = "_scale"  # `kernel_scale`: a quantized kernel's block scales


def original_shapes(flat: dict[str, Any], kind: str | None) -> dict[str, tuple[int, ...]]:
  """Each float parameter's shape as the checkpoint stores it (Flax orientation): a quantized
  kernel's original `[I, O]`, from its block scales `[I/64, O]`; the scales themselves are left
  out."""
  shapes = {}
  for path, x in flat.items():
    if path.endswith(SCALE_SUFFIX):
      continue
    scales = flat.get(path + SCALE_SUFFIX)
    if kind and scales is not None:
      shapes[path] = (scales.shape[0] * quantize_lib.BLOCK, scales.shape[1])
    else:
      shapes[path] = tuple(x.shape)
  return shapes


def _quantized_reader(read: Any, *, kind: str, part: str, in_features: int, rows: int) -> Any:
  """The callback of a quantized kernel's codes (`part="kernel"`) or scales: reads the original
  rows its slice covers (`read`: `slice_reader` of the float tensor), quantizes, keeps its rows."""
  def callback(index: tuple[slice, ...]) -> np.ndarray:
    mine = slice(*index[0].indices(rows))
    source, keep = quantize_lib.source_rows(kind=kind, rows=mine, in_features=in_features,
                                            part=part)
    codes, scales = quantize_lib.quantize(kind=kind, w_IxO=read((source,) + tuple(index[1:])))
    return np.ascontiguousarray((codes if part == "kernel" else scales)[keep])
  return callback


def load_base(*, model_dir: str, abstract_frozen: Any, shardings: Any, model_cfg: Any,
              kind: str | None) -> Any:
  """The frozen parameters (`train.model.lora.split`'s third part) read from `model_dir`.

  Args:
    model_dir: the Hugging Face directory (`model.init_from`).
    abstract_frozen: the frozen parameters' shapes.
    shardings: their `NamedSharding`s.
    model_cfg: the config's `model` group (after `hf_config.adopt`).
    kind: the quantization ("nf4", "int8") or None (`lora.quantized`).

  Raises:
    HfModelError: a missing, extra, misshapen or unreadable tensor (`check_tensors`).
  """
  expected = hf_weights.model_tensor_map(model_cfg)
  flat = sharding_lib.flat_params(abstract_frozen)
  shapes = original_shapes(flat, kind)
  files = hf_weights.check_tensors(model_dir, expected, shapes)

  def place(path, abstract, sharding):
    name = sharding_lib.param_name(path)
    kernel = name.removesuffix(SCALE_SUFFIX)
    tensor = expected[kernel]
    if kind and kernel + SCALE_SUFFIX in flat:
      read = hf_weights.slice_reader(files[tensor.name], tensor, np.float32)
      callback = _quantized_reader(read, kind=kind, in_features=shapes[kernel][0],
                                   part="kernel_scale" if name != kernel else "kernel",
                                   rows=abstract.shape[0])
    else:
      callback = hf_weights.slice_reader(files[tensor.name], tensor,
                                         hf_weights.NP_DTYPES[str(np.dtype(abstract.dtype))])
    return jax.make_array_from_callback(abstract.shape, sharding, callback)

  return jax.tree_util.tree_map_with_path(place, abstract_frozen, shardings)


def _bits(x: jax.Array) -> jax.Array:
  """Each element's bits as uint32."""
  width = jnp.dtype(x.dtype).itemsize * 8
  if width == 32 and x.dtype != jnp.uint32:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[width]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _sums(leaves: list[jax.Array]) -> jax.Array:
  """`[N, 3]` uint32: three modular sums of each tensor's element bits."""
  rows = []
  for x in leaves:
    u = _bits(x)
    mixed = (u * jnp.uint32(0x9E3779B1)) ^ (u >> 15)
    rows.append(jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * u, dtype=jnp.uint32),
                           jnp.sum(mixed * mixed, dtype=jnp.uint32)]))
  return jnp.stack(rows)


def fingerprint(frozen: Any) -> str:
  """A digest of the frozen parameters' values, paths, shapes and dtypes (module docstring)."""
  pairs = jax.tree_util.tree_leaves_with_path(frozen)
  sums = np.asarray(jax.device_get(_sums([x for _, x in pairs])))
  digest = hashlib.sha256()
  for (path, x), row in zip(pairs, sums):
    digest.update(f"{sharding_lib.param_name(path)}:{tuple(x.shape)}:{x.dtype}:".encode())
    digest.update(row.astype("<u4").tobytes())
  return "base-" + digest.hexdigest()[:16]


def is_adapted(model_cfg: Any) -> bool:
  """Whether a config's `model` group trains adapters (`model.lora.rank` > 0)."""
  return bool(model_cfg.lora.rank)

