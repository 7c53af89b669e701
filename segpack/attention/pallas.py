"""The Pallas backend: a flash-attention kernel that visits only its segments' blocks.

`segment_attention_pallas` chooses the kernel settings (`resources.py`), pads, computes the block
ranges (`blocks.py`) and calls a `custom_vjp` whose forward and backward are Pallas kernels
(`pallas_fwd.py`, `pallas_bwd.py`), lowered through Triton on a GPU or run in interpret mode on
the CPU. `PallasOptions` groups its settings for `segment_attention(..., pallas=...)`.
`segment_attention_pallas_slots` is the context-parallel variant: one device's queries against
the whole (gathered) row, placed by slot index.

Without interpret mode, a call lowered for the CPU fails with one line naming
`PallasOptions(interpret=True)` (`cpu_guard`), not Pallas's own message; the check is made when
the computation is lowered for its platform, so a CPU host can still lower it for a GPU. Without
interpret mode on a JAX that has no Pallas Triton backend, a call is refused in one line naming
it and the other backends (`require_triton`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.interpreters import mlir

from segpack.attention import blocks
from segpack.attention import pallas_bwd
from segpack.attention import pallas_fwd
from segpack.attention import resources
from segpack.attention.checks import AttentionInputError
from segpack.attention.context_parallel import row_order
from segpack.attention.pallas_fwd import KernelConfig
from segpack.attention.resources import AUTO, Auto, KernelSettings

MAX_HEAD_DIM = 256
CPU_NEEDS_INTERPRET = (
    "segment_attention: implementation='pallas' on the CPU needs "
    "pallas=PallasOptions(interpret=True) (the GPU kernels in Pallas interpret mode, slowly), got "
    "interpret=False; or use implementation='xla'")


def has_triton() -> bool:
  """Whether this JAX has Pallas's Triton backend (`jax.experimental.pallas.triton`), which the
  GPU kernels are lowered with (deprecated from JAX 0.11; interpret mode runs without it)."""
  return pallas_fwd.triton_backend() is not None


def no_triton_message(implementation: str) -> str:
  """The one line refusing the Pallas GPU kernels on a JAX without their Triton backend."""
  return (f"segment_attention: {implementation} needs Pallas's Triton backend "
          f"(jax.experimental.pallas.triton), which this JAX {jax.__version__} does not have: "
          "use implementation='cudnn' or implementation='xla' (or pallas=PallasOptions("
          "interpret=True): the kernels in Pallas interpret mode, slowly)")


def require_triton(*, interpret: bool) -> None:
  """Raises `AttentionInputError(no_triton_message(...))` when the kernels are to be lowered
  (not interpret mode) and this JAX has no Pallas Triton backend."""
  if not interpret and not has_triton():
    raise AttentionInputError(no_triton_message("implementation='pallas'"))


def _refuse_cpu(ctx, **params):
  """The CPU lowering of `cpu_guard`: the one-line error (Pallas lowers only interpret mode)."""
  raise AttentionInputError(CPU_NEEDS_INTERPRET)


# A primitive without inputs whose value is int32 0; lowering it for the CPU raises instead.
# Without inputs it needs no autodiff or batching rule (nothing is ever differentiated or mapped).
_cpu_guard_p = jax_core.Primitive("segpack_pallas_cpu_guard")
_cpu_guard_p.def_abstract_eval(lambda: jax.core.ShapedArray((), jnp.int32))
mlir.register_lowering(
    _cpu_guard_p, mlir.lower_fun(lambda: jnp.zeros((), jnp.int32), multiple_results=False))
mlir.register_lowering(_cpu_guard_p, _refuse_cpu, platform="cpu")
_cpu_guard_jit = jax.jit(_cpu_guard_p.bind)  # outside a trace: compiled for the default backend
_cpu_guard_p.def_impl(_cpu_guard_jit)


def cpu_guard(segment_ids: jax.Array, *, interpret: bool) -> jax.Array:
  """`segment_ids` unchanged, but without interpret mode made to depend on a value whose CPU
  lowering raises `AttentionInputError(CPU_NEEDS_INTERPRET)` (the kernels read them, so the
  check cannot be pruned from the computation)."""
  return segment_ids if interpret else segment_ids + _cpu_guard_p.bind()


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


def _ranges(seg_q_BxQ: jax.Array, seg_k_BxS: jax.Array, q_pos_BxQ: jax.Array | None,
            pre_q_BxQ: jax.Array | None, cfg: KernelConfig, *, per_q: bool) -> jax.Array:
  """Per query block (`per_q`) or per key block ranges for the blocks of `cfg`.

  Without query positions (`cfg.q_positions` False) the queries are the keys' row itself; with
  `cfg.prefix` the ranges cover the queries' prefix segments (`pre_q_BxQ`).
  """
  if cfg.q_positions:
    fn = blocks.slot_q_block_ranges if per_q else blocks.slot_kv_block_ranges
    return fn(seg_q_BxQ, q_pos_BxQ, seg_k_BxS, block_q=cfg.block_q, block_k=cfg.block_k,
              causal=cfg.causal)
  if not cfg.skip_blocks:
    return dense_ranges(seg_k_BxS, cfg, per_q=per_q)
  fn = blocks.q_block_ranges if per_q else blocks.kv_block_ranges
  prefix = dict(prefix_ids_BxS=pre_q_BxQ) if cfg.prefix else {}
  return fn(seg_k_BxS, block_q=cfg.block_q, block_k=cfg.block_k, causal=cfg.causal, **prefix)


def _backward_config(cfg: KernelConfig) -> KernelConfig:
  return dataclasses.replace(cfg, block_q=cfg.block_q_bwd, block_k=cfg.block_k_bwd,
                             num_warps=cfg.num_warps_bwd, num_stages=cfg.num_stages_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
           cfg: KernelConfig):
  out_BxQxHxD, _ = _flash_fwd(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ,
                              pre_q_BxQ, cfg)
  return out_BxQxHxD


def _flash_fwd(q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
               cfg: KernelConfig):
  q_ranges_BxNx4 = _ranges(seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ, cfg, per_q=True)
  out_BxQxHxD, lse_BxHxQ = pallas_fwd.forward(
      q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
      q_ranges_BxNx4, cfg=cfg)
  residuals = (q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ,
               out_BxQxHxD, lse_BxHxQ)
  return out_BxQxHxD, residuals


def _flash_bwd(cfg: KernelConfig, residuals, dout_BxQxHxD):
  (q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ, out_BxQxHxD,
   lse_BxHxQ) = residuals
  cfg = _backward_config(cfg)
  q_ranges_BxNx4 = _ranges(seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ, cfg, per_q=True)
  kv_ranges_BxNx4 = _ranges(seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ, cfg, per_q=False)
  delta_BxHxQ = pallas_bwd.backward_delta(out_BxQxHxD, dout_BxQxHxD, cfg=cfg)
  common = (seg_q_BxQ, seg_k_BxS, q_pos_BxQ, pre_q_BxQ)
  dq_BxQxHxD = pallas_bwd.backward_dq(
      q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, *common, q_ranges_BxNx4, dout_BxQxHxD, lse_BxHxQ,
      delta_BxHxQ, cfg=cfg)
  dk_BxSxKxD, dv_BxSxKxD = pallas_bwd.backward_dkv(
      q_BxQxHxD, k_BxSxKxD, v_BxSxKxD, *common, kv_ranges_BxNx4, dout_BxQxHxD, lse_BxHxQ,
      delta_BxHxQ, cfg=cfg)
  return dq_BxQxHxD, dk_BxSxKxD, dv_BxSxKxD, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def kernel_settings(
    *, dtype, head_dim: int, group: int, seq_len: int, pallas: PallasOptions,
) -> tuple[KernelSettings, KernelSettings]:
  """The forward and the backward (dQ, dK/dV, delta) settings `segment_attention_pallas` uses.

  Explicit values of `pallas` are validated and kept (refused if the shared-memory model says
  they do not fit); "auto" (or None) ones come from `resources.resolve`. `num_warps` and
  `num_stages`, when explicit, apply to every kernel.

  Args:
    dtype: dtype of the queries, keys and values.
    head_dim: D, before padding.
    group: query heads per key/value head.
    seq_len: slots of the queries.
    pallas: the settings (`PallasOptions`; its `smem_bytes` None: the local GPU's).

  Returns:
    `(forward, backward)`.
  """
  explicit = dict(
      block_q=_auto("block_q", pallas.block_q, 16, pow2=True),
      block_k=_auto("block_k", pallas.block_k, 16, pow2=True),
      block_q_bwd=_auto("block_q_bwd", pallas.block_q_bwd, 16, pow2=True),
      block_k_bwd=_auto("block_k_bwd", pallas.block_k_bwd, 16, pow2=True),
      num_warps=_auto("num_warps", pallas.num_warps, 1, pow2=True),
      num_stages=_auto("num_stages", pallas.num_stages, 1, pow2=False))
  smem_bytes = resources.device_smem_bytes() if pallas.smem_bytes is None else pallas.smem_bytes
  common = dict(dtype=dtype, head_dim=head_dim, group=group, seq_len=seq_len,
                smem_bytes=smem_bytes, num_warps=explicit["num_warps"],
                num_stages=explicit["num_stages"])
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
    pallas: PallasOptions | None = None,
    skip_blocks: bool = True,
    prefix_segment_ids_BxS: jax.Array | None = None,
) -> jax.Array:
  """Segment flash attention (forward and backward in Pallas), with native grouped-query heads.

  Padding: S is padded to a multiple of the largest block with padding slots (segment 0); blocks
  larger than the next power of two of S are shrunk to it. A head dim that is not a power of
  two (>= 16) is zero-padded to the next one, which leaves the logits unchanged; head dims above
  256 are refused.

  Kernel settings (`pallas`): "auto" (or None) values come from the shared-memory model of
  `resources.py` (the first candidate that fits, with a margin); explicit ones are kept and
  refused before compiling when the model says they exceed `smem_bytes`. The choice is the same
  in interpret mode as on the GPU it targets.

  Args:
    q_BxSxHxD: queries.
    k_BxSxKxD: keys.
    v_BxSxKxD: values.
    segment_ids_BxS: contiguous segment ids, 0 = padding.
    causal: hide keys after the query.
    scale: logit scale.
    pallas: the kernel settings (blocks, warps, stages, shared memory, interpret mode); None:
      `PallasOptions()`, every setting "auto".
    skip_blocks: False gives the dense-mask kernel of the same family (benchmark baseline).
    prefix_segment_ids_BxS: optional shared-prefix ids (`segment_attention(prefix_segment_ids=
      ...)`): a query also sees the keys of its non-zero prefix segment; the kernels then take
      them as one more input (`KernelConfig.prefix`) and the block ranges cover the prefixes.
      None: the kernels and ranges without prefixes, unchanged.

  Returns:
    `out_BxSxHxD`.
  """
  s, d = q_BxSxHxD.shape[1], q_BxSxHxD.shape[3]
  pallas = PallasOptions() if pallas is None else pallas
  cfg, multiple = _kernel_config(
      q_BxSxHxD, k_BxSxKxD, seq_len=s, causal=causal, scale=scale, pallas=pallas,
      skip_blocks=skip_blocks, q_positions=False, prefix=prefix_segment_ids_BxS is not None)
  s_pad = -(-s // multiple) * multiple
  pad4 = ((0, 0), (0, s_pad - s), (0, 0), (0, resources.padded_head_dim(d) - d))
  q_p, k_p, v_p = (jnp.pad(x, pad4) for x in (q_BxSxHxD, k_BxSxKxD, v_BxSxKxD))
  seg_p = jnp.pad(segment_ids_BxS.astype(jnp.int32), ((0, 0), (0, s_pad - s)))
  seg_p = cpu_guard(seg_p, interpret=pallas.interpret)
  pre_p = None
  if prefix_segment_ids_BxS is not None:
    pre_p = jnp.pad(prefix_segment_ids_BxS.astype(jnp.int32), ((0, 0), (0, s_pad - s)))
  out = _flash(q_p, k_p, v_p, seg_p, seg_p, None, pre_p, cfg)
  return out[:, :s, :, :d]


def _kernel_config(q_BxQxHxD, k_BxSxKxD, *, seq_len: int, causal: bool, scale: float,
                   pallas: PallasOptions, skip_blocks: bool, q_positions: bool,
                   prefix: bool = False) -> tuple[KernelConfig, int]:
  """The kernels' static config and the multiple that every padded length must be."""
  h, d = q_BxQxHxD.shape[2], q_BxQxHxD.shape[3]
  require_triton(interpret=pallas.interpret)
  if d > MAX_HEAD_DIM:
    raise AttentionInputError(
        f"segment_attention(implementation='pallas'): head dim D={d} is above {MAX_HEAD_DIM}")
  fwd, bwd = kernel_settings(
      dtype=q_BxQxHxD.dtype, head_dim=d, group=h // k_BxSxKxD.shape[2], seq_len=seq_len,
      pallas=pallas)
  cfg = KernelConfig(
      causal=causal, scale=scale, block_q=fwd.block_q, block_k=fwd.block_k,
      block_q_bwd=bwd.block_q, block_k_bwd=bwd.block_k, interpret=pallas.interpret,
      skip_blocks=skip_blocks, num_warps=fwd.num_warps, num_stages=fwd.num_stages,
      num_warps_bwd=bwd.num_warps, num_stages_bwd=bwd.num_stages, q_positions=q_positions,
      prefix=prefix)
  return cfg, max(fwd.block_q, fwd.block_k, bwd.block_q, bwd.block_k)


def segment_attention_pallas_slots(
    q_BxQxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    seg_q_BxQ: jax.Array,
    seg_k_BxS: jax.Array,
    slot_q_BxQ: jax.Array,
    slot_k_BxS: jax.Array,
    *,
    causal: bool,
    scale: float,
    pallas: PallasOptions | None = None,
) -> jax.Array:
  """Segment flash attention of `Q` queries over a whole row of `S` keys, placed by slot index.

  The context-parallel variant of `segment_attention_pallas` (the signature of
  `xla.segment_attention_xla_slots`): the keys are the whole row in any order (e.g. all-gathered
  from the devices of a context axis), `slot_k` their slot indices (a permutation of `0..S-1`);
  the queries are any `Q` of the row's slots with ascending `slot_q`. The keys, values and
  segment ids are put back in row order (a gather by the inverse permutation, whose transpose
  scatters dK and dV back), so every segment is one run and the block ranges of `blocks.py`
  (`slot_q_block_ranges`, `slot_kv_block_ranges`) skip the blocks of other documents; the
  kernels read the queries' slot positions from an input (`KernelConfig.q_positions`).

  Args:
    q_BxQxHxD: queries.
    k_BxSxKxD: keys of the whole row.
    v_BxSxKxD: values of the whole row.
    seg_q_BxQ: segment ids of the queries, 0 = padding.
    seg_k_BxS: segment ids of the keys, in the keys' order.
    slot_q_BxQ: int32 slot indices of the queries, ascending.
    slot_k_BxS: int32 slot indices of the keys, a permutation of `0..S-1` per row.
    causal: hide keys whose slot index is above the query's.
    scale: logit scale.
    pallas: the kernel settings, as `segment_attention_pallas`.

  Returns:
    `out_BxQxHxD`; zeros at padding queries.
  """
  sq, d = q_BxQxHxD.shape[1], q_BxQxHxD.shape[3]
  s = k_BxSxKxD.shape[1]
  pallas = PallasOptions() if pallas is None else pallas
  cfg, multiple = _kernel_config(
      q_BxQxHxD, k_BxSxKxD, seq_len=sq, causal=causal, scale=scale, pallas=pallas,
      skip_blocks=True, q_positions=True)
  to_row, _ = row_order(slot_k_BxS)
  k_nat, v_nat, seg_nat_BxS = (to_row(x) for x in (k_BxSxKxD, v_BxSxKxD,
                                                   seg_k_BxS.astype(jnp.int32)))
  sq_pad, s_pad = (-(-n // multiple) * multiple for n in (sq, s))
  d_pad = resources.padded_head_dim(d)
  q_p = jnp.pad(q_BxQxHxD, ((0, 0), (0, sq_pad - sq), (0, 0), (0, d_pad - d)))
  k_p, v_p = (jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d)))
              for x in (k_nat, v_nat))
  seg_q_p = cpu_guard(jnp.pad(seg_q_BxQ.astype(jnp.int32), ((0, 0), (0, sq_pad - sq))),
                      interpret=pallas.interpret)
  seg_k_p = jnp.pad(seg_nat_BxS, ((0, 0), (0, s_pad - s)))
  # Padding queries sit after every key, so they stay last in the ascending order.
  pos_q_p = jnp.pad(slot_q_BxQ.astype(jnp.int32), ((0, 0), (0, sq_pad - sq)),
                    constant_values=s_pad)
  out = _flash(q_p, k_p, v_p, seg_q_p, seg_k_p, pos_q_p, None, cfg)
  return out[:, :sq, :, :d]
