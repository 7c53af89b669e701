"""Backward Pallas kernels of segment flash attention (flash-attention-2 style).

1. `backward_delta`: `delta = rowsum(dO * O)` per query, grid `(S // block_q, B, H)`.
2. `backward_dq`: grid `(S // block_q, B, H)`; like the forward, a program walks the key blocks of
   its query block's range (masked / mask-free / masked loops) and accumulates
   `dQ += dS K`, with `P = exp(S - lse)` from the saved log-sum-exp and `dS = P (dP - delta)`.
3. `backward_dkv`: grid `(S // block_k, B, K)`; a program owns one key/value block of one kv head,
   loops over the `G` query heads sharing it and, for each, over the query blocks of the key
   block's range (`blocks.kv_block_ranges`), accumulating `dV += P^T dO` and `dK += dS^T Q`.

With shared prefixes (`KernelConfig.prefix`) the queries' prefix segment ids are one more input
of the dQ kernel (a `[block_q]` block) and of the dK/dV kernel (the whole row, sliced per query
block), and both masks let a query see its prefix segment's keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from segpack.attention.pallas_fwd import KernelConfig
from segpack.attention.pallas_fwd import block_range
from segpack.attention.pallas_fwd import compiler_params
from segpack.attention.pallas_fwd import element_mask
from segpack.attention.pallas_fwd import key_block_mask
from segpack.attention.pallas_fwd import query_block_specs
from segpack.attention.pallas_fwd import query_extras
from segpack.attention.pallas_fwd import query_positions
from segpack.attention.pallas_fwd import split_extras
from segpack.attention.pallas_fwd import visit_blocks


def _delta_kernel(o_ref, do_ref, delta_ref):
  o_QxD = o_ref[...].astype(jnp.float32)
  do_QxD = do_ref[...].astype(jnp.float32)
  delta_ref[...] = jnp.sum(o_QxD * do_QxD, axis=-1)


def backward_delta(out_BxSxHxD, dout_BxSxHxD, *, cfg: KernelConfig) -> jax.Array:
  """`delta_BxHxS = sum_d out * dout` in float32."""
  b, s, h, d = out_BxSxHxD.shape
  spec = pl.BlockSpec((None, cfg.block_q, None, d), lambda i, bi, hi: (bi, i, hi, 0))
  return pl.pallas_call(
      _delta_kernel,
      grid=(s // cfg.block_q, b, h),
      in_specs=[spec, spec],
      out_specs=pl.BlockSpec((None, None, cfg.block_q), lambda i, bi, hi: (bi, hi, i)),
      out_shape=jax.ShapeDtypeStruct((b, h, s), jnp.float32),
      compiler_params=compiler_params(cfg),
      interpret=cfg.interpret,
      name="segment_flash_bwd_delta",
  )(out_BxSxHxD, dout_BxSxHxD)


def _dq_kernel(ranges_ref, seg_q_ref, seg_k_ref, *refs, cfg: KernelConfig):
  bk = cfg.block_k
  qpos_ref, pre_ref, refs = split_extras(refs, cfg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
  qi = pl.program_id(0)
  ranges = block_range(ranges_ref, qi)
  pre_q_Q = None if pre_ref is None else pre_ref[...]
  q_QxD = q_ref[...]
  do_QxD = do_ref[...]
  lse_Q = lse_ref[...]
  delta_Q = delta_ref[...]
  seg_q_Q = seg_q_ref[...]
  q_pos_Q = query_positions(qi, qpos_ref, cfg)

  def body(j, dq_QxD, *, masked: bool):
    k_CxD = k_ref[pl.ds(j * bk, bk), :]
    v_CxD = v_ref[pl.ds(j * bk, bk), :]
    s_QxC = jnp.dot(q_QxD, k_CxD.T, preferred_element_type=jnp.float32) * cfg.scale
    p_QxC = jnp.exp(s_QxC - lse_Q[:, None])
    if masked:
      p_QxC = jnp.where(key_block_mask(j, seg_k_ref, seg_q_Q, q_pos_Q, cfg, pre_q_Q), p_QxC,
                        0.0)
    dp_QxC = jnp.dot(do_QxD, v_CxD.T, preferred_element_type=jnp.float32)
    ds_QxC = p_QxC * (dp_QxC - delta_Q[:, None])
    return dq_QxD + jnp.dot(ds_QxC.astype(k_CxD.dtype), k_CxD, preferred_element_type=jnp.float32)

  dq_QxD = visit_blocks(body, jnp.zeros(q_QxD.shape, jnp.float32), *ranges)
  dq_ref[...] = (dq_QxD * cfg.scale).astype(dq_ref.dtype)


def backward_dq(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
                q_ranges_BxNx4, dout_BxQxHxD, lse_BxHxQ, delta_BxHxQ, *,
                cfg: KernelConfig) -> jax.Array:
  """Runs the dQ kernel; returns `dq_BxQxHxD` in the dtype of `q` (`q_pos`, `pre_q` as in
  `forward`)."""
  b, sq, h, d = q_BxQxHxD.shape
  s = k_BxSxKxD.shape[1]
  g = h // k_BxSxKxD.shape[2]
  nq = sq // cfg.block_q
  q_spec = pl.BlockSpec((None, cfg.block_q, None, d), lambda i, bi, hi: (bi, i, hi, 0))
  kv_spec = pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0))
  row_spec = pl.BlockSpec((None, None, cfg.block_q), lambda i, bi, hi: (bi, hi, i))
  lead_specs, pos_args = query_block_specs(q_pos_BxQ, pre_q_BxQ, num_blocks=nq, seq_len=s,
                                          cfg=cfg)
  in_specs = [*lead_specs, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  return pl.pallas_call(
      functools.partial(_dq_kernel, cfg=cfg),
      grid=(nq, b, h),
      in_specs=in_specs,
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q_BxQxHxD.shape, q_BxQxHxD.dtype),
      compiler_params=compiler_params(cfg),
      interpret=cfg.interpret,
      name="segment_flash_bwd_dq",
  )(q_ranges_BxNx4, seg_q_BxQ, seg_k_BxS, *pos_args, q_BxQxHxD, k_BxSxKxD, v_BxSxKxD,
    dout_BxQxHxD, lse_BxHxQ, delta_BxHxQ)


def _dkv_kernel(ranges_ref, seg_q_ref, seg_k_ref, *refs, cfg: KernelConfig, group: int):
  bq, bk = cfg.block_q, cfg.block_k
  qpos_ref, pre_ref, refs = split_extras(refs, cfg)
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
  kj = pl.program_id(0)
  ranges = block_range(ranges_ref, kj)
  k_CxD = k_ref[...]
  v_CxD = v_ref[...]
  seg_k_C = seg_k_ref[...]
  k_pos_C = kj * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)

  def body(i, carry, *, gi, masked: bool):
    dk_CxD, dv_CxD = carry
    q_QxD = q_ref[pl.ds(i * bq, bq), gi, :]
    do_QxD = do_ref[pl.ds(i * bq, bq), gi, :]
    lse_Q = lse_ref[gi, pl.ds(i * bq, bq)]
    delta_Q = delta_ref[gi, pl.ds(i * bq, bq)]
    s_QxC = jnp.dot(q_QxD, k_CxD.T, preferred_element_type=jnp.float32) * cfg.scale
    p_QxC = jnp.exp(s_QxC - lse_Q[:, None])
    if masked:
      seg_q_Q = seg_q_ref[pl.ds(i * bq, bq)]
      if cfg.q_positions:
        q_pos_Q = qpos_ref[pl.ds(i * bq, bq)]
      else:
        q_pos_Q = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)
      pre_q_Q = None if pre_ref is None else pre_ref[pl.ds(i * bq, bq)]
      mask_QxC = element_mask(seg_q_Q, seg_k_C, q_pos_Q, k_pos_C, cfg.causal, pre_q_Q)
      p_QxC = jnp.where(mask_QxC, p_QxC, 0.0)
    dv_CxD += jnp.dot(p_QxC.astype(do_QxD.dtype).T, do_QxD, preferred_element_type=jnp.float32)
    dp_QxC = jnp.dot(do_QxD, v_CxD.T, preferred_element_type=jnp.float32)
    ds_QxC = p_QxC * (dp_QxC - delta_Q[:, None])
    dk_CxD += jnp.dot(ds_QxC.astype(q_QxD.dtype).T, q_QxD, preferred_element_type=jnp.float32)
    return dk_CxD, dv_CxD

  def head(gi, carry):
    return visit_blocks(functools.partial(body, gi=gi), carry, *ranges)

  zeros_CxD = jnp.zeros(k_CxD.shape, jnp.float32)
  dk_CxD, dv_CxD = jax.lax.fori_loop(0, group, head, (zeros_CxD, zeros_CxD))
  dk_ref[...] = (dk_CxD * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_CxD.astype(dv_ref.dtype)


def backward_dkv(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
                 kv_ranges_BxNx4, dout_BxQxHxD, lse_BxHxQ, delta_BxHxQ, *,
                 cfg: KernelConfig) -> tuple[jax.Array, jax.Array]:
  """Runs the dK/dV kernel; returns `(dk_BxSxKxD, dv_BxSxKxD)`, summed over each kv head's group.

  `q_pos`, `pre_q` as in `forward`.
  """
  b, sq, h, d = q_BxQxHxD.shape
  s = k_BxSxKxD.shape[1]
  kh = k_BxSxKxD.shape[2]
  g = h // kh
  nk = s // cfg.block_k
  q_BxQxKxGxD = q_BxQxHxD.reshape(b, sq, kh, g, d)
  do_BxQxKxGxD = dout_BxQxHxD.reshape(b, sq, kh, g, d)
  lse_BxKxGxQ = lse_BxHxQ.reshape(b, kh, g, sq)
  delta_BxKxGxQ = delta_BxHxQ.reshape(b, kh, g, sq)
  kv_spec = pl.BlockSpec((None, cfg.block_k, None, d), lambda j, bi, ki: (bi, j, ki, 0))
  q_spec = pl.BlockSpec((None, sq, None, g, d), lambda j, bi, ki: (bi, 0, ki, 0, 0))
  row_spec = pl.BlockSpec((None, None, g, sq), lambda j, bi, ki: (bi, ki, 0, 0))
  row_q = pl.BlockSpec((None, sq), lambda j, bi, ki: (bi, 0))
  pos_specs, pos_args = query_extras(q_pos_BxQ, pre_q_BxQ, row_q, cfg)
  in_specs = [
      pl.BlockSpec((None, nk, 4), lambda j, bi, ki: (bi, 0, 0)),
      row_q,
      pl.BlockSpec((None, cfg.block_k), lambda j, bi, ki: (bi, j)),
      *pos_specs, q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
  ]
  out_shape = [jax.ShapeDtypeStruct(k_BxSxKxD.shape, k_BxSxKxD.dtype),
               jax.ShapeDtypeStruct(v_BxSxKxD.shape, v_BxSxKxD.dtype)]
  return pl.pallas_call(
      functools.partial(_dkv_kernel, cfg=cfg, group=g),
      grid=(nk, b, kh),
      in_specs=in_specs,
      out_specs=[kv_spec, kv_spec],
      out_shape=out_shape,
      compiler_params=compiler_params(cfg),
      interpret=cfg.interpret,
      name="segment_flash_bwd_dkv",
  )(kv_ranges_BxNx4, seg_q_BxQ, seg_k_BxS, *pos_args, q_BxQxKxGxD, k_BxSxKxD, v_BxSxKxD,
    do_BxQxKxGxD, lse_BxKxGxQ, delta_BxKxGxQ)
