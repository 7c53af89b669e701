"""A startup leak check (`self_check`): a backend against per-document XLA runs on a packed batch.

A backend that lets a token see another document of its row (forward), or that routes gradient
across documents (backward only), trains without any error and quietly hurts the model. The
trainer runs `self_check` with its configured backend before the first step.

Algorithm:
  1. Build a fixed packed batch `[2, 128]` (documents of lengths 1 to 70, some crossing the 64-slot
     block boundary, padding between documents and as a tail) and random `q`, `k`, `v` (GQA, H=4,
     K=2, D=16) and an output cotangent, from a fixed seed.
  2. Run the backend under `jax.jit` and take `out` and `dq, dk, dv` with `jax.vjp`.
  3. Oracle: every document alone (its own `q, k, v` slice, at the start of its own row, one
     segment, plain causal mask) through the XLA backend in float32 on the CPU (where JAX has its
     CPU platform), scattered back; padding slots get zeros. Computed once per dtype and seed.
  4. Compare each tensor; the first one whose worst error exceeds the dtype's tolerance raises
     `AttentionLeakError` naming the backend, the tensor, the row, slot, document and head.

Example: `self_check(implementation="pallas", pallas=PallasOptions(interpret=True))` on a CPU
takes a few seconds and returns the worst errors (~1e-6 in float32).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from segpack.attention import dispatch
from segpack.attention import xla as xla_lib
from segpack.attention.checks import AttentionInputError
from segpack.attention.pallas import PallasOptions

# The probe batch: per row, runs of (segment id, length); id 0 is padding. Each row is 128 slots.
PROBE_ROWS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((1, 1), (2, 37), (3, 5), (4, 1), (5, 50), (6, 20), (0, 14)),
    ((1, 70), (2, 1), (0, 3), (3, 9), (4, 1), (5, 30), (0, 14)),
)
PROBE_HEADS, PROBE_KV_HEADS, PROBE_HEAD_DIM = 4, 2, 16
# The probe's `cudnn_segment_bound`: a power of two above the segments (and padding runs) of
# each of its rows.
PROBE_CUDNN_SEGMENT_BOUND = 16
TENSORS = ("out", "dq", "dk", "dv")
# Worst absolute error allowed (inputs are unit normals): (output, gradients), per dtype.
TOLERANCES = {
    "float32": (1e-4, 1e-3),
    "float16": (1e-2, 5e-2),
    "bfloat16": (5e-2, 1e-1),
}

Backend = Callable[..., jax.Array]  # (q, k, v, segment_ids, *, causal, scale) -> out


class AttentionLeakError(RuntimeError):
  """An attention backend's output or gradient differs from every document attended alone."""


@dataclasses.dataclass(frozen=True)
class SelfCheckResult:
  """What a passing `self_check` measured.

  Attributes:
    implementation: the backend's name (a callable's `__name__`).
    dtype: the dtype of `q`, `k`, `v`.
    max_errors: worst absolute error of `out`, `dq`, `dk`, `dv` against the oracle.
    seconds: wall time of the whole check (compilation included).
  """

  implementation: str
  dtype: str
  max_errors: dict[str, float]
  seconds: float


def probe_segment_ids() -> np.ndarray:
  """The probe batch's int32 `[2, 128]` segment ids (from `PROBE_ROWS`)."""
  rows = [np.concatenate([np.full(n, sid, np.int32) for sid, n in runs]) for runs in PROBE_ROWS]
  return np.stack(rows)


def _documents() -> list[tuple[int, int, int]]:
  """`(row, start, end)` of every non-padding run of the probe batch."""
  docs = []
  for row, runs in enumerate(PROBE_ROWS):
    pos = 0
    for sid, n in runs:
      if sid != 0:
        docs.append((row, pos, pos + n))
      pos += n
  return docs


def _probe_inputs(dtype: Any, seed: int) -> tuple[jax.Array, ...]:
  b, s = probe_segment_ids().shape
  rng = np.random.default_rng(seed)
  shapes = ((b, s, PROBE_HEADS, PROBE_HEAD_DIM), (b, s, PROBE_KV_HEADS, PROBE_HEAD_DIM),
            (b, s, PROBE_KV_HEADS, PROBE_HEAD_DIM), (b, s, PROBE_HEADS, PROBE_HEAD_DIM))
  return tuple(jnp.asarray(np.asarray(rng.standard_normal(shape), jnp.dtype(dtype)))
               for shape in shapes)


