"""GPU correctness checks of the attention backends, shared by the `gpu` tests and the report.

`tests/test_gpu.py` (marked `gpu`) and `segpack bench gpu-report` run the same checks:

1. `make_case`: the segment ids of a grid point: rows of a real first-fit-decreasing packing plan
   (`segpack.packing.plan`, lognormal document lengths of mean 800, documents longer than S
   split) and edge rows (one document filling the row; length-1 segments, a padding gap and a
   padding tail; all padding).
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

from segpack.attention import segment_attention
from segpack.attention.cudnn import CudnnUnavailableError
from segpack.attention.resources import next_pow2
from segpack.bench.attention import packed_rows

TENSORS = ("out", "dq", "dk", "dv")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
NUM_HEADS = 4
GROUPS = {"mha": 1, "gqa": 4}  # query heads per kv head: H = K, or H = 4 K
ERROR_FACTOR = 1.5
WORST_SLOT_FACTOR = 3.0
ERROR_FLOORS = {"float32": 5e-6, "bfloat16": 2.0**-12, "float16": 2.0**-15}
WORST_SLOT_FLOOR_FACTOR = 16.0
PACKED_ROWS = 2
MIN_MAX_SEGMENTS = 32
# cuDNN backward workspace, bytes per element of B x N x H x S x D: 516 GiB at B=2, N=S=4096,
# H=16, K=4, D=128 (8.06); 66 GiB at H=K=8, D=64 (4.1).
CUDNN_BYTES_PER_ELEMENT = 8.06
# XLA's GEMM autotuning would run (and allocate) on the GPU during every compile; the checks
# compare numerics, so the default GEMM configurations do.
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


@dataclasses.dataclass(frozen=True)
class GridAxes:
  """The values every axis of a check grid takes."""

  implementations: tuple[str, ...] = ("pallas", "cudnn")
  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  head_dims: tuple[int, ...] = (64, 80, 128, 256)
  seq_lens: tuple[int, ...] = (1000, 4096, 8192)
  heads: tuple[str, ...] = ("mha", "gqa")
  causal: tuple[bool, ...] = (True, False)


FULL_GRID = GridAxes()
QUICK_GRID = GridAxes(dtypes=("float32", "bfloat16"), head_dims=(80, 128),
                      seq_lens=(1000, 4096), heads=("gqa",))
# Pallas in interpret mode: a CPU run proves the code path, not the numbers.
CPU_GRID = GridAxes(dtypes=("bfloat16",), head_dims=(80,), seq_lens=(200,), heads=("gqa",),
                    causal=(True,))


@dataclasses.dataclass(frozen=True)
class GridPoint:
  """One check: a backend at a dtype, head dim, sequence length, head layout and causality."""

  implementation: str
  dtype: str
  head_dim: int
  seq_len: int
  heads: str
  causal: bool

  @property
  def id(self) -> str:
    """A readable test id, e.g. `pallas-bf16-D128-S4096-gqa-causal`."""
    return (f"{self.implementation}-{SHORT_DTYPES[self.dtype]}-D{self.head_dim}-S{self.seq_len}-"
            f"{self.heads}-{'causal' if self.causal else 'full'}")

  @property
  def group(self) -> tuple:
    """Everything but the backend: points with the same group share one yardstick."""
    return (self.seq_len, self.head_dim, self.heads, self.causal, self.dtype)


def grid(axes: GridAxes = FULL_GRID) -> list[GridPoint]:
  """Every point of `axes`; the backend varies fastest, then dtype, so yardsticks are shared."""
  return [GridPoint(implementation=impl, dtype=dtype, head_dim=d, seq_len=s, heads=heads,
                    causal=causal)
          for s in axes.seq_lens for d in axes.head_dims for heads in axes.heads
          for causal in axes.causal for dtype in axes.dtypes for impl in axes.implementations]


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
  """Segment ids and head layout of one grid point.

  Attributes:
    segment_ids: int32 `[B, S]`, 0 = padding.
    row_kinds: what each row is.
    num_heads: H.
    num_kv_heads: K.
    head_dim: D.
    seed: seeds the rows and the random inputs.
  """

  segment_ids: np.ndarray
  row_kinds: tuple[str, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  seed: int

  @property
  def shape(self) -> tuple[int, int, int, int, int]:
    """`(B, S, H, K, D)`."""
    b, s = self.segment_ids.shape
    return b, s, self.num_heads, self.num_kv_heads, self.head_dim

  @property
  def max_segments_per_row(self) -> int:
    """cuDNN's static N: a power of two >= 32 and >= every row's segments plus padding runs."""
    runs = max(_count_runs(row) for row in self.segment_ids)
    return max(MIN_MAX_SEGMENTS, next_pow2(runs))


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


def _count_runs(row: np.ndarray) -> int:
  """Runs of equal ids in a row, padding runs included."""
  return int(np.count_nonzero(np.diff(row))) + 1


def edge_rows(seq_len: int) -> tuple[np.ndarray, tuple[str, ...]]:
  """Hand-made rows: one document filling the row; length-1 segments, other short documents, a
  padding gap, a long document and a padding tail (ids descending: ids need not be ordered); all
  padding. `seq_len` >= 64.
  """
  if seq_len < 64:
    raise ValueError(f"edge_rows: seq_len must be >= 64, got {seq_len}")
  rows = np.zeros((3, seq_len), np.int32)
  rows[0] = 1
  tail, gap = max(1, seq_len // 10), 5
  pieces, pos = [], 0
  for n in [1] * 8 + [3, 50, 100, 1, 37]:
    if pos + n > seq_len // 2:
      break
    pieces.append((pos, n))
    pos += n
  pieces.append((pos + gap, seq_len - tail - pos - gap))
  for i, (start, n) in enumerate(pieces):
    rows[1, start:start + n] = len(pieces) - i
  kinds = ("one document", "length-1 segments, padding gap and tail", "all padding")
  return rows, kinds


def make_case(*, seq_len: int, head_dim: int, num_heads: int = NUM_HEADS,
              num_kv_heads: int = NUM_HEADS, seed: int = 0) -> Case:
  """`PACKED_ROWS` rows of a real FFD packing plan, then the `edge_rows`."""
  packed, source = packed_rows(seq_len, num_rows=PACKED_ROWS, mean=800.0, sigma=1.0, seed=seed)
  edges, edge_kinds = edge_rows(seq_len)
  return Case(segment_ids=np.concatenate([packed, edges]).astype(np.int32),
              row_kinds=(f"packed ({source})",) * PACKED_ROWS + edge_kinds, num_heads=num_heads,
              num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed)


def case_for(point: GridPoint, *, seed: int = 0) -> Case:
  """The case of a grid point: H = `NUM_HEADS`, K = H / `GROUPS[point.heads]`."""
  return make_case(seq_len=point.seq_len, head_dim=point.head_dim, num_heads=NUM_HEADS,
                   num_kv_heads=NUM_HEADS // GROUPS[point.heads], seed=seed)


@dataclasses.dataclass(frozen=True)
class Attention:
  """`segment_attention` with static settings; hashable, so a program's key can name it."""

  implementation: str
  causal: bool
  interpret: bool = False
  max_segments_per_row: int | None = None

  def __call__(self, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS):
    kwargs: dict[str, Any] = {}
    if self.implementation == "pallas":
      kwargs["interpret"] = self.interpret
    if self.implementation == "cudnn":
      kwargs["max_segments_per_row"] = self.max_segments_per_row
    return segment_attention(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS,
                             causal=self.causal, implementation=self.implementation, **kwargs)


