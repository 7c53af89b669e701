"""Model FLOPs of a training step on packed rows, and the peak FLOP/s that MFU divides by.

Only useful work counts: real tokens (not padding) and attention within each document (not the
dense `S x S` square of the row, not the masked half of a causal one). Per training step:

  flops = 6 * N * real_tokens + 12 * L * H * D * sum over documents of l * (l + 1) / 2

- `N`: the parameters of the matmuls, output projection included (not the embedding lookup, not
  the norms); a matmul of `N` parameters costs `2 * N` FLOPs per token forward and `4 * N`
  backward.
- Attention of one document of length `l`, per layer and query head, forward: `QK^T` and `PV`
  over the `l * (l + 1) / 2` (query, key) pairs of the causal triangle, `2 * D` FLOPs each, so
  `2 * 2 * D * l * (l + 1) / 2`; training (backward twice the forward) three times that.

Example: one row holding documents of lengths 3 and 5, then padding, in a model of `N` matmul
parameters with L = 1, H = 2, D = 4: 8 real tokens and 6 + 15 = 21 pairs, so
`6 * N * 8 + 12 * 1 * 2 * 4 * 21` FLOPs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from segpack import mesh as mesh_lib
from segpack.data import attention_cost
from segpack.errors import ArgumentError

# Dense (no sparsity) bfloat16 tensor-core peak per device, by substring of `device_kind`; the
# first match wins. NVL parts run at lower clocks: unknown here, so no MFU (set train.peak_flops).
BF16_PEAK_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("NVL", None),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),  # same tensor cores and clocks as the H100 SXM
    ("A100", 312e12),
)


@dataclasses.dataclass(frozen=True)
class FlopModel:
  """The two coefficients of a step's model FLOPs.

  Attributes:
    matmul_params: N, the matmul parameters (output projection included, embedding excluded).
    attention_width: L * H * D.
  """

  matmul_params: int
  attention_width: int

  @classmethod
  def from_model_config(cls, model_cfg: Any, *, vocab_size: int) -> "FlopModel":
    """From a trainer config's `model` group (`configs/packed.py`) and the vocabulary size."""
    e, hd = model_cfg.d_model, model_cfg.num_heads * model_cfg.head_dim
    kd = model_cfg.num_kv_heads * model_cfg.head_dim
    per_layer = e * hd + 2 * e * kd + hd * e + 3 * e * model_cfg.d_ff
    return cls(matmul_params=model_cfg.num_layers * per_layer + e * vocab_size,
               attention_width=model_cfg.num_layers * hd)

  def step_flops(self, *, real_tokens: float, attention_pairs: float) -> float:
    """Training FLOPs (forward and backward) of `real_tokens` with `attention_pairs` pairs."""
    return 6.0 * self.matmul_params * real_tokens + 12.0 * self.attention_width * attention_pairs


def attention_pairs(segment_ids_BxS: jax.Array, *, reordered: bool = False) -> jax.Array:
  """Causal (query, key) pairs within documents: the sum of `l * (l + 1) / 2` over all segments,
  the rows' `segpack.data.attention_cost.query_costs` summed.

  Args:
    segment_ids_BxS: segment ids, 0 = padding (jittable); each non-zero id one contiguous run,
      unless `reordered`.
    reordered: the row's slots are in context-parallel order (`train.context_batches`), so a segment
      may be cut into pieces (`query_costs` then sorts the ids of each row first).

  Returns:
    A float32 scalar (exact per row in int32, rows summed in float32).
  """
  segment_ids_BxS = mesh_lib.whole_slots(jnp.asarray(segment_ids_BxS))  # scans along the slots
  keys_BxS = attention_cost.query_costs(segment_ids_BxS, contiguous=not reordered)
  per_row_B = jnp.sum(keys_BxS, axis=1, dtype=jnp.int32)
  return jnp.sum(per_row_B.astype(jnp.float32))


def device_peak_flops(device_kind: str, *, compute_dtype: str) -> float | None:
  """The bfloat16 dense peak of a known GPU; None for anything else or a float32 model."""
  if compute_dtype not in ("bfloat16", "float16"):
    return None
  for pattern, peak in BF16_PEAK_FLOPS:
    if pattern in device_kind:
      return peak
  return None


def peak_flops(override: float | None, *, devices: Sequence[Any],
               compute_dtype: str) -> float | None:
  """Peak FLOP/s of all `devices` together: `override` per device, else from the device kind.

  Args:
    override: the config's `train.peak_flops` (per device), or None.
    devices: the devices the step runs on (`jax.devices()`).
    compute_dtype: the model's compute dtype.

  Returns:
    The total peak, or None when unknown (MFU is then not reported).
  """
  if override is not None:
    if not override > 0:
      raise ArgumentError(f"train.peak_flops must be positive FLOP/s per device, got {override!r}")
    return float(override) * len(devices)
  peaks = [device_peak_flops(d.device_kind, compute_dtype=compute_dtype) for d in devices]
  if not peaks or any(p is None for p in peaks):
    return None
  return float(sum(peaks))
