"""Forward Pallas kernel of segment flash attention (Triton on a GPU, interpret on the CPU).

Grid `(S // block_q, B, H)`. A program owns one query block of one head and walks the key/value
blocks `[kv_lo, kv_hi)` precomputed by `blocks.q_block_ranges`, in three loops: masked blocks
`[kv_lo, full_lo)`, mask-free blocks `[full_lo, full_hi)` (inside the query block's segment and at
or below the diagonal), masked blocks `[full_hi, kv_hi)`. The kv head is `h // G`.

Context parallelism (`KernelConfig.q_positions`): the queries are `Q` slots of the row (one
device's share), the keys the whole row in row order; the queries' slot positions come from an
input instead of `program_id * block_q`, and the ranges from `blocks.slot_q_block_ranges`.

Shared prefixes (`KernelConfig.prefix`): the queries' prefix segment ids come as one more input
(a `[block_q]` block, like their segment ids), and the element mask also lets a query see the keys
of its prefix segment; the ranges (`blocks.q_block_ranges(prefix_ids_BxS=...)`) cover them.

`KernelConfig`, the static settings of a kernel call, lives here because the forward and the
backward kernels (`pallas_bwd.py`) both read it; `pallas.py` builds it.

Pallas's Triton backend (`jax.experimental.pallas.triton`, deprecated from JAX 0.11) is imported
when a kernel is built (`triton_backend`), not with this module: a JAX without it imports segpack
and runs the other backends, and interpret mode runs without it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -1e30


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
    num_warps: Triton warps per program of the forward kernel.
    num_stages: Triton pipeline stages of the forward kernel.
    num_warps_bwd: Triton warps of the backward kernels (delta, dQ, dK/dV).
    num_stages_bwd: Triton pipeline stages of the backward kernels.
    q_positions: the queries' slot positions come from an input array (queries placed anywhere
      in the row of keys, context parallelism) instead of `program_id * block_q`; the kernels
      then also accept fewer queries than keys.
    prefix: the queries' shared-prefix segment ids come from an input array, and a query also
      sees the keys of its prefix segment (`segment_attention(prefix_segment_ids=...)`).
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
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2
  q_positions: bool = False
  prefix: bool = False


@functools.cache
def triton_backend() -> Any | None:
  """Pallas's Triton backend, `jax.experimental.pallas.triton`, or None where this JAX has none."""
  try:
    from jax.experimental.pallas import triton  # optional: the Pallas GPU kernels alone need it
  except ImportError:
    return None
  return triton


def compiler_params(cfg: KernelConfig) -> Any | None:
  """Triton compiler parameters (selects the Triton lowering on a GPU); None without the Triton
  backend, which only interpret mode runs without (`pallas.require_triton` refuses the rest)."""
  triton = triton_backend()
  if triton is None:
    return None
  return triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def element_mask(seg_q_Q, seg_k_C, q_pos_Q, k_pos_C, causal: bool, pre_q_Q=None) -> jax.Array:
  """`[block_q, block_k]` mask: same non-padding segment (or, with `pre_q_Q`, the key in the
  query's non-zero prefix segment) and, if causal, key not after query."""
  same_QxC = seg_q_Q[:, None] == seg_k_C[None, :]
  if pre_q_Q is not None:
    same_QxC |= (pre_q_Q[:, None] == seg_k_C[None, :]) & (pre_q_Q[:, None] != 0)
  mask_QxC = same_QxC & (seg_q_Q[:, None] != 0)
  if causal:
    mask_QxC &= q_pos_Q[:, None] >= k_pos_C[None, :]
  return mask_QxC


def query_positions(qi, qpos_ref, cfg: KernelConfig) -> jax.Array:
  """Slot positions of query block `qi`: read from `qpos_ref`, or `qi * block_q + iota`."""
  if cfg.q_positions:
    return qpos_ref[...]
  return qi * cfg.block_q + jax.lax.broadcasted_iota(jnp.int32, (cfg.block_q,), 0)


