"""GPU correctness checks of the attention backends, shared by the `gpu` tests and the report.

`tests/attention/test_gpu.py` (marked `gpu`) and `segpack bench gpu-report` run the same checks, on the
grid and the rows of `segpack.bench.gpu_cases` (the cuDNN memory check is
`segpack.bench.gpu_memory`'s):

1. `gpu_cases.case_for`: the segment ids of a grid point: rows of a real first-fit-decreasing
   packing plan and edge rows (one document filling the row; length-1 segments, a padding gap
   and a padding tail; all padding).
2. `make_yardstick`: random inputs rounded to the dtype; the float32 reference ON THE DEVICE (the
   XLA dense-mask backend in float32 under `jax.default_matmul_precision("highest")`, so that
   TF32 does not enter it) for the output and, through `jax.vjp` with a fixed random cotangent
   that is zero at padding, for dq, dk and dv; and the errors of the XLA backend at that dtype.
3. `check_backend`: the errors of a backend at that dtype, judged against XLA's.

Errors, for each of out, dq, dk, dv, over the non-padding slots (query slots for out and dq, key
slots for dk and dv):

- `error`: the relative error `||x - ref|| / ||ref||`;
- `worst_slot`: `max_s ||x_s - ref_s||` over slots `s`, divided by the root mean square of
  `||ref_s||`; it catches a bug confined to a few slots (a length-1 segment, a block edge) that
  the norm over 10^7 values would average away;
- `pad_max_abs`: `max |x|` at padding slots (a non-finite value counts as infinite).

The differences and the per-slot sums of squares (over heads x head dim, at most 1,024 terms)
are computed on the device in float32; the sums over slots and the ratios in float64 on the host.
Copying the tensors themselves to the host would move about 100 GB over the full grid.

Tolerance rule: a backend passes when, for every tensor,

- `error <= 1.5 x XLA's error at that dtype + floor`,
- `worst_slot <= 3 x XLA's worst_slot + 16 x floor`,
- `pad_max_abs == 0` exactly: padding outputs are zeros, and padding queries and keys get zero
  gradients (XLA's are exactly 0; a non-zero dk or dv at a padding key would reach the weights).

Floors (`ERROR_FLOORS`): 2^-12 for bfloat16 and 2^-15 for float16, 1/16 of the format's unit
roundoff and about a tenth of XLA's own error (bf16: 0.0023 on an H100), so they only matter if
XLA's error were near zero. float32: 5e-6, about 80 units of float32 roundoff. The reference is
exact float32 ("highest"); the backends run at the default precision, which on Ampere and Hopper
lets XLA's f32 dots, and makes Triton's f32 `dot` (Pallas `jnp.dot`), round their inputs to TF32
(unit roundoff 2^-11): XLA's error is then of that order and the factor 1.5 does the work. Where XLA
computes in exact float32 (on the CPU its error is 0), the floor admits another summation order
(the online softmax rescales once per key block; Pallas in interpret mode: error 5.7e-7 at
S = 1000) and nothing else: a backend that rounds to TF32 while XLA does not fails on purpose,
as it loses precision the caller did not ask for. A slot's norm sums at most 1,024 values, so its
roundoff is larger against the RMS: the worst-slot floor is 16 x (Pallas f32 interpreted at
S = 1000: 5.0e-6). A real bug (a wrong mask, scale or skipped block) moves the values it touches
by O(1) relative, far above any floor.

Unsupported configurations (`CudnnUnavailableError`: cuDNN takes no float32, some head dims, no
CPU) are recorded as `"unsupported: <reason>"`; any other exception is a failure with its message.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from segpack.attention import PallasOptions, segment_attention
from segpack.attention.cudnn import CudnnUnavailableError
from segpack.bench.gpu_cases import DTYPES, Case, GridPoint
from segpack.errors import ArgumentError

TENSORS = ("out", "dq", "dk", "dv")
ERROR_FACTOR = 1.5
WORST_SLOT_FACTOR = 3.0
ERROR_FLOORS = {"float32": 5e-6, "bfloat16": 2.0**-12, "float16": 2.0**-15}
WORST_SLOT_FLOOR_FACTOR = 16.0
# XLA's GEMM autotuning would run (and allocate) on the GPU during every compile; the checks
# compare numerics, so the default GEMM configurations do.
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def cuda_skip_reason() -> str | None:
  """Why the GPU checks cannot run here (no CUDA GPU as JAX's default backend), or None."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  env = f" (JAX_PLATFORMS={platforms!r})" if platforms else ""
  try:
    backend = jax.default_backend()
  except Exception as e:  # pylint: disable=broad-except  # JAX_PLATFORMS=cuda without a GPU
    return f"needs a CUDA GPU: JAX starts no backend{env}: {describe_error(e)}"
  if backend != "gpu":
    return f"needs a CUDA GPU: jax.default_backend() is {backend!r}{env}"
  version = jax.devices()[0].client.platform_version
  if "cuda" not in version.lower():
    return f"needs a CUDA GPU: the GPU platform is {version!r}"
  return None


@dataclasses.dataclass(frozen=True)
class Attention:
  """`segment_attention` with static settings; hashable, so a program's key can name it."""

  implementation: str
  causal: bool
  pallas: PallasOptions | None = None
  cudnn_segment_bound: int | None = None

  def __call__(self, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS):
    return segment_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS,
                             causal=self.causal, implementation=self.implementation,
                             pallas=self.pallas, cudnn_segment_bound=self.cudnn_segment_bound)


