"""LoRA on the decoder's projections: the adapted layer and its forward pass on packed rows.

A projection named in `model.lora.targets` becomes an `AdaptedLinear`: `nnx.Linear` (its frozen
`kernel`, and `bias`) plus Flax's own `nnx.LoRA` parameters (`lora_a` `[I, r]`, `lora_b`
`[r, O]`, of the variable type `nnx.LoRAParam`, which is how the trainer tells the trained
parameters from the frozen ones: `split`). With a quantized base (`model.lora.base_dtype` "nf4"
or "int8", `train.model.quantize`) every projection holds its kernel as codes (`kernel`) and
per-block scales (`kernel_scale`) instead, dequantized in the compute dtype for its matmul.

`dense` is `train.model.layout.dense` for these layers: the base matmul (on a mesh of explicit axes
the kernel gathered as `layout.dense` gathers it), plus `scale * (x @ A) @ B` with `A` split as
the input and `B` as the output, so a row split (o, down) sums its partial products as the base's
do. Flax's `LoRA.__call__` is not used because it has no scale and no mesh layout.

Example: rank 2, alpha 4 on `q` (`[E, H*D]`): `q(x) = x @ W + 2.0 * (x @ A) @ B`; with `B = 0`
(a fresh adapter) the layer computes exactly the base model's `x @ W`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from configs.architecture import LORA_TARGETS, Lora
from train.model import layout as layout_lib
from train.model import quantize as quantize_lib

# `[key, calls so far]` while a training step is traced (`dropout_key`), else None
_DROPOUT: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "lora_dropout", default=None)
ADAPTER_DTYPE = jnp.float32  # adapters and their optimizer state (PEFT's default too)
CODE_DTYPES = {"nf4": jnp.uint8, "int8": jnp.int8}  # the codes' storage (`quantize.quantize`)
_FLOAT_BASES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def quantized(lora: Lora) -> str | None:
  """The quantization of the frozen projections ("nf4", "int8"), or None."""
  return lora.base_dtype if lora.rank and lora.base_dtype in CODE_DTYPES else None


def frozen_dtype(lora: Lora, param_dtype: Any) -> Any:
  """The storage dtype of the frozen weights that are not quantized: `param_dtype` without
  adapters or with base_dtype "param", the named float, and bfloat16 beside a quantized base
  (QLoRA keeps embeddings, norms and the head in 16 bits)."""
  if not lora.rank or lora.base_dtype == "param":
    return param_dtype
  return _FLOAT_BASES.get(lora.base_dtype, jnp.bfloat16)


class AdaptedLinear(nnx.Linear):
  """A frozen projection with a LoRA adapter (`lora`, or None: frozen only), perhaps quantized.

  Attributes:
    lora: `nnx.LoRA` holding `lora_a` `[I, r]` and `lora_b` `[r, O]` (`nnx.LoRAParam`), or None.
    lora_scale: alpha / rank.
    lora_dropout: the dropout rate on the adapter's input while training (`dropout_key`).
    quant: "nf4", "int8" or None; when set, `kernel` holds the codes and `kernel_scale` the
      block scales (`quantize.quantized_shapes`).
  """

  def __init__(self, d_in: int, d_out: int, *, adapter: bool, lora: Lora, use_bias: bool,
               dtype: Any, param_dtype: Any, kernel_init: Any, rngs: nnx.Rngs):
    super().__init__(d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                     kernel_init=kernel_init, rngs=rngs)
    self.quant = quantized(lora)
    if self.quant:
      shapes = quantize_lib.quantized_shapes(kind=self.quant, shape_IxO=(d_in, d_out))
      self.kernel = nnx.Param(jnp.zeros(shapes["kernel"], CODE_DTYPES[self.quant]))
      self.kernel_scale = nnx.Param(jnp.zeros(shapes["kernel_scale"], jnp.float32))
    self.lora = (nnx.LoRA(d_in, lora.rank, d_out, dtype=dtype, param_dtype=ADAPTER_DTYPE,
                          rngs=rngs) if adapter else None)
    self.lora_scale = lora.scale
    self.lora_dropout = float(lora.dropout)

  def __call__(self, x_BxSxI: jax.Array) -> jax.Array:
    """`dense` of this layer (what `nnx.Linear.__call__` would compute, with the adapter)."""
    return dense(self, x_BxSxI, layout_lib.layout_of(x_BxSxI))


def linear(d_in: int, d_out: int, *, name: str, lora: Lora, bias: bool, dtype: Any,
           param_dtype: Any, std: float, rngs: nnx.Rngs) -> nnx.Linear:
  """The projection `name` (q, k, v, o, gate, up, down; or lm_head, never adapted nor
  quantized) of the decoder: `nnx.Linear` without adapters, else an `AdaptedLinear` (an
  adapter when `name` is a target; frozen weights stored as `frozen_dtype` says, or
  quantized)."""
  init = nnx.initializers.normal(std)
  if not lora.rank or name not in LORA_TARGETS:  # the output head is never quantized
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype,
                      param_dtype=frozen_dtype(lora, param_dtype), kernel_init=init, rngs=rngs)
  return AdaptedLinear(d_in, d_out, adapter=name in lora.target_names, lora=lora, use_bias=bias,
                       dtype=dtype, param_dtype=frozen_dtype(lora, param_dtype),
                       kernel_init=init, rngs=rngs)


def base_kernel(linear: AdaptedLinear, layout: layout_lib.Layout | None, *,
                split_in: str | None, split_out: str | None) -> jax.Array:
  """The frozen kernel `[I, O]`: a float one as stored, a quantized one dequantized (its codes
  and scales first gathered as `layout.dense` gathers a kernel)."""
  if not linear.quant:
    return linear.kernel[...]
  codes, scales = linear.kernel[...], linear.kernel_scale[...]
  if layout is not None:  # scales have I/64 rows: split with the codes only where they divide
    codes = layout.put(codes, split_in and layout.split(codes.shape[0]), split_out)
    scales = layout.put(scales, split_in and layout.split(scales.shape[0]), split_out)
  return quantize_lib.dequantize(kind=linear.quant, codes=codes, scales=scales,
                                 dtype=linear.dtype or jnp.float32)


@contextlib.contextmanager
def dropout_key(key: jax.Array) -> Iterator[None]:
  """While a step is traced inside, every adapter with `model.lora.dropout` > 0 drops its input
  with a key folded from `key` and the adapter's call order in the trace (the trainer's step
  passes one key per step and micro-batch; evaluation, scoring and sampling pass none)."""
  token = _DROPOUT.set([key, 0])
  try:
    yield
  finally:
    _DROPOUT.reset(token)


def _dropped(x_BxSxI: jax.Array, rate: float, layout: layout_lib.Layout | None,
             split_in: str | None) -> jax.Array:
  """Inverted dropout of an adapter's input at `rate` inside `dropout_key`, else `x`."""
  state = _DROPOUT.get()
  if state is None or not rate:
    return x_BxSxI
  key = jax.random.fold_in(state[0], state[1])
  state[1] += 1
  sharding = None if layout is None else layout.activations(split_in)
  keep = jax.random.bernoulli(key, 1.0 - rate, x_BxSxI.shape, out_sharding=sharding)
  return jnp.where(keep, x_BxSxI / (1.0 - rate), jnp.zeros_like(x_BxSxI))