def key_block_mask(j, seg_k_ref, seg_q_Q, q_pos_Q, cfg: KernelConfig,
                   pre_q_Q=None) -> jax.Array:
  """`element_mask` of a query block against key block `j` of the row's keys (`seg_k_ref`)."""
  bk = cfg.block_k
  seg_k_C = seg_k_ref[pl.ds(j * bk, bk)]
  k_pos_C = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
  return element_mask(seg_q_Q, seg_k_C, q_pos_Q, k_pos_C, cfg.causal, pre_q_Q)


def block_range(ranges_ref, i) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """`(lo, hi, full_lo, full_hi)` of block `i` (a row of `blocks.q_block_ranges` or
  `blocks.kv_block_ranges`)."""
  return ranges_ref[i, 0], ranges_ref[i, 1], ranges_ref[i, 2], ranges_ref[i, 3]


def visit_blocks(body, carry, lo, hi, full_lo, full_hi):
  """`body(j, carry, masked=...)` over the blocks `j` of `[lo, hi)`, in three loops: masked on
  `[lo, full_lo)`, mask-free on `[full_lo, full_hi)`, masked on `[full_hi, hi)`; the last carry."""
  masked_body = functools.partial(body, masked=True)
  carry = jax.lax.fori_loop(lo, full_lo, masked_body, carry)
  carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  return jax.lax.fori_loop(full_hi, hi, masked_body, carry)


def query_block_specs(q_pos_BxQ, pre_q_BxQ, *, num_blocks: int, seq_len: int,
                      cfg: KernelConfig) -> tuple[list, list]:
  """`(in_specs, extra args)` of the inputs that lead a kernel whose grid is `(query block,
  B, H)`: its block ranges, the query block's segment ids, the row's key segment ids and (with
  `cfg.q_positions`, `cfg.prefix`) the query block's positions and prefix segment ids.

  Args:
    q_pos_BxQ: int32 slot positions of the queries, read only with `cfg.q_positions`.
    pre_q_BxQ: int32 prefix segment ids of the queries, read only with `cfg.prefix`.
    num_blocks: query blocks per row (the rows of the ranges input).
    seq_len: keys per row.
    cfg: the kernel config.
  """
  row_q = pl.BlockSpec((None, cfg.block_q), lambda i, bi, hi: (bi, i))
  pos_specs, pos_args = query_extras(q_pos_BxQ, pre_q_BxQ, row_q, cfg)
  return [
      pl.BlockSpec((None, num_blocks, 4), lambda i, bi, hi: (bi, 0, 0)),
      row_q,
      pl.BlockSpec((None, seq_len), lambda i, bi, hi: (bi, 0)),
      *pos_specs,
  ], pos_args


def _fwd_kernel(ranges_ref, seg_q_ref, seg_k_ref, *refs, cfg: KernelConfig):
  bq, bk = cfg.block_q, cfg.block_k
  qpos_ref, pre_ref, (q_ref, k_ref, v_ref, o_ref, lse_ref) = split_extras(refs, cfg)
  qi = pl.program_id(0)
  ranges = block_range(ranges_ref, qi)
  q_QxD = q_ref[...]
  seg_q_Q = seg_q_ref[...]
  pre_q_Q = None if pre_ref is None else pre_ref[...]
  q_pos_Q = query_positions(qi, qpos_ref, cfg)
  d = q_QxD.shape[-1]

  def body(j, carry, *, masked: bool):
    acc_QxD, m_Q, l_Q = carry
    k_CxD = k_ref[pl.ds(j * bk, bk), :]
    v_CxD = v_ref[pl.ds(j * bk, bk), :]
    s_QxC = jnp.dot(q_QxD, k_CxD.T, preferred_element_type=jnp.float32) * cfg.scale
    if masked:
      mask_QxC = key_block_mask(j, seg_k_ref, seg_q_Q, q_pos_Q, cfg, pre_q_Q)
      s_QxC = jnp.where(mask_QxC, s_QxC, MASK_VALUE)
    m_new_Q = jnp.maximum(m_Q, s_QxC.max(axis=-1))
    alpha_Q = jnp.exp(m_Q - m_new_Q)
    p_QxC = jnp.exp(s_QxC - m_new_Q[:, None])
    l_Q = l_Q * alpha_Q + p_QxC.sum(axis=-1)
    acc_QxD = acc_QxD * alpha_Q[:, None] + jnp.dot(
        p_QxC.astype(v_CxD.dtype), v_CxD, preferred_element_type=jnp.float32)
    return acc_QxD, m_new_Q, l_Q

  carry = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
           jnp.zeros((bq,), jnp.float32))
  acc_QxD, m_Q, l_Q = visit_blocks(body, carry, *ranges)
  valid_Q = seg_q_Q != 0
  l_safe_Q = jnp.where(valid_Q, l_Q, 1.0)
  out_QxD = jnp.where(valid_Q[:, None], acc_QxD / l_safe_Q[:, None], 0.0)
  o_ref[...] = out_QxD.astype(o_ref.dtype)
  lse_ref[...] = jnp.where(valid_Q, m_Q + jnp.log(l_safe_Q), jnp.inf)