def backend_attention(implementation: str, case: Case, *, causal: bool,
                      interpret: bool = False) -> Attention:
  """The `Attention` a check runs: Pallas interpreted with `interpret`, cuDNN with the case's N."""
  pallas = PallasOptions(interpret=True) if interpret and implementation == "pallas" else None
  bound = case.cudnn_segment_bound if implementation == "cudnn" else None
  return Attention(implementation=implementation, causal=causal, pallas=pallas,
                   cudnn_segment_bound=bound)


# A program is `(key, fn, abstract args)`; a `Compile` turns it into an executable. The report
# compiles ahead, in threads, and hands its futures back through the key.
Program = tuple[tuple, Callable[..., Any], tuple]
Compile = Callable[[tuple, Callable[..., Any], tuple], Any]


def compile_now(key: tuple, fn: Callable[..., Any], args: tuple) -> Any:
  """Lowers and compiles `fn` for `args` (abstract shapes) now."""
  del key
  return jax.jit(fn).lower(*args).compile(compiler_options=COMPILER_OPTIONS)


def vjp_all(attn: Callable[..., jax.Array], q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS,
             dout_BxSxHxD):
  """`(out, dq, dk, dv)` of `attn` for the cotangent `dout`."""
  out_BxSxHxD, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, segment_ids_BxS), q_BxSxHxD,
                             k_BxSxKxD, v_BxSxKxD)
  return (out_BxSxHxD, *vjp(dout_BxSxHxD))


def abstract_inputs(case: Case, dtype: Any) -> tuple:
  """Abstract `(q, k, v, segment_ids, dout)` of a case at `dtype`."""
  b, s, h, kh, d = case.shape
  sd = jax.ShapeDtypeStruct
  return (sd((b, s, h, d), dtype), sd((b, s, kh, d), dtype), sd((b, s, kh, d), dtype),
          sd((b, s), jnp.int32), sd((b, s, h, d), dtype))


def _reference_fn(causal: bool, *args):
  with jax.default_matmul_precision("highest"):  # entered while tracing: no TF32 in any dot
    return vjp_all(Attention("xla", causal), *args)


def reference_program(case: Case, *, causal: bool) -> Program:
  """The float32 reference: `(q, k, v, segment_ids, dout) -> (out, dq, dk, dv)`."""
  return (("reference", case.shape, causal), functools.partial(_reference_fn, causal),
          abstract_inputs(case, jnp.float32))


