"""The Pallas backend: a flash-attention kernel that visits only its segments' blocks.

`segment_attention_pallas` pads, computes the block ranges (`blocks.py`) and calls a `custom_vjp`
whose forward and backward are Pallas kernels (`pallas_fwd.py`, `pallas_bwd.py`), lowered through
Triton on a GPU or run with `interpret=True` on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from segpack.attention import blocks
from segpack.attention import pallas_bwd
from segpack.attention import pallas_fwd
from segpack.attention.checks import AttentionInputError

MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static settings of one kernel call (hashable: a `custom_vjp` non-differentiable argument).

  Attributes:
    causal: hide keys after the query.
    scale: logit scale.
    block_q: forward query block.
    block_k: forward key/value block.
    block_q_bwd: backward (dQ and dK/dV kernels) query block.
    block_k_bwd: backward key/value block.
    interpret: run in interpret mode.
    skip_blocks: visit only the key blocks of the query block's segments (False visits every
      block, or every block at or below the diagonal when causal: the dense-mask kernel of the same
      family, for benchmarks).
    num_warps: Triton warps per program.
    num_stages: Triton pipeline stages.
  """

  causal: bool
  scale: float
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  interpret: bool = False
  skip_blocks: bool = True
  num_warps: int = 4
  num_stages: int = 2


def _check_block(name: str, block: int) -> None:
  if block < 16 or block & (block - 1):
    raise AttentionInputError(
        f"segment_attention(implementation='pallas'): `{name}` must be a power of two >= 16, "
        f"got {block!r}")


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def dense_ranges(segment_ids_BxS: jax.Array, cfg: KernelConfig, *, per_q: bool) -> jax.Array:
  """Ranges of a kernel that ignores segments when choosing blocks (dense mask, same family).

  Every block pair is visited (at or below the diagonal when causal), all with the element-wise
  mask.
  """
  b, s = segment_ids_BxS.shape
  if per_q:
    n, other = s // cfg.block_q, s // cfg.block_k
    idx = jnp.arange(n, dtype=jnp.int32)
    lo = jnp.zeros_like(idx)
    hi = ((idx + 1) * cfg.block_q + cfg.block_k - 1) // cfg.block_k if cfg.causal else lo + other
  else:
    n, other = s // cfg.block_k, s // cfg.block_q
    idx = jnp.arange(n, dtype=jnp.int32)
    hi = jnp.full_like(idx, other)
    lo = idx * cfg.block_k // cfg.block_q if cfg.causal else jnp.zeros_like(idx)
  r_Nx4 = jnp.stack([lo, hi, hi, hi], axis=-1)
  return jnp.broadcast_to(r_Nx4, (b, n, 4)).astype(jnp.int32)


def _ranges(segment_ids_BxS: jax.Array, cfg: KernelConfig, *, per_q: bool) -> jax.Array:
  """Per query block (`per_q`) or per key block ranges for the blocks of `cfg`."""
  if not cfg.skip_blocks:
    return dense_ranges(segment_ids_BxS, cfg, per_q=per_q)
  fn = blocks.q_block_ranges if per_q else blocks.kv_block_ranges
  return fn(segment_ids_BxS, block_q=cfg.block_q, block_k=cfg.block_k, causal=cfg.causal)


def _backward_config(cfg: KernelConfig) -> KernelConfig:
  return dataclasses.replace(cfg, block_q=cfg.block_q_bwd, block_k=cfg.block_k_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, cfg: KernelConfig):
  out_BxSxHxD, _ = _flash_fwd(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, cfg)
  return out_BxSxHxD


def _flash_fwd(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, cfg: KernelConfig):
  q_ranges_BxNx4 = _ranges(segment_ids_BxS, cfg, per_q=True)
  out_BxSxHxD, lse_BxHxS = pallas_fwd.forward(
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, q_ranges_BxNx4, cfg=cfg)
  residuals = (q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, out_BxSxHxD, lse_BxHxS)
  return out_BxSxHxD, residuals


