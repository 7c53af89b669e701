"""The frozen base of QLoRA: kernels quantized blockwise to 4-bit NormalFloat ("nf4") or "int8".

A kernel `w_IxO` (Flax orientation: in features, out features) is cut along I into blocks of
`BLOCK` = 64 rows; each (block, column) has one float32 scale, the block's largest `|w|` (its
absmax), and every element is stored as a code relative to it:

- "nf4" (QLoRA, Dettmers et al. 2023): the index of the `NF4_CODE` value nearest `w / absmax`,
  two codes per byte, packed along I: byte `[i, o]` holds the code of row `2i` in its low nibble
  and that of row `2i + 1` in its high nibble. Codes `uint8 [I/2, O]`.
- "int8": `round(w / absmax * 127)`, symmetric. Codes `int8 [I, O]`.

Scales are `float32 [I/64, O]` for both. A block that is all zero gets scale 0 and decodes to 0.

`quantize` runs on the host (NumPy) while a checkpoint is imported, one tensor (or one device's
rows of it, `source_rows`) at a time; `dequantize` runs inside the jitted step (jnp), also on
arrays typed with a mesh of explicit axes, and gives the kernel laid out as its codes are.

Example: a `[4096, 4096]` kernel in nf4 is 8 MiB of codes and 1 MiB of scales, 28% of its 32 MiB
in bfloat16; `dequantize(kind="nf4", codes=c, scales=s, dtype=jnp.bfloat16)` is `[4096, 4096]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from segpack.errors import UserError
from segpack.mesh import explicit_mesh_of

__all__ = ["BLOCK", "KINDS", "NF4_CODE", "QuantizeError", "check_quantizable", "dequantize",
           "quantize", "quantized_shapes", "source_rows"]

KINDS = ("nf4", "int8")
BLOCK = 64  # rows of I per scale
PARTS = ("kernel", "kernel_scale")  # a quantized projection's two parameters: codes, scales
# The 16 NormalFloat4 values: the QLoRA paper's appendix (Dettmers et al. 2023, "QLoRA: Efficient
# Finetuning of Quantized LLMs"), as bitsandbytes writes them (functional.py, `get_4bit_type`).
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
# Halfway between adjacent NF4 values: a normalized weight's code is how many lie below it.
_NF4_MIDPOINTS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)
_INT8_MAX = 127


class QuantizeError(UserError, ValueError):
  """A kernel that cannot be quantized (its shape), or an unknown quantized kind."""


def _check_kind(kind: str) -> None:
  """Refuses a kind other than `KINDS`, naming the config key that chose it."""
  if kind not in KINDS:
    raise QuantizeError(f"model.lora.base_dtype={kind!r} is not a quantized kind; "
                        f"the choices are {list(KINDS)}")


def check_quantizable(*, kind: str, shape_IxO: tuple[int, ...], name: str) -> None:
  """Refuses a kernel whose in features do not fill whole blocks, or an unknown kind.

  Args:
    kind: one of `KINDS` (`model.lora.base_dtype`).
    shape_IxO: the kernel's shape `[I, O]`.
    name: the parameter's name, for the message (`layers/0/attn/q/kernel`).

  Raises:
    QuantizeError: in one line, naming `name`, its shape and the rule, or the kind and choices.
  """
  _check_shape(kind, shape_IxO, f"parameter {name}")


def _check_shape(kind: str, shape_IxO: tuple[int, ...], subject: str) -> None:
  """`check_quantizable`, the message naming `subject` ("parameter NAME", "w_IxO")."""
  _check_kind(kind)
  shape = tuple(int(d) for d in shape_IxO)
  if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0 or shape[0] % BLOCK:
    raise QuantizeError(
        f"model.lora.base_dtype={kind!r}: {subject} has shape {shape}; a quantized kernel is "
        f"[I, O] with I (in features) a positive multiple of {BLOCK}")


def quantized_shapes(*, kind: str, shape_IxO: tuple[int, int]) -> dict[str, tuple[int, int]]:
  """The shapes of a quantized kernel's codes (`kernel`) and scales (`kernel_scale`).

  Args:
    kind: "nf4" (codes `uint8 [I/2, O]`) or "int8" (codes `int8 [I, O]`).
    shape_IxO: the float kernel's shape `[I, O]`, I a multiple of `BLOCK`.

  Returns:
    `{"kernel": codes shape, "kernel_scale": (I / 64, O)}`.

  Raises:
    QuantizeError: an unknown kind or a shape `check_quantizable` refuses.
  """
  _check_shape(kind, shape_IxO, "shape_IxO")
  d_in, d_out = (int(d) for d in shape_IxO)
  rows = d_in // 2 if kind == "nf4" else d_in
  return {"kernel": (rows, d_out), "kernel_scale": (d_in // BLOCK, d_out)}


def quantize(*, kind: str, w_IxO: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Quantizes a kernel on the host, blockwise along I (float32 math).

  Memory: a float32 copy of `w_IxO`, its int64 code indices and the codes, about four times the
  float32 tensor at the peak; quantize a device's rows at a time (`source_rows`) to bound it.

  Args:
    kind: "nf4" or "int8".
    w_IxO: the kernel `[I, O]`, float32, float16 or bfloat16 (ml_dtypes), I a multiple of 64.

  Returns:
    `(codes, scales_BxO)`: codes as `quantized_shapes` says (nf4 `uint8 [I/2, O]`, the nearest
    NF4 value of each `w / absmax`, a tie going to the lower value; int8 `int8 [I, O]`), and the
    float32 absmax of each block of 64 rows and column, `[I/64, O]` (0 for an all-zero block).

  Raises:
    QuantizeError: an unknown kind or a shape that is not `[k * 64, O]`.
  """
  _check_shape(kind, w_IxO.shape, "w_IxO")
  d_in, d_out = w_IxO.shape
  x_BxKxO = np.array(w_IxO, dtype=np.float32).reshape(d_in // BLOCK, BLOCK, d_out)
  scales_BxO = np.abs(x_BxKxO).max(axis=1)
  x_BxKxO /= np.where(scales_BxO > 0, scales_BxO, np.float32(1))[:, None, :]
  x_IxO = x_BxKxO.reshape(d_in, d_out)
  if kind == "int8":
    return np.rint(x_IxO * np.float32(_INT8_MAX)).astype(np.int8), scales_BxO
  codes_IxO = np.searchsorted(_NF4_MIDPOINTS, x_IxO, side="left").astype(np.uint8)
  del x_BxKxO, x_IxO
  return codes_IxO[0::2] | (codes_IxO[1::2] << np.uint8(4)), scales_BxO


def _codes_to_rows(codes: jax.Array, kind: str) -> jax.Array:
  """The codes of every row `[I, O]`, int32 (nf4's bytes unpacked along I, low nibble first)."""
  codes = codes.astype(jnp.int32)
  if kind == "int8":
    return codes
  half, d_out = codes.shape
  low_HxO, high_HxO = codes & 15, (codes >> 4) & 15
  return jnp.stack([low_HxO, high_HxO], axis=1).reshape(2 * half, d_out)


def _nf4_values(codes_IxO: jax.Array) -> jax.Array:
  """`NF4_CODE[codes]`, float32; on a mesh of explicit axes laid out as the codes are (a table
  replicated on every device, looked up where each code lies)."""
  table = jnp.asarray(NF4_CODE)
  mesh = explicit_mesh_of(codes_IxO)
  if mesh is None:
    return table[codes_IxO]
  table = jax.sharding.reshard(table, NamedSharding(mesh, P()))
  return table.at[codes_IxO].get(out_sharding=jax.typeof(codes_IxO).sharding)


def dequantize(*, kind: str, codes: jax.Array, scales: jax.Array,
               dtype: jnp.dtype) -> jax.Array:
  """The kernel `[I, O]` that `codes` and `scales` store, in `dtype` (jit-traceable).

  On a mesh of explicit axes the result is laid out as the codes are (rows split as the codes'
  rows are); scales laid out as the codes (the same spec) need no communication, others are
  moved to that layout first.

  Args:
    kind: "nf4" or "int8".
    codes: nf4 `uint8 [I/2, O]` or int8 `int8 [I, O]` (`quantize`).
    scales: float32 `[I/64, O]`.
    dtype: the result's dtype (the products are formed in float32 and cast once).

  Returns:
    The dequantized kernel `w_IxO`.

  Raises:
    QuantizeError: an unknown kind, or scales whose shape does not match the codes'.
  """
  _check_kind(kind)
  codes_IxO = _codes_to_rows(codes, kind)
  d_in, d_out = codes_IxO.shape
  if tuple(scales.shape) != (d_in // BLOCK, d_out) or d_in % BLOCK:
    raise QuantizeError(f"{kind} codes of shape {tuple(codes.shape)} need scales of shape "
                        f"{(d_in // BLOCK, d_out)}, got {tuple(scales.shape)}")
  if kind == "nf4":
    values_IxO = _nf4_values(codes_IxO)
    scales_BxO = scales.astype(jnp.float32)
  else:
    values_IxO = codes_IxO.astype(jnp.float32)
    scales_BxO = scales.astype(jnp.float32) / _INT8_MAX
  scales_IxO = jnp.broadcast_to(scales_BxO[:, None, :], (d_in // BLOCK, BLOCK, d_out))
  scales_IxO = scales_IxO.reshape(d_in, d_out)
  if explicit_mesh_of(values_IxO) is not None:
    scales_IxO = jax.sharding.reshard(scales_IxO, jax.typeof(values_IxO).sharding)
  return (values_IxO * scales_IxO).astype(dtype)


def source_rows(*, kind: str, rows: slice, in_features: int, part: str) -> tuple[slice, slice]:
  """Which rows of the float kernel a device's rows of a quantized part need.

  An importer reads the returned rows of the original `[I, O]` tensor, quantizes them, and keeps
  the second slice of the quantized part: the device's rows, read in whole 64-row blocks.

  Args:
    kind: "nf4" or "int8".
    rows: a contiguous slice of the rows of `part` (`None` bounds allowed, step 1).
    in_features: I, the float kernel's rows (a multiple of 64).
    part: "kernel" (the codes) or "kernel_scale" (the scales).

  Returns:
    `(read, keep)`: `read` the rows of the original tensor, from a block's first row to a block's
    end; `keep` the rows of `part`, within the quantized result of `read`, that `rows` are.

  Example: nf4 codes rows 40:50 of I = 256 are original rows 80:100, read as 64:128; quantized,
  those are code rows 0:32, of which the device keeps 8:18.
  """
  _check_kind(kind)
  if part not in PARTS:
    raise ValueError(f"part must be one of {list(PARTS)}, got {part!r}")
  rows_per_part_row = {"kernel": 2 if kind == "nf4" else 1, "kernel_scale": BLOCK}[part]
  start, stop, step = rows.indices(in_features // rows_per_part_row)
  if step != 1:
    raise ValueError(f"rows must be a contiguous slice (step 1), got {rows}")
  stop = max(stop, start)
  first, end = start * rows_per_part_row, stop * rows_per_part_row
  read = slice(first // BLOCK * BLOCK, min(-(-end // BLOCK) * BLOCK, in_features))
  if end == first:
    read = slice(first // BLOCK * BLOCK, first // BLOCK * BLOCK)
  offset = read.start // rows_per_part_row
  return read, slice(start - offset, stop - offset)