def backend_attention(implementation: str, case: Case, *, causal: bool,
                      interpret: bool = False) -> Attention:
  """The `Attention` a check runs: Pallas interpreted on the CPU, cuDNN with the case's N."""
  n = case.max_segments_per_row if implementation == "cudnn" else None
  return Attention(implementation=implementation, causal=causal,
                   interpret=interpret and implementation == "pallas", max_segments_per_row=n)


# A program is `(key, fn, abstract args)`; a `Compile` turns it into an executable. The report
# compiles ahead, in threads, and hands its futures back through the key.
Program = tuple[tuple, Callable[..., Any], tuple]
Compile = Callable[[tuple, Callable[..., Any], tuple], Any]


def compile_now(key: tuple, fn: Callable[..., Any], args: tuple) -> Any:
  """Lowers and compiles `fn` for `args` (abstract shapes) now."""
  del key
  return jax.jit(fn).lower(*args).compile(compiler_options=COMPILER_OPTIONS)


def _vjp_all(attn: Callable[..., jax.Array], q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS,
             dout_BxSxHxD):
  """`(out, dq, dk, dv)` of `attn` for the cotangent `dout`."""
  out_BxSxHxD, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, segment_ids_BxS), q_BxSxHxD,
                             k_BxSxKxD, v_BxSxKxD)
  return (out_BxSxHxD, *vjp(dout_BxSxHxD))


def _abstract(case: Case, dtype: Any) -> tuple:
  b, s, h, kh, d = case.shape
  sd = jax.ShapeDtypeStruct
  return (sd((b, s, h, d), dtype), sd((b, s, kh, d), dtype), sd((b, s, kh, d), dtype),
          sd((b, s), jnp.int32), sd((b, s, h, d), dtype))


