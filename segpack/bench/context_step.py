"""Context-parallel step times: forward + backward of `segment_attention` for every slot order.

`time_orders` reorders packed rows with `segpack.data.context_order.context_order` and `reorder` for
each balance (`"none"`, `"zigzag"`, `"documents"`), puts q, k, v, the output cotangent, the
segment ids and the slot index on a mesh with `NamedSharding` over `P(None, context, ...)`, and
times one jitted forward + backward (`jax.vjp`) of `segment_attention(..., mesh=mesh,
context_axis=context)`: the median over `repeats` calls after `warmup` calls, each call waited
for with `jax.block_until_ready`. The ratio to the contiguous order (`"none"`) is what balancing
buys. Every order gets the same inputs (natural order, one seed) and the same compiled program.

It measures only on a GPU with at least `cp` devices (`skip_reason` says why not);
`platform_check=False` runs it anywhere (tests on CPU devices; the times then mean nothing).
Used by `segpack bench attention --context` (the step-time column) and
`segpack bench gpu-report` (its context-parallel section).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from segpack.attention import segment_attention
from segpack.data import context_order as order_lib
from segpack.errors import ArgumentError
from segpack.mesh import CONTEXT_AXIS

NOT_MEASURED = "not yet measured"

__all__ = ["NOT_MEASURED", "context_mesh", "random_inputs", "skip_reason", "time_orders"]


def skip_reason(context_size: int) -> str | None:
  """Why step times over `context_size` devices cannot be measured here (None: they can)."""
  backend = jax.default_backend()
  if backend != "gpu":
    return f"needs a GPU, jax.default_backend() is {backend!r}"
  if context_size < 2:
    return f"needs more than one GPU, context size {context_size}"
  if jax.device_count() < context_size:
    return f"needs {context_size} GPUs, {jax.device_count()} present"
  return None


def context_mesh(context_size: int, *, context_axis: str = CONTEXT_AXIS,
                 devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A one-axis mesh over the first `context_size` of `devices` (default `jax.devices()`).

  Raises:
    ValueError: fewer than `context_size` devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if context_size < 1 or len(devices) < context_size:
    raise ArgumentError(f"context_mesh: context_size={context_size} needs that many devices, "
                     f"{len(devices)} given")
  return Mesh(np.asarray(devices[:context_size]), (context_axis,),
              axis_types=(jax.sharding.AxisType.Auto,))


def random_inputs(*, segment_ids_BxS: np.ndarray, heads: int, kv_heads: int, head_dim: int,
                  dtype: Any, seed: int) -> dict[str, np.ndarray]:
  """Natural-order `q`, `k`, `v` and output cotangent `dout` (standard normal, in `dtype`)."""
  b, s = np.shape(segment_ids_BxS)
  rng = np.random.default_rng(seed)
  shapes = dict(q=(b, s, heads, head_dim), k=(b, s, kv_heads, head_dim),
                v=(b, s, kv_heads, head_dim), dout=(b, s, heads, head_dim))
  return {name: rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype))
          for name, shape in shapes.items()}


def _program(mesh: Mesh, context_axis: str, implementation: str):
  """The jitted forward + backward: `(out, dq, dk, dv)`."""

  def step(q, k, v, dout, seg, slot):
    fn = lambda q, k, v: segment_attention(
        q, k, v, seg, slot_index=slot, causal=True, implementation=implementation, mesh=mesh,
        batch_axis=None, head_axis=None, context_axis=context_axis)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(dout))

  return jax.jit(step)


def _median_ms(fn, args: tuple, *, warmup: int, repeats: int) -> tuple[float, Any]:
  result = None
  for _ in range(warmup):
    result = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times)), result


def time_orders(*, mesh: Mesh, segment_ids_BxS: np.ndarray, heads: int, kv_heads: int,
                head_dim: int, dtype: Any = jnp.bfloat16, implementation: str = "pallas",
                context_axis: str = CONTEXT_AXIS,
                balances: Sequence[str] = order_lib.CONTEXT_BALANCES, warmup: int = 2,
                repeats: int = 5, seed: int = 0, platform_check: bool = True,
                keep_outputs: bool = False) -> list[dict[str, Any]]:
  """Median forward + backward time of context-parallel attention for every slot order.

  Args:
    mesh: a mesh with `context_axis` (its size is cp); every other axis replicates.
    segment_ids_BxS: packed rows in natural order (ids from 1, 0 = padding); S divisible by 2 cp.
    heads: H, query heads.
    kv_heads: K, key/value heads (H a multiple of K).
    head_dim: D.
    dtype: of q, k, v.
    implementation: `"pallas"` or `"xla"`.
    context_axis: the mesh axis splitting the sequence.
    balances: the orders, `"none"` first (the ratios are to it).
    warmup: calls before timing (the first compiles).
    repeats: timed calls; the median is reported.
    seed: of `random_inputs`.
    platform_check: refuse to run where `skip_reason` gives a reason (False: run anyway).
    keep_outputs: add `"outputs"`: `(out, dq, dk, dv)` of the last call as NumPy arrays, put
      back in natural order.

  Returns:
    One record per balance: `balance`, `step_ms` (median), `ratio_to_none`, `max_over_mean`
    (the busiest device's attention cost over the mean, `device_costs`, summed over the rows),
    and the sizes.

  Raises:
    ValueError: `platform_check` and no GPU with cp devices; `balances` not starting with
      `"none"`; `repeats` or `warmup` out of range.
  """
  cp = int(mesh.shape[context_axis])
  reason = skip_reason(cp) if platform_check else None
  if reason:
    raise ArgumentError(f"time_orders: context-parallel step times {reason}")
  if not balances or balances[0] != "none" or repeats < 1 or warmup < 1:
    raise ArgumentError(f"time_orders: balances must start with 'none' and repeats, warmup be "
                     f">= 1; got balances={tuple(balances)!r}, repeats={repeats}, "
                     f"warmup={warmup}")
  seg = np.asarray(segment_ids_BxS, np.int32)
  b, s = seg.shape
  natural = random_inputs(segment_ids_BxS=seg, heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, dtype=dtype, seed=seed)
  heads_sh = NamedSharding(mesh, P(None, context_axis, None, None))
  rows_sh = NamedSharding(mesh, P(None, context_axis))
  step = _program(mesh, context_axis, implementation)
  records: list[dict[str, Any]] = []
  for balance in balances:
    index = order_lib.context_order(segment_ids_BxS=seg, context_size=cp, balance=balance)
    batch = order_lib.reorder(dict(natural, segment_ids=seg), slot_index_BxS=index)
    args = tuple(jax.device_put(batch[name], heads_sh if name in natural else rows_sh)
                 for name in ("q", "k", "v", "dout", "segment_ids", order_lib.SLOT_INDEX))
    ms, result = _median_ms(step, args, warmup=warmup, repeats=repeats)
    costs_P = order_lib.device_costs(segment_ids_BxS=seg, slot_index_BxS=index,
                                     context_size=cp).sum(axis=0).astype(np.float64)
    rec: dict[str, Any] = dict(
        balance=balance, step_ms=ms, ratio_to_none=ms / records[0]["step_ms"] if records else 1.0,
        max_over_mean=float(costs_P.max() / max(costs_P.mean(), 1.0)), seq_len=s, rows=b,
        context_size=cp, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        dtype=jnp.dtype(dtype).name, implementation=implementation, warmup=warmup,
        repeats=repeats, platform=jax.default_backend())
    if keep_outputs:
      inverse = np.argsort(index, axis=1)
      rec["outputs"] = tuple(
          np.take_along_axis(np.asarray(x), inverse.reshape((b, s, 1, 1)), axis=1)
          for x in result)
    records.append(rec)
  return records