def _fwd_bwd(fn: Backend, scale: float) -> Callable[..., tuple[jax.Array, ...]]:
  def run(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxS, dout_BxSxHxD):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids_BxS, causal=True, scale=scale),
                       q_BxSxHxD, k_BxSxKxD, v_BxSxKxD)
    return (out, *vjp(dout_BxSxHxD))
  return run


def _cpu_devices() -> list[Any]:
  """This process's CPU devices; none where JAX runs without its CPU platform."""
  try:
    return jax.local_devices(backend="cpu")
  except RuntimeError:
    return []


def _oracle(q_BxSxHxD, k_BxSxKxD, v_BxSxKxD, dout_BxSxHxD, *, scale: float):
  """`out, dq, dk, dv` (NumPy float32) with every document attended alone; zeros at padding.

  Document `i` goes to the start of its own row `i` of an `[N, L]` batch (L the longest document)
  that is one segment under a plain causal mask: its queries can only see its own keys. The slots
  after it get a zero output cotangent, so they send no gradient into the document either.
  """
  docs = _documents()
  n, l = len(docs), max(end - start for _, start, end in docs)
  rows_NxL, slots_NxL = np.zeros((n, l), np.int32), np.zeros((n, l), np.int32)
  valid_NxL = np.zeros((n, l), bool)
  for i, (row, start, end) in enumerate(docs):
    rows_NxL[i], slots_NxL[i, :end - start] = row, np.arange(start, end)
    valid_NxL[i, :end - start] = True
  alone = lambda x: np.where(valid_NxL[:, :, None, None],
                             np.asarray(x, np.float32)[rows_NxL, slots_NxL], np.float32(0))
  one_segment_NxL = np.ones((n, l), np.int32)
  args = (alone(q_BxSxHxD), alone(k_BxSxKxD), alone(v_BxSxKxD), one_segment_NxL,
          alone(dout_BxSxHxD))
  cpus = _cpu_devices()
  if cpus:  # the CPU compiles this small program ~2.5x faster without backend optimisations
    args = jax.device_put(args, cpus[0])
  lowered = jax.jit(_fwd_bwd(xla_lib.segment_attention_xla, scale)).lower(*args)
  results = lowered.compile(
      compiler_options={"xla_backend_optimization_level": 0} if cpus else None)(*args)
  outs = []
  for full, res in zip((q_BxSxHxD, q_BxSxHxD, k_BxSxKxD, v_BxSxKxD), results):
    back = np.zeros(full.shape, np.float32)
    back[rows_NxL[valid_NxL], slots_NxL[valid_NxL]] = np.asarray(res)[valid_NxL]
    outs.append(back)
  return tuple(outs)


@functools.lru_cache(maxsize=8)
def _probe_and_oracle(dtype_name: str, seed: int) -> tuple[tuple[jax.Array, ...], tuple[Any, ...]]:
  """The probe inputs and the oracle's answers (both fixed by dtype and seed: computed once)."""
  q, k, v, dout = _probe_inputs(jnp.dtype(dtype_name), seed)
  return (q, k, v, dout), _oracle(q, k, v, dout, scale=float(1.0 / np.sqrt(PROBE_HEAD_DIM)))


def _resolve(implementation: str | Backend | None, pallas: PallasOptions | None,
             cudnn_segment_bound: int | None) -> tuple[str, Backend]:
  """The backend's name and a function with the backend signature."""
  if callable(implementation):
    if pallas is not None or cudnn_segment_bound is not None:
      raise AttentionInputError(
          f"self_check: `pallas`={pallas!r} and `cudnn_segment_bound`={cudnn_segment_bound!r} "
          "are settings of a named backend; a callable `implementation` takes neither")
    return getattr(implementation, "__name__", repr(implementation)), implementation
  if implementation is not None and implementation not in dispatch.IMPLEMENTATIONS:
    raise AttentionInputError(
        f"self_check: `implementation` must be one of {dispatch.IMPLEMENTATIONS}, None or a "
        f"callable, got {implementation!r}")
  name = dispatch.resolve_implementation(implementation=implementation, pallas=pallas,
                                         cudnn_segment_bound=cudnn_segment_bound)
  if name == "cudnn" and cudnn_segment_bound is None:
    cudnn_segment_bound = PROBE_CUDNN_SEGMENT_BOUND

  def backend(q, k, v, segment_ids, *, causal, scale):
    return dispatch.segment_attention(q, k, v, segment_ids, causal=causal, scale=scale,
                                      implementation=name, pallas=pallas,
                                      cudnn_segment_bound=cudnn_segment_bound)

  return name, backend