def _reference_fn(causal: bool, *args):
  with jax.default_matmul_precision("highest"):  # entered while tracing: no TF32 in any dot
    return _vjp_all(Attention("xla", causal), *args)


def reference_program(case: Case, *, causal: bool) -> Program:
  """The float32 reference: `(q, k, v, segment_ids, dout) -> (out, dq, dk, dv)`."""
  return (("reference", case.shape, causal), functools.partial(_reference_fn, causal),
          _abstract(case, jnp.float32))


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
  got = _vjp_all(attn, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, dout_BxSxHxD)
  return tuple(_slot_stats(x, ref, segment_ids_BxS != 0) for x, ref in zip(got, refs))


def compare_program(attn: Attention, case: Case, dtype: str) -> Program:
  """`attn` at `dtype`, forward and vjp, reduced against the reference to per-slot sums."""
  ref = jax.ShapeDtypeStruct
  b, s, h, kh, d = case.shape
  refs = (ref((b, s, h, d), jnp.float32), ref((b, s, h, d), jnp.float32),
          ref((b, s, kh, d), jnp.float32), ref((b, s, kh, d), jnp.float32))
  return (("compare", attn, dtype, case.shape), functools.partial(_compare_fn, attn),
          _abstract(case, DTYPES[dtype]) + refs)


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
    rec["max_segments_per_row"] = case.max_segments_per_row
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
    raise ValueError(f"check_backend: `yardstick` is for dtype={yardstick.dtype!r}, causal="
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


def cudnn_memory_check(*, batch: int = 2, seq_len: int = 4096, num_heads: int = 16,
                       num_kv_heads: int = 4, head_dim: int = 128, max_segments_per_row: int = 32,
                       dtype: str = "bfloat16", compiler: Compile = compile_now
                       ) -> dict[str, Any]:
  """cuDNN forward+backward temp memory at N and 2N against the workspace model.

  Model: `CUDNN_BYTES_PER_ELEMENT` (8.06) bytes per element of B x N x H x S x D, plus the
  arrays besides the workspace: out and dq and one more query-sized array (the unmasked output
  or the cotangent), dk and dv, and the float32 softmax statistics `[B, H, S]`. Passes when the
  temp bytes at N stay within the model and the growth from N to 2N, per added element, within
  8.06 bytes. Never raises.
  """
  rec: dict[str, Any] = dict(
      check="cudnn_memory", batch=batch, seq_len=seq_len, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
      max_segments_per_row=max_segments_per_row, bytes_per_element_max=CUDNN_BYTES_PER_ELEMENT)
  elements = batch * max_segments_per_row * num_heads * seq_len * head_dim
  item = jnp.dtype(DTYPES[dtype]).itemsize
  q_bytes = batch * seq_len * num_heads * head_dim * item
  kv_bytes = batch * seq_len * num_kv_heads * head_dim * item
  non_workspace = 3 * q_bytes + 2 * kv_bytes + 4 * batch * num_heads * seq_len
  case = Case(segment_ids=np.zeros((batch, seq_len), np.int32), row_kinds=(), seed=0,
              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
  temps = {}
  try:
    for n in (max_segments_per_row, 2 * max_segments_per_row):
      attn = Attention("cudnn", causal=True, max_segments_per_row=n)
      args = _abstract(case, DTYPES[dtype])
      stats = compiler(("cudnn_memory", attn, dtype, case.shape),
                      functools.partial(_vjp_all, attn), args).memory_analysis()
      if stats is None:
        raise RuntimeError("compiled.memory_analysis() returned None")
      temps[n] = int(stats.temp_size_in_bytes)
  except CudnnUnavailableError as e:
    return dict(rec, status=f"unsupported: {describe_error(e)}", failures=[])
  except Exception as e:  # pylint: disable=broad-except
    return dict(rec, status="failed", failures=[describe_error(e)])
  temp, temp_2n = temps[max_segments_per_row], temps[2 * max_segments_per_row]
  model = CUDNN_BYTES_PER_ELEMENT * elements + non_workspace
  slope = (temp_2n - temp) / elements
  failures = []
  if temp > model:
    failures.append(f"temp bytes {temp:,} > model {model:,.0f}")
  if slope > CUDNN_BYTES_PER_ELEMENT:
    failures.append(f"temp bytes grow by {slope:.3f} per B*N*H*S*D element from N to 2N, more "
                    f"than {CUDNN_BYTES_PER_ELEMENT}")
  return dict(rec, status="failed" if failures else "passed", failures=failures,
              workspace_elements=elements, non_workspace_bytes=non_workspace, model_bytes=model,
              temp_bytes=temp, temp_bytes_2n=temp_2n, bytes_per_element_growth=slope,
              implied_bytes_per_element=(temp - non_workspace) / elements)