def _slot_stats(x_BxSxHxD, ref_BxSxHxD, valid_BxS):
  """Per-slot squared error and squared reference over (heads, D), and max |x| at padding.

  The heads axis is H for out and dq, K for dk and dv.
  """
  x_BxSxHxD = x_BxSxHxD.astype(jnp.float32)
  sq_err_BxS = jnp.sum(jnp.square(x_BxSxHxD - ref_BxSxHxD), axis=(2, 3))
  sq_ref_BxS = jnp.sum(jnp.square(ref_BxSxHxD), axis=(2, 3))
  size_BxSxHxD = jnp.where(jnp.isfinite(x_BxSxHxD), jnp.abs(x_BxSxHxD), jnp.inf)
  pad_max = jnp.max(jnp.where(valid_BxS[:, :, None, None], 0.0, size_BxSxHxD))
  return jnp.where(valid_BxS, sq_err_BxS, 0.0), jnp.where(valid_BxS, sq_ref_BxS, 0.0), pad_max


def _compare_fn(attn: Attention, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, dout_BxSxHxD,
                *refs):
  got = vjp_all(attn, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, dout_BxSxHxD)
  return tuple(_slot_stats(x, ref, segment_ids_BxS != 0) for x, ref in zip(got, refs))


def compare_program(attn: Attention, case: Case, dtype: str) -> Program:
  """`attn` at `dtype`, forward and vjp, reduced against the reference to per-slot sums."""
  ref = jax.ShapeDtypeStruct
  b, s, h, kh, d = case.shape
  refs = (ref((b, s, h, d), jnp.float32), ref((b, s, h, d), jnp.float32),
          ref((b, s, kh, d), jnp.float32), ref((b, s, kh, d), jnp.float32))
  return (("compare", attn, dtype, case.shape), functools.partial(_compare_fn, attn),
          abstract_inputs(case, DTYPES[dtype]) + refs)


@functools.partial(jax.jit, static_argnames=("q_shape", "kv_shape"))
def _draw(key, segment_ids_BxS, *, q_shape, kv_shape):
  """Standard normal q, k, v and cotangent (zero at padding), float32."""
  kq, kk, kv, kd = jax.random.split(key, 4)
  valid_BxSx1x1 = (segment_ids_BxS != 0)[:, :, None, None]
  dout_BxSxHxD = jnp.where(valid_BxSx1x1, jax.random.normal(kd, q_shape, jnp.float32), 0.0)
  return (jax.random.normal(kq, q_shape, jnp.float32),
          jax.random.normal(kk, kv_shape, jnp.float32),
          jax.random.normal(kv, kv_shape, jnp.float32), dout_BxSxHxD)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _round(xs, *, dtype):
  """`xs` in `dtype`, and those values back in float32 (the reference's exact inputs)."""
  rounded = tuple(x.astype(dtype) for x in xs)
  return rounded, tuple(x.astype(jnp.float32) for x in rounded)


def summarize_stats(stats, segment_ids_BxS: np.ndarray) -> dict[str, dict[str, Any]]:
  """Host side, float64: per tensor `error`, `worst_slot`, `pad_max_abs` and `row_errors`.

  Args:
    stats: per tensor `(sq_err_BxS, sq_ref_BxS, pad_max)` from a compare program.
    segment_ids_BxS: the case's segment ids (the slots that count: non-zero).
  """
  slots = max(1, int(np.count_nonzero(segment_ids_BxS)))
  result = {}
  for name, (sq_err, sq_ref, pad_max) in zip(TENSORS, stats):
    sq_err, sq_ref = np.asarray(sq_err, np.float64), np.asarray(sq_ref, np.float64)
    err_rows, ref_rows = sq_err.sum(axis=1), sq_ref.sum(axis=1)
    rms_ref = np.sqrt(ref_rows.sum() / slots)
    result[name] = dict(
        error=float(np.sqrt(err_rows.sum() / ref_rows.sum())),
        worst_slot=float(np.sqrt(sq_err.max()) / rms_ref),
        pad_max_abs=float(pad_max),
        row_errors=[float(np.sqrt(e / r)) if r > 0 else None
                    for e, r in zip(err_rows, ref_rows)])
  return result


