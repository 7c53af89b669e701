"""Shared-memory model of the Pallas segment-attention kernels, and the "auto" kernel settings.

Triton keeps in shared memory the tiles that feed a tensor-core `dot`; its software pipeliner
keeps `num_stages` copies of the tiles loaded inside a loop. A kernel whose tiles exceed the
device's shared memory per block fails to compile (`RESOURCE_EXHAUSTED: Shared memory size
limit exceeded`). This module predicts that before compiling:

- `smem_bytes_needed`: the bytes one program of the forward, dQ or dK/dV kernel needs;
- `smem_limit` / `device_smem_bytes`: the bytes a block may use, by compute capability;
- `auto_config` / `resolve`: the first setting of an ordered candidate list that fits (with a
  safety margin), explicit settings checked against the limit (`check_config`).

The model (`b` = bytes per element of the dtype, `D` = the head dim padded to the next power of
two >= 16, as the kernels pad it, `s` = `num_stages`):

- forward: `s * 2 * block_k * D * b + SCRATCH_BYTES` (K and V tiles in the key loop);
- dQ: the same (K and V tiles in the key loop);
- dK/dV: `s * 2 * block_q * D * b + 2 * block_k * D * b + SCRATCH_BYTES` (Q and dO tiles in the
  query loop, plus the program's own K and V tiles, which sit in shared memory as `dot` operands
  for the whole kernel; counted conservatively).

`SCRATCH_BYTES` (512) is calibrated on ONE measured point: the forward kernel in float32 at
D = 128, 128 x 128 blocks, 2 stages asked for 262,656 bytes on an H100 (jax 0.11.2), that is
`2 * 2 * 128 * 128 * 4 = 262,144` plus 512. Where the 512 comes from (reduction or barrier
scratch) is not identified, and one point cannot tell this model from others with the same
total there. G (query heads per kv head) does not change the tiles of one loop iteration: the
dK/dV kernel loops over its G heads one after another; `group` stays in the signatures so that
a model that depends on it needs no interface change.

Run `python -m segpack.attention.resources --table` for the chosen settings (docs/attention.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp

from segpack.attention.checks import AttentionInputError

AUTO = "auto"
Auto = Literal["auto"]
KERNELS = ("forward", "dq", "dkv")
BACKWARD_KERNELS = ("dq", "dkv")

SCRATCH_BYTES = 512
AUTO_MARGIN = 0.9
H100_SMEM_BYTES = 232_448

# Opt-in shared memory per block (bytes), CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability".
SMEM_BYTES_BY_CAPABILITY = {
    "7.0": 98_304,  # V100
    "7.5": 65_536,  # T4, RTX 20
    "8.0": 166_912,  # A100
    "8.6": 101_376,  # RTX 30, A10, A40
    "8.7": 166_912,  # Jetson Orin
    "8.9": 101_376,  # L4, L40, RTX 40
    "9.0": H100_SMEM_BYTES,  # H100, H200
    "10.0": H100_SMEM_BYTES,  # B200
    "12.0": 101_376,  # RTX 50
}
DEVICE_BUDGETS = (("H100 (sm_90)", H100_SMEM_BYTES), ("A100 (sm_80)", 166_912),
                  ("sm_89 / sm_86", 101_376))

# Candidate (block_q, block_k) pairs, fastest-looking first; every pair is tried at 2 stages
# before any at 1 stage (no pipelining). 3+ stages are not offered: on one H200 (bf16, D = 128,
# S = 8192, docs/benchmarks.md) 3 stages made forward+backward 7.12 ms against 6.49 with "auto".
FORWARD_BLOCKS = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (32, 16), (16, 16))
BACKWARD_BLOCKS = ((64, 64), (32, 64), (64, 32), (32, 32), (16, 32), (32, 16), (16, 16))
STAGES = (2, 1)
# Warps of the backward kernels (dQ, dK/dV) for 16-bit inputs at D >= 128. On an H200 (bf16,
# D = 128, S = 8192, 64x64 blocks, docs/benchmarks.md) the backward took 8.2 ms with 4 warps
# against 18.5 ms with 8 (forward+backward minus forward); the forward is faster with 8 (3.6 ms
# against 6.2). Measured whole on rows with document boundaries: 6.49 ms against 11.23 with 8
# warps everywhere, the fastest of five settings. float32 and other head dims: not yet measured.
BACKWARD_WARPS_16BIT = 4


@dataclasses.dataclass(frozen=True)
class KernelSettings:
  """Triton settings of one kernel (the dQ and dK/dV kernels share theirs).

  Attributes:
    block_q: query block.
    block_k: key/value block.
    num_stages: Triton software-pipeline stages.
    num_warps: Triton warps per program.
  """

  block_q: int
  block_k: int
  num_stages: int
  num_warps: int

  def describe(self) -> str:
    return (f"block_q={self.block_q}, block_k={self.block_k}, num_stages={self.num_stages}, "
            f"num_warps={self.num_warps}")


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(head_dim: int) -> int:
  """The head dim the kernels run with: the next power of two, at least 16."""
  return max(16, next_pow2(head_dim))


def _check_kernel(kernel: str) -> None:
  if kernel not in KERNELS:
    raise AttentionInputError(f"`kernel` must be one of {KERNELS}, got {kernel!r}")


def smem_bytes_needed(*, kernel: str, dtype: Any, head_dim: int, block_q: int, block_k: int,
                      num_stages: int, group: int = 1) -> int:
  """Modelled shared memory (bytes) of one program of `kernel` (see the module docstring).

  Args:
    kernel: "forward", "dq" or "dkv".
    dtype: the dtype of q, k, v.
    head_dim: D; padded here as the kernels pad it.
    block_q: query block.
    block_k: key/value block.
    num_stages: Triton pipeline stages.
    group: G, query heads per kv head (does not change the model, see the module docstring).

  Returns:
    The modelled bytes.
  """
  _check_kernel(kernel)
  del group  # the dK/dV kernel walks its G heads one after another
  tile = padded_head_dim(head_dim) * jnp.dtype(dtype).itemsize  # bytes of one row of a tile
  if kernel in ("forward", "dq"):
    return num_stages * 2 * block_k * tile + SCRATCH_BYTES
  return num_stages * 2 * block_q * tile + 2 * block_k * tile + SCRATCH_BYTES


def smem_limit(compute_capability: str) -> int:
  """Shared memory per block (bytes) of a compute capability such as "9.0".

  Unknown capabilities: a newer major version (10 and up) is assumed to have the H100's
  232,448 bytes (not checked); an unknown older one the smallest known, 65,536.
  """
  cc = str(compute_capability).strip()
  if cc in SMEM_BYTES_BY_CAPABILITY:
    return SMEM_BYTES_BY_CAPABILITY[cc]
  try:
    major = int(cc.split(".")[0])
  except ValueError:
    raise AttentionInputError(
        f"`compute_capability` must look like '9.0', got {compute_capability!r}") from None
  same_major = [v for k, v in SMEM_BYTES_BY_CAPABILITY.items() if k.split(".")[0] == str(major)]
  if same_major:
    return min(same_major)
  return H100_SMEM_BYTES if major >= 10 else min(SMEM_BYTES_BY_CAPABILITY.values())


def device_smem_bytes() -> int:
  """Shared memory per block of the local GPU; an H100's (232,448) when JAX has no GPU.

  Without a GPU (for example when lowering for `cuda` on a CPU machine, or interpret mode) the
  kernels are assumed to target an H100, so the CPU picks the same settings as that GPU.
  """
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
  return smem_limit(cc) if cc else H100_SMEM_BYTES


def default_num_warps(*, head_dim: int, block_q: int, block_k: int, kernel: str = "forward",
                      dtype: Any = jnp.float32) -> int:
  """4 warps for D <= 64 or tiles under 64 rows; 8 for tiles of 64+ rows at D >= 128, except in
  the backward kernels of 16-bit inputs: 4 (`BACKWARD_WARPS_16BIT`)."""
  if padded_head_dim(head_dim) <= 64 or max(block_q, block_k) < 64:
    return 4
  if kernel != "forward" and jnp.dtype(dtype).itemsize == 2:
    return BACKWARD_WARPS_16BIT
  return 8


def _needs(kernels: Sequence[str], s: KernelSettings, *, dtype: Any, head_dim: int,
           group: int) -> dict[str, int]:
  return {k: smem_bytes_needed(kernel=k, dtype=dtype, head_dim=head_dim, block_q=s.block_q,
                               block_k=s.block_k, num_stages=s.num_stages, group=group)
          for k in kernels}


def _refusal(kernels: Sequence[str], s: KernelSettings, *, dtype: Any, head_dim: int,
             group: int, smem_bytes: int, what: str) -> AttentionInputError:
  needs = _needs(kernels, s, dtype=dtype, head_dim=head_dim, group=group)
  over = [k for k in kernels if needs[k] > smem_bytes] or list(kernels)
  parts = "; ".join(f"the {k} kernel needs {needs[k]} bytes" for k in over)
  return AttentionInputError(
      f"segment_attention(implementation='pallas'): {what}: {jnp.dtype(dtype).name}, "
      f"D={head_dim} (padded {padded_head_dim(head_dim)}), {s.describe()}: {parts} (model, "
      f"docs/attention.md), {smem_bytes} available per block")


def _group_of(kernel: str) -> tuple[str, ...]:
  _check_kernel(kernel)
  return ("forward",) if kernel == "forward" else BACKWARD_KERNELS


def check_config(*, kernel: str, settings: KernelSettings, dtype: Any, head_dim: int,
                 group: int = 1, smem_bytes: int | None = None) -> None:
  """Refuses an explicit setting whose modelled shared memory exceeds the limit (no margin).

  Args:
    kernel: "forward", or "dq" / "dkv" (the two share their setting; both are checked).
    settings: the setting.
    dtype: dtype of q, k, v.
    head_dim: D (unpadded).
    group: G.
    smem_bytes: shared memory per block; None: `device_smem_bytes()`.

  Raises:
    AttentionInputError: naming the kernel(s), the setting and both byte counts.
  """
  kernels = _group_of(kernel)
  limit = device_smem_bytes() if smem_bytes is None else smem_bytes
  needs = _needs(kernels, settings, dtype=dtype, head_dim=head_dim, group=group)
  if max(needs.values()) > limit:
    raise _refusal(kernels, settings, dtype=dtype, head_dim=head_dim, group=group,
                   smem_bytes=limit, what="the explicit setting does not fit in shared memory")


def _candidates(*, kernel: str, dtype: Any, head_dim: int, seq_len: int | None,
                block_q: int | Auto, block_k: int | Auto, num_stages: int | Auto,
                num_warps: int | Auto) -> list[KernelSettings]:
  """Ordered candidates, explicit fields substituted, blocks capped by `next_pow2(seq_len)`."""
  cap = max(16, next_pow2(seq_len)) if seq_len else None
  pairs = FORWARD_BLOCKS if kernel == "forward" else BACKWARD_BLOCKS
  out: list[KernelSettings] = []
  for stages in STAGES:
    for bq, bk in pairs:
      bq, bk = (bq if block_q == AUTO else block_q), (bk if block_k == AUTO else block_k)
      if cap:
        bq, bk = min(bq, cap), min(bk, cap)
      s = stages if num_stages == AUTO else num_stages
      w = (default_num_warps(head_dim=head_dim, block_q=bq, block_k=bk, kernel=kernel,
                             dtype=dtype) if num_warps == AUTO
           else num_warps)
      cand = KernelSettings(block_q=bq, block_k=bk, num_stages=s, num_warps=w)
      if cand not in out:
        out.append(cand)
  return out


def resolve(*, kernel: str, dtype: Any, head_dim: int, group: int = 1, seq_len: int | None = None,
            smem_bytes: int | None = None, block_q: int | Auto = AUTO, block_k: int | Auto = AUTO,
            num_stages: int | Auto = AUTO, num_warps: int | Auto = AUTO) -> KernelSettings:
  """The setting of `kernel`: explicit fields kept, "auto" fields from the candidate list.

  Blocks and stages explicit: checked against the limit (`check_config`). Otherwise the first
  candidate (`FORWARD_BLOCKS` or `BACKWARD_BLOCKS` x `STAGES`, explicit fields substituted, in
  that order) whose model is at most `AUTO_MARGIN` x the limit; failing that, the first within
  the limit (explicit fields can force that).

  Args:
    kernel: "forward", or "dq" / "dkv" (one shared backward setting, fitting both).
    dtype: dtype of q, k, v.
    head_dim: D (unpadded).
    group: G.
    seq_len: S; blocks are capped by its next power of two (at least 16). None: no cap.
    smem_bytes: shared memory per block; None: `device_smem_bytes()`.
    block_q: an int, or "auto".
    block_k: an int, or "auto".
    num_stages: an int, or "auto".
    num_warps: an int, or "auto".

  Returns:
    The setting.

  Raises:
    AttentionInputError: explicit blocks and stages that do not fit, or no candidate fits (the
      message names the kernel(s), the setting and both byte counts).
  """
  kernels = _group_of(kernel)
  limit = device_smem_bytes() if smem_bytes is None else smem_bytes
  cands = _candidates(kernel=kernel, dtype=dtype, head_dim=head_dim, seq_len=seq_len,
                      block_q=block_q,
                      block_k=block_k, num_stages=num_stages, num_warps=num_warps)
  if AUTO not in (block_q, block_k, num_stages):  # the warps do not change the model
    check_config(kernel=kernel, settings=cands[0], dtype=dtype, head_dim=head_dim, group=group,
                 smem_bytes=limit)
    return cands[0]
  need = lambda c: max(_needs(kernels, c, dtype=dtype, head_dim=head_dim, group=group).values())
  for bound in (AUTO_MARGIN * limit, limit):
    for cand in cands:
      if need(cand) <= bound:
        return cand
  smallest = min(cands, key=need)
  raise _refusal(kernels, smallest, dtype=dtype, head_dim=head_dim, group=group,
                 smem_bytes=limit,
                 what="no candidate setting fits in shared memory; the least demanding is")


def auto_config(*, kernel: str, dtype: Any, head_dim: int, group: int = 1,
                seq_len: int | None = None, smem_bytes: int | None = None) -> KernelSettings:
  """The all-"auto" setting of `kernel` (see `resolve`); "dq" and "dkv" give the same one."""
  return resolve(kernel=kernel, dtype=dtype, head_dim=head_dim, group=group, seq_len=seq_len,
                 smem_bytes=smem_bytes)


def settings_table(*, smem_bytes: int, dtypes: Sequence[str] = ("float32", "bfloat16",
                                                                "float16"),
                   head_dims: Sequence[int] = (16, 32, 64, 80, 128, 256)) -> str:
  """A markdown table of the auto settings (long sequences) and their modelled bytes."""
  lines = ["| dtype | D | forward | bytes | dQ and dK/dV | dQ bytes | dK/dV bytes |",
           "| --- | ---: | --- | ---: | --- | ---: | ---: |"]
  fmt = lambda s: f"{s.block_q}x{s.block_k}, {s.num_stages} st, {s.num_warps} w"
  for dt in dtypes:
    for d in head_dims:
      fwd = auto_config(kernel="forward", dtype=dt, head_dim=d, smem_bytes=smem_bytes)
      bwd = auto_config(kernel="dkv", dtype=dt, head_dim=d, smem_bytes=smem_bytes)
      f, dq, dkv = (_needs((k,), s, dtype=dt, head_dim=d, group=1)[k]
                    for k, s in (("forward", fwd), ("dq", bwd), ("dkv", bwd)))
      lines.append(f"| {dt} | {d} | {fmt(fwd)} | {f:,} | {fmt(bwd)} | {dq:,} | {dkv:,} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m segpack.attention.resources",
                               description="Auto settings of the Pallas attention kernels.")
  ap.add_argument("--table", action="store_true",
                  help="print markdown tables of the auto settings per device budget")
  ap.add_argument("--smem-bytes", type=int, nargs="*", default=None,
                  help="budgets to tabulate (default: H100, A100, sm_89)")
  args = ap.parse_args(argv)
  if not args.table:
    ap.print_help()
    return 0
  budgets = ([(f"{b} bytes", b) for b in args.smem_bytes] if args.smem_bytes
             else list(DEVICE_BUDGETS))
  for name, budget in budgets:
    print(f"{name}, {budget:,} bytes per block (auto: model <= {AUTO_MARGIN} x that):\n")
    print(settings_table(smem_bytes=budget))
    print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