def _flash_bwd(cfg: KernelConfig, residuals, dout_BxSxHxD):
  q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, out_BxSxHxD, lse_BxHxS = residuals
  cfg = _backward_config(cfg)
  q_ranges_BxNx4 = _ranges(segment_ids_BxS, cfg, per_q=True)
  kv_ranges_BxNx4 = _ranges(segment_ids_BxS, cfg, per_q=False)
  delta_BxHxS = pallas_bwd.backward_delta(out_BxSxHxD, dout_BxSxHxD, cfg=cfg)
  dq_BxSxHxD = pallas_bwd.backward_dq(
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, q_ranges_BxNx4, dout_BxSxHxD, lse_BxHxS,
      delta_BxHxS, cfg=cfg)
  dk_BxSxKxD, dv_BxSxKxD = pallas_bwd.backward_dkv(
      q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, kv_ranges_BxNx4, dout_BxSxHxD,
      lse_BxHxS, delta_BxHxS, cfg=cfg)
  return dq_BxSxHxD, dk_BxSxKxD, dv_BxSxKxD, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def segment_attention_pallas(
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
    block_q: int = 128,
    block_k: int = 128,
    block_q_bwd: int | None = None,
    block_k_bwd: int | None = None,
    interpret: bool = False,
    skip_blocks: bool = True,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
  """Segment flash attention (forward and backward in Pallas), with native grouped-query heads.

  Padding: S is padded to a multiple of the largest block with padding slots (segment 0); blocks
  larger than the next power of two of S are shrunk to it. A head dim that is not a power of
  two (>= 16) is zero-padded to the next one, which leaves the logits unchanged; head dims above
  256 are refused.

  Args:
    q_BxSxHxD: queries.
    k_BxSxKxD: keys.
    v_BxSxKxD: values.
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    causal: hide keys after the query.
    scale: logit scale.
    block_q: query block, a power of two >= 16.
    block_k: key/value block, a power of two >= 16.
    block_q_bwd: query block of the backward kernels (default `min(block_q, 64)`).
    block_k_bwd: key/value block of the backward kernels (default `min(block_k, 64)`).
    interpret: run the kernels in interpret mode (CPU).
    skip_blocks: False gives the dense-mask kernel of the same family (benchmark baseline).
    num_warps: Triton warps (default 4 for D <= 64, else 8).
    num_stages: Triton pipeline stages.

  Returns:
    `out_BxSxHxD`.
  """
  block_q_bwd = min(block_q, 64) if block_q_bwd is None else block_q_bwd
  block_k_bwd = min(block_k, 64) if block_k_bwd is None else block_k_bwd
  for name, block in (("block_q", block_q), ("block_k", block_k), ("block_q_bwd", block_q_bwd),
                      ("block_k_bwd", block_k_bwd)):
    _check_block(name, block)
  b, s, h, d = q_BxSxHxD.shape
  if d > MAX_HEAD_DIM:
    raise AttentionInputError(
        f"segment_attention(implementation='pallas'): head dim D={d} is above {MAX_HEAD_DIM}")
  cap = max(16, _next_pow2(s))
  block_q, block_k, block_q_bwd, block_k_bwd = (
      min(x, cap) for x in (block_q, block_k, block_q_bwd, block_k_bwd))
  multiple = max(block_q, block_k, block_q_bwd, block_k_bwd)
  s_pad = -(-s // multiple) * multiple
  d_pad = max(16, _next_pow2(d))
  pad4 = ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d))
  q_p, k_p, v_p = (jnp.pad(x, pad4) for x in (q_BxSxHxD, k_BxSxKxD, v_BxSxKxD))
  seg_p = jnp.pad(segment_ids_BxS.astype(jnp.int32), ((0, 0), (0, s_pad - s)))
  cfg = KernelConfig(
      causal=causal, scale=scale, block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd,
      block_k_bwd=block_k_bwd, interpret=interpret,
      skip_blocks=skip_blocks, num_warps=num_warps or (4 if d_pad <= 64 else 8),
      num_stages=num_stages)
  out = _flash(q_p, k_p, v_p, seg_p, cfg)
  return out[:, :s, :, :d]