@dataclasses.dataclass(frozen=True, eq=False)
class Yardstick:
  """Inputs, float32 reference and XLA's errors for one (case, dtype, causal).

  Attributes:
    case: the case.
    dtype: the inputs' dtype name.
    causal: causal attention.
    inputs: `(q, k, v, segment_ids, dout)` on the device, q/k/v/dout in `dtype`.
    reference: `(out, dq, dk, dv)` float32 on the device.
    xla: `summarize_stats` of the XLA backend at `dtype`.
    error: why the reference or XLA could not be computed (then the rest is None).
  """

  case: Case
  dtype: str
  causal: bool
  inputs: tuple | None = None
  reference: tuple | None = None
  xla: dict[str, dict[str, Any]] | None = None
  error: str | None = None


def make_yardstick(*, case: Case, dtype: str, causal: bool,
                   compiler: Compile = compile_now) -> Yardstick:
  """Random inputs rounded to `dtype`, the float32 reference and XLA's errors; never raises."""
  try:
    b, s, h, kh, d = case.shape
    seg = jnp.asarray(case.segment_ids)
    drawn = _draw(jax.random.key(case.seed), seg, q_shape=(b, s, h, d), kv_shape=(b, s, kh, d))
    (q, k, v, dout), as_f32 = _round(drawn, dtype=DTYPES[dtype])
    ref_exe = compiler(*reference_program(case, causal=causal))
    reference = tuple(ref_exe(as_f32[0], as_f32[1], as_f32[2], seg, as_f32[3]))
    inputs = (q, k, v, seg, dout)
    xla_exe = compiler(*compare_program(Attention("xla", causal), case, dtype))
    xla = summarize_stats(xla_exe(*inputs, *reference), case.segment_ids)
  except Exception as e:  # pylint: disable=broad-except
    return Yardstick(case=case, dtype=dtype, causal=causal,
                     error=f"reference or XLA: {describe_error(e)}")
  return Yardstick(case=case, dtype=dtype, causal=causal, inputs=inputs, reference=reference,
                   xla=xla)


def describe_error(e: BaseException) -> str:
  """`Type: first line of the message` (at most 300 characters)."""
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def judge(got: dict[str, dict[str, Any]], xla: dict[str, dict[str, Any]], *, dtype: str
          ) -> tuple[dict[str, dict[str, float]], list[str]]:
  """The tolerances of the rule in the module docstring (`{"error": {tensor: tol},
  "worst_slot": {tensor: tol}}`), and every way `got` breaks them."""
  floor = ERROR_FLOORS[dtype]
  tolerances: dict[str, dict[str, float]] = {"error": {}, "worst_slot": {}}
  failures = []
  for t in TENSORS:
    tol = ERROR_FACTOR * xla[t]["error"] + floor
    tol_slot = WORST_SLOT_FACTOR * xla[t]["worst_slot"] + WORST_SLOT_FLOOR_FACTOR * floor
    tolerances["error"][t], tolerances["worst_slot"][t] = tol, tol_slot
    if not got[t]["error"] <= tol:
      failures.append(f"{t}: relative error {got[t]['error']:.3g} > {tol:.3g} "
                      f"({ERROR_FACTOR} x XLA {xla[t]['error']:.3g} + {floor:.3g})")
    if not got[t]["worst_slot"] <= tol_slot:
      failures.append(f"{t}: worst slot {got[t]['worst_slot']:.3g} > {tol_slot:.3g} "
                      f"({WORST_SLOT_FACTOR} x XLA {xla[t]['worst_slot']:.3g} + "
                      f"{WORST_SLOT_FLOOR_FACTOR * floor:.3g})")
    if got[t]["pad_max_abs"] != 0:
      failures.append(f"{t}: {got[t]['pad_max_abs']:.3g} at padding slots, must be exactly 0")
  return tolerances, failures