def split_extras(refs, cfg: KernelConfig):
  """`(qpos_ref or None, pre_ref or None, the other refs)`: the positions input comes first
  when present (`cfg.q_positions`), then the prefix ids (`cfg.prefix`)."""
  qpos_ref = pre_ref = None
  if cfg.q_positions:
    qpos_ref, refs = refs[0], refs[1:]
  if cfg.prefix:
    pre_ref, refs = refs[0], refs[1:]
  return qpos_ref, pre_ref, refs


def query_extras(q_pos_BxQ, pre_q_BxQ, spec, cfg: KernelConfig) -> tuple[list, list]:
  """The extra `(in_specs, args)` that pass the query positions (`cfg.q_positions`) and the
  queries' prefix segment ids (`cfg.prefix`) to a kernel, each with `spec`; none without."""
  chosen = [x for x, on in ((q_pos_BxQ, cfg.q_positions), (pre_q_BxQ, cfg.prefix)) if on]
  return [spec] * len(chosen), chosen


def forward(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
            q_ranges_BxNx4, *, cfg: KernelConfig):
  """Runs the forward kernel (`Q` queries, `S` keys; `Q == S` unless `cfg.q_positions`).

  `q_pos_BxQ` (int32 slot positions of the queries in the row of keys) is read only when
  `cfg.q_positions`, `pre_q_BxQ` (int32 prefix segment ids of the queries) only when
  `cfg.prefix`; otherwise either may be None.

  Returns:
    `(out_BxQxHxD, lse_BxHxQ)`; `lse` is the float32 log-sum-exp of the scaled logits, `+inf` at
    padding queries (so the backward gives them zero probability).
  """
  b, sq, h, d = q_BxQxHxD.shape
  s = k_BxSxKxD.shape[1]
  g = h // k_BxSxKxD.shape[2]
  nq = sq // cfg.block_q
  lead_specs, pos_args = query_block_specs(q_pos_BxQ, pre_q_BxQ, num_blocks=nq, seq_len=s,
                                          cfg=cfg)
  in_specs = [
      *lead_specs,
      pl.BlockSpec((None, cfg.block_q, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
      pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
      pl.BlockSpec((None, s, None, d), lambda i, bi, hi: (bi, 0, hi // g, 0)),
  ]
  out_specs = [
      pl.BlockSpec((None, cfg.block_q, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
      pl.BlockSpec((None, None, cfg.block_q), lambda i, bi, hi: (bi, hi, i)),
  ]
  out_shape = [jax.ShapeDtypeStruct(q_BxQxHxD.shape, q_BxQxHxD.dtype),
               jax.ShapeDtypeStruct((b, h, sq), jnp.float32)]
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg),
      grid=(nq, b, h),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params(cfg),
      interpret=cfg.interpret,
      name="segment_flash_fwd",
  )(q_ranges_BxNx4, seg_q_BxQ, seg_k_BxS, *pos_args, q_BxQxHxD, k_BxSxKxD, v_BxSxKxD)
