"""The Pallas backend: a flash-attention kernel that visits only its segments' blocks.

`segment_attention_pallas` chooses the kernel settings (`resources.py`), pads, computes the block
ranges (`blocks.py`) and calls a `custom_vjp` whose forward and backward are Pallas kernels
(`pallas_fwd.py`, `pallas_bwd.py`), lowered through Triton on a GPU or run in interpret mode on
the CPU. `PallasOptions` groups its settings for `segment_attention(..., pallas=...)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from segpack.attention import blocks
from segpack.attention import pallas_bwd
from segpack.attention import pallas_fwd
from segpack.attention import resources
from segpack.attention.checks import AttentionInputError
from segpack.attention.pallas_fwd import KernelConfig
from segpack.attention.resources import AUTO, Auto, KernelSettings

MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
  """The Pallas backend's settings: `segment_attention(..., implementation="pallas", pallas=...)`.

  "auto" settings come from the shared-memory model of `resources.py` (docs/attention.md, "Kernel
  settings from a resource model"); explicit ones that the model says do not fit are refused
  before compiling. Values are validated when the kernel is traced.

  Attributes:
    block_q: forward query block (a power of two >= 16) or "auto"; S is padded internally to a
      multiple of the largest block with padding slots.
    block_k: forward key/value block (a power of two >= 16) or "auto".
    block_q_bwd: query block of the backward kernels (delta, dQ, dK/dV), or "auto" (None means
      "auto").
    block_k_bwd: key/value block of the backward kernels, or "auto" (None means "auto").
    num_warps: Triton warps of every kernel, or "auto" (per kernel).
    num_stages: Triton pipeline stages of every kernel, or "auto" (per kernel).
    smem_bytes: shared memory per block of the target GPU; None: the local GPU's, or an H100's
      (232,448) when JAX has no GPU.
    interpret: run the kernels in Pallas interpret mode (the GPU kernels on the CPU, slowly).
  """

  block_q: int | Auto = AUTO
  block_k: int | Auto = AUTO
  block_q_bwd: int | Auto | None = AUTO
  block_k_bwd: int | Auto | None = AUTO
  num_warps: int | Auto = AUTO
  num_stages: int | Auto = AUTO
  smem_bytes: int | None = None
  interpret: bool = False


def _auto(name: str, value, minimum: int, *, pow2: bool):
  """`value` if a valid int; "auto" for "auto" or None; otherwise an `AttentionInputError`."""
  if value is None or value == AUTO:
    return AUTO
  ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
  if not ok or (pow2 and value & (value - 1)):
    what = "a power of two" if pow2 else "an integer"
    raise AttentionInputError(
        f"segment_attention(implementation='pallas'): `{name}` must be {what} >= {minimum}, "
        f"got {value!r} ('auto' picks one from the shared-memory model)")
  return value


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
  return dataclasses.replace(cfg, block_q=cfg.block_q_bwd, block_k=cfg.block_k_bwd,
                             num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)


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


def kernel_settings(
    *, dtype, head_dim: int, group: int, seq_len: int, smem_bytes: int | None = None,
    block_q: int | Auto | None = AUTO, block_k: int | Auto | None = AUTO,
    block_q_bwd: int | Auto | None = AUTO, block_k_bwd: int | Auto | None = AUTO,
    num_warps: int | Auto | None = AUTO, num_stages: int | Auto | None = AUTO,
) -> tuple[KernelSettings, KernelSettings]:
  """The forward and the backward (dQ, dK/dV, delta) settings `segment_attention_pallas` uses.

  Explicit values are validated and kept (refused if the shared-memory model says they do not
  fit); "auto" (or None) ones come from `resources.resolve`. `num_warps` and `num_stages`, when
  explicit, apply to every kernel.

  Returns:
    `(forward, backward)`.
  """
  explicit = dict(
      block_q=_auto("block_q", block_q, 16, pow2=True),
      block_k=_auto("block_k", block_k, 16, pow2=True),
      block_q_bwd=_auto("block_q_bwd", block_q_bwd, 16, pow2=True),
      block_k_bwd=_auto("block_k_bwd", block_k_bwd, 16, pow2=True),
      num_warps=_auto("num_warps", num_warps, 1, pow2=True),
      num_stages=_auto("num_stages", num_stages, 1, pow2=False))
  common = dict(dtype=dtype, head_dim=head_dim, group=group, seq_len=seq_len,
                smem_bytes=resources.device_smem_bytes() if smem_bytes is None else smem_bytes,
                num_warps=explicit["num_warps"], num_stages=explicit["num_stages"])
  fwd = resources.resolve(kernel="forward", block_q=explicit["block_q"],
                          block_k=explicit["block_k"], **common)
  bwd = resources.resolve(kernel="dkv", block_q=explicit["block_q_bwd"],
                          block_k=explicit["block_k_bwd"], **common)
  return fwd, bwd


def segment_attention_pallas(
    q_BxSxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    segment_ids_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
    block_q: int | Auto | None = AUTO,
    block_k: int | Auto | None = AUTO,
    block_q_bwd: int | Auto | None = AUTO,
    block_k_bwd: int | Auto | None = AUTO,
    interpret: bool = False,
    skip_blocks: bool = True,
    num_warps: int | Auto | None = AUTO,
    num_stages: int | Auto | None = AUTO,
    smem_bytes: int | None = None,
) -> jax.Array:
  """Segment flash attention (forward and backward in Pallas), with native grouped-query heads.

  Padding: S is padded to a multiple of the largest block with padding slots (segment 0); blocks
  larger than the next power of two of S are shrunk to it. A head dim that is not a power of
  two (>= 16) is zero-padded to the next one, which leaves the logits unchanged; head dims above
  256 are refused.

  Kernel settings: "auto" (or None) values come from the shared-memory model of `resources.py`
  (the first candidate that fits, with a margin); explicit ones are kept and refused before
  compiling when the model says they exceed `smem_bytes`. The choice is the same in interpret
  mode as on the GPU it targets.

  Args:
    q_BxSxHxD: queries.
    k_BxSxKxD: keys.
    v_BxSxKxD: values.
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    causal: hide keys after the query.
    scale: logit scale.
    block_q: forward query block, a power of two >= 16, or "auto".
    block_k: forward key/value block, a power of two >= 16, or "auto".
    block_q_bwd: query block of the backward kernels (delta, dQ, dK/dV), or "auto".
    block_k_bwd: key/value block of the backward kernels, or "auto".
    interpret: run the kernels in interpret mode (CPU).
    skip_blocks: False gives the dense-mask kernel of the same family (benchmark baseline).
    num_warps: Triton warps of every kernel, or "auto" (per kernel).
    num_stages: Triton pipeline stages of every kernel, or "auto" (per kernel).
    smem_bytes: shared memory per block of the target GPU; None: the local GPU's, or an H100's
      (232,448) when JAX has no GPU.

  Returns:
    `out_BxSxHxD`.
  """
  b, s, h, d = q_BxSxHxD.shape
  if d > MAX_HEAD_DIM:
    raise AttentionInputError(
        f"segment_attention(implementation='pallas'): head dim D={d} is above {MAX_HEAD_DIM}")
  fwd, bwd = kernel_settings(
      dtype=q_BxSxHxD.dtype, head_dim=d, group=h // k_BxSxKxD.shape[2], seq_len=s,
      smem_bytes=smem_bytes, block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd,
      block_k_bwd=block_k_bwd, num_warps=num_warps, num_stages=num_stages)
  multiple = max(fwd.block_q, fwd.block_k, bwd.block_q, bwd.block_k)
  s_pad = -(-s // multiple) * multiple
  d_pad = resources.padded_head_dim(d)
  pad4 = ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d))
  q_p, k_p, v_p = (jnp.pad(x, pad4) for x in (q_BxSxHxD, k_BxSxKxD, v_BxSxKxD))
  seg_p = jnp.pad(segment_ids_BxS.astype(jnp.int32), ((0, 0), (0, s_pad - s)))
  cfg = KernelConfig(
      causal=causal, scale=scale, block_q=fwd.block_q, block_k=fwd.block_k,
      block_q_bwd=bwd.block_q, block_k_bwd=bwd.block_k, interpret=interpret,
      skip_blocks=skip_blocks, num_warps=fwd.num_warps, num_stages=fwd.num_stages,
      num_warps_bwd=bwd.num_warps, num_stages_bwd=bwd.num_stages)
  out = _flash(q_p, k_p, v_p, seg_p, cfg)
  return out[:, :s, :, :d]