def _heads_label(case: Case) -> str:
  return "mha" if case.num_heads == case.num_kv_heads else "gqa"


def _record(implementation: str, case: Case, *, dtype: str, causal: bool) -> dict[str, Any]:
  b, s, h, kh, d = case.shape
  point = GridPoint(implementation=implementation, dtype=dtype, head_dim=d, seq_len=s,
                    heads=_heads_label(case), causal=causal)
  rec = dict(id=point.id, implementation=implementation, dtype=dtype, seq_len=s, head_dim=d,
             batch=b, num_heads=h, num_kv_heads=kh, causal=causal, rows=list(case.row_kinds))
  if implementation == "cudnn":
    rec["cudnn_segment_bound"] = case.cudnn_segment_bound
  return rec


def check_backend(*, implementation: str, case: Case, dtype: str, causal: bool,
                  interpret: bool = False, yardstick: Yardstick | None = None,
                  compiler: Compile = compile_now) -> dict[str, Any]:
  """Checks one backend on one case; never raises (errors become `failed`/`unsupported`).

  Args:
    implementation: `"pallas"`, `"cudnn"` (or `"xla"`, which then checks itself).
    case: the rows and head layout.
    dtype: `"float32"`, `"bfloat16"` or `"float16"`.
    causal: causal attention.
    interpret: run Pallas in interpret mode (CPU).
    yardstick: this (case, dtype, causal)'s yardstick, to share it between backends (default:
      made now).
    compiler: turns a program into an executable (default `compile_now`).

  Returns:
    A JSON-ready record: the point (`id`, sizes, `rows`), `status` (`"passed"`, `"failed"` or
    `"unsupported: <reason>"`), `failures`, and when it ran: the backend's `errors`,
    `worst_slot`, `pad_max_abs` and `row_errors` per tensor, the `tolerance` per tensor, XLA's
    figures under `xla`; and `seconds`.

  Raises:
    ValueError: `yardstick` was made for another case, dtype or causality.
  """
  t0 = time.perf_counter()
  if yardstick is not None and (yardstick.case, yardstick.dtype, yardstick.causal) != (
      case, dtype, causal):
    raise ArgumentError(f"check_backend: `yardstick` is for dtype={yardstick.dtype!r}, causal="
                     f"{yardstick.causal}, another case; the check is for dtype={dtype!r}, "
                     f"causal={causal}")
  rec = _record(implementation, case, dtype=dtype, causal=causal)
  yard = yardstick or make_yardstick(case=case, dtype=dtype, causal=causal, compiler=compiler)
  if yard.error is not None:
    rec.update(status="failed", failures=[yard.error], seconds=time.perf_counter() - t0)
    return rec
  attn = backend_attention(implementation, case, causal=causal, interpret=interpret)
  try:
    exe = compiler(*compare_program(attn, case, dtype))
    got = summarize_stats(exe(*yard.inputs, *yard.reference), case.segment_ids)
  except CudnnUnavailableError as e:
    rec.update(status=f"unsupported: {describe_error(e)}", failures=[])
  except Exception as e:  # pylint: disable=broad-except
    rec.update(status="failed", failures=[describe_error(e)])
  else:
    tolerance, failures = judge(got, yard.xla, dtype=dtype)
    rec.update(status="failed" if failures else "passed", failures=failures, tolerance=tolerance,
               errors={t: got[t]["error"] for t in TENSORS})
    for field in ("worst_slot", "pad_max_abs", "row_errors"):
      rec[field] = {t: got[t][field] for t in TENSORS}
  rec["xla"] = {f: {t: yard.xla[t][f] for t in TENSORS} for f in ("error", "worst_slot",
                                                                   "pad_max_abs")}
  rec["seconds"] = time.perf_counter() - t0
  return rec