def adapter_delta(linear: AdaptedLinear, x_BxSxI: jax.Array, layout: layout_lib.Layout | None,
                  *, split_in: str | None, split_out: str | None) -> jax.Array:
  """`scale * (dropout(x) @ A) @ B` in the compute dtype, on a mesh laid out as the base's
  output."""
  x_BxSxI = _dropped(x_BxSxI, linear.lora_dropout, layout, split_in)
  x_BxSxI, a_IxR, b_RxO = linear.lora.promote_dtype(
      (x_BxSxI, linear.lora.lora_a[...], linear.lora.lora_b[...]), dtype=linear.dtype)
  contract = (((x_BxSxI.ndim - 1,), (0,)), ((), ()))
  if layout is None:
    h_BxSxR = jax.lax.dot_general(x_BxSxI, a_IxR, contract)
    return jax.lax.dot_general(h_BxSxR, b_RxO, contract) * linear.lora_scale
  a_IxR = layout.put(a_IxR, split_in, None)
  b_RxO = layout.put(b_RxO, None, split_out)
  h_BxSxR = jax.lax.dot_general(x_BxSxI, a_IxR, contract, out_sharding=layout.activations(None))
  y_BxSxO = jax.lax.dot_general(h_BxSxR, b_RxO, contract,
                                out_sharding=layout.activations(split_out))
  return y_BxSxO * linear.lora_scale


def dense(linear: nnx.Linear, x_BxSxI: jax.Array, layout: layout_lib.Layout | None, *,
          split_in: str | None = None, split_out: str | None = None) -> jax.Array:
  """`train.model.layout.dense` of a decoder projection, adapted or not (module docstring)."""
  if not isinstance(linear, AdaptedLinear):
    return layout_lib.dense(linear, x_BxSxI, layout, split_in=split_in, split_out=split_out)
  kernel = base_kernel(linear, layout, split_in=split_in, split_out=split_out)
  y_BxSxO = layout_lib.dense(linear, x_BxSxI, layout, split_in=split_in, split_out=split_out,
                             kernel_IxO=kernel)
  if linear.lora is None:
    return y_BxSxO
  return y_BxSxO + adapter_delta(linear, x_BxSxI, layout, split_in=split_in,
                                 split_out=split_out).astype(y_BxSxO.dtype)


def split(model: nnx.Module, *, adapters: bool) -> tuple[Any, Any, Any]:
  """`(graphdef, trained, frozen)`: with adapters the `nnx.LoRAParam`s and every other
  parameter; without, every parameter and None (`merge` undoes either)."""
  if not adapters:
    graphdef, params = nnx.split(model)
    return graphdef, params, None
  return nnx.split(model, nnx.LoRAParam, ...)


def merge(graphdef: Any, trained: Any, frozen: Any | None) -> nnx.Module:
  """The model of `split`'s parts."""
  if frozen is None:
    return nnx.merge(graphdef, trained)
  return nnx.merge(graphdef, trained, frozen)


def model_of(graphdef: Any, params: Any, frozen: Any | None = None) -> nnx.Module:
  """The model of a step's `params` and `frozen` base (None: `params` is every parameter), or
  of `params` = `(trained, frozen)` under adapters."""
  if isinstance(params, tuple):
    params, frozen = params
  return merge(graphdef, params, frozen)