def _worst(got: np.ndarray, want: np.ndarray) -> tuple[float, tuple[int, ...]]:
  """Worst absolute error (non-finite values count as infinite) and its index."""
  err = np.where(np.isfinite(got), np.abs(got.astype(np.float64) - want), np.inf)
  index = np.unravel_index(int(np.argmax(err)), err.shape)
  return float(err[index]), tuple(int(i) for i in index)


def _leak_message(name: str, dtype: str, tensor: str, error: float, tol: float,
                  index: tuple[int, ...], errors: dict[str, float]) -> str:
  row, slot, head = index[:3]
  sid = int(probe_segment_ids()[row, slot])
  where = "a padding slot" if sid == 0 else f"segment {sid}"
  for r, start, end in _documents():
    if r == row and start <= slot < end:
      where += f", a document of length {end - start} at slots {start}..{end - 1}"
  heads = "query head" if tensor in ("out", "dq") else "key/value head"
  worst = ", ".join(f"{t}={e:.3g}" for t, e in errors.items())
  return (f"attention self-check: implementation {name!r} leaks across documents: `{tensor}` "
          f"differs from each document attended alone (XLA) by {error:.4g} > tolerance {tol:g} "
          f"({dtype}) at row {row}, slot {slot} ({where}), {heads} {head}; worst errors {worst}")


def self_check(*, implementation: str | Backend | None = None, pallas: PallasOptions | None = None,
               cudnn_segment_bound: int | None = None, dtype: Any = None,
               seed: int = 0) -> SelfCheckResult:
  """Checks that a backend's output and gradients see only each token's own document.

  Args:
    implementation: `"xla"`, `"pallas"`, `"cudnn"`, None (`segment_attention`'s default for
      this platform), or a callable with the backend signature
      `(q, k, v, segment_ids, *, causal, scale) -> out`.
    pallas: Pallas only: its settings (e.g. `PallasOptions(interpret=True)` on a CPU); refused
      with another backend, as by `segment_attention`.
    cudnn_segment_bound: cuDNN only: the static bound on segments per row (default
      `PROBE_CUDNN_SEGMENT_BOUND`, above the probe's segments); refused with another backend.
    dtype: dtype of `q`, `k`, `v` (default float32; bfloat16 for cuDNN, which has no float32).
    seed: seed of the random inputs.

  Returns:
    The worst errors and the time taken.

  Raises:
    AttentionLeakError: `out`, `dq`, `dk` or `dv` is off by more than the dtype's tolerance
      (`TOLERANCES`) anywhere, padding slots included.
    AttentionInputError: an unknown implementation name, or a setting for another backend.
    CudnnUnavailableError: `"cudnn"` where cuDNN cannot run (propagated unchanged).
  """
  t0 = time.perf_counter()
  name, fn = _resolve(implementation, pallas, cudnn_segment_bound)
  if dtype is None:
    dtype = jnp.bfloat16 if name == "cudnn" else jnp.float32
  dtype_name = jnp.dtype(dtype).name
  if dtype_name not in TOLERANCES:
    raise AttentionInputError(
        f"self_check: `dtype` must be one of {sorted(TOLERANCES)}, got {dtype_name!r}")
  scale = float(1.0 / np.sqrt(PROBE_HEAD_DIM))
  (q, k, v, dout), want = _probe_and_oracle(dtype_name, seed)
  seg = jnp.asarray(probe_segment_ids())
  got = jax.device_get(jax.jit(_fwd_bwd(fn, scale))(q, k, v, seg, dout))
  errors, first = {}, None
  for tensor, g, w in zip(TENSORS, got, want):
    g = np.asarray(g, np.float32)
    if g.shape != w.shape:
      raise AttentionLeakError(
          f"attention self-check: implementation {name!r} returned `{tensor}` of shape "
          f"{g.shape}, expected {w.shape}")
    errors[tensor], index = _worst(g, np.asarray(w))
    tol = TOLERANCES[dtype_name][0 if tensor == "out" else 1]
    if first is None and not errors[tensor] <= tol:
      first = (tensor, errors[tensor], tol, index)
  if first is not None:
    raise AttentionLeakError(_leak_message(name, dtype_name, *first, errors))
  return SelfCheckResult(implementation=name, dtype=dtype_name, max_errors=errors,
                         seconds=time.perf_counter() - t0)
