"""The attention backends on a CUDA GPU against a float32 reference on the device.

Every test here is marked `gpu` and skipped without a CUDA GPU. tests/conftest.py sets
JAX_PLATFORMS=cpu unless it is already set, so run them with

    JAX_PLATFORMS=cuda python -m pytest -m gpu tests

The grid is `segpack.bench.gpu_cases`'s, the tolerance rule `segpack.bench.gpu_checks`'s (see its
docstring), the cuDNN memory check `segpack.bench.gpu_memory`'s:
`python -m segpack.bench.gpu_report` runs the same checks and writes them as one JSON report.
Collecting this module does no JAX work: the grid is plain Python.
"""

import functools
import os

import numpy as np
import pytest

from segpack.bench import gpu_cases
from segpack.bench import gpu_checks
from segpack.bench import gpu_memory
from support.attention_oracle import reference as float64_oracle

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda_gpu():
  reason = gpu_checks.cuda_skip_reason()
  if reason and os.environ.get("JAX_PLATFORMS") == "cpu":
    reason += "; 'cpu' is tests/conftest.py's default: JAX_PLATFORMS=cuda python -m pytest -m gpu"
  if reason:
    pytest.skip(reason)


@functools.lru_cache(maxsize=1)
def _case(seq_len: int, head_dim: int, heads: str) -> gpu_cases.Case:
  return gpu_cases.case_for(gpu_cases.GridPoint(
      implementation="xla", dtype="float32", head_dim=head_dim, seq_len=seq_len, heads=heads,
      causal=True))


@functools.lru_cache(maxsize=1)
def _yardstick(group: tuple) -> gpu_checks.Yardstick:
  """One yardstick per (S, D, heads, causal, dtype); the grid puts its backends side by side."""
  seq_len, head_dim, heads, causal, dtype = group
  return gpu_checks.make_yardstick(case=_case(seq_len, head_dim, heads), dtype=dtype,
                                   causal=causal)


@pytest.mark.parametrize("point", [pytest.param(p, id=p.id) for p in gpu_cases.grid()])
def test_backend_matches_float32_reference(point):
  """Output, dq, dk, dv within 1.5 x XLA's error at the dtype (+ floor); padding exactly 0."""
  yard = _yardstick(point.group)
  rec = gpu_checks.check_backend(implementation=point.implementation, case=yard.case,
                                 dtype=point.dtype, causal=point.causal, yardstick=yard)
  if rec["status"].startswith("unsupported"):
    pytest.skip(rec["status"])
  assert rec["status"] == "passed", "\n".join(rec["failures"])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_reference_matches_float64_oracle(causal):
  """The on-device reference is exact float32: TF32 (error ~1e-3) would fail the 1e-5 bound."""
  case = gpu_cases.make_case(seq_len=1000, head_dim=64, num_heads=4, num_kv_heads=1)
  yard = gpu_checks.make_yardstick(case=case, dtype="float32", causal=causal)
  assert yard.error is None, yard.error
  q, k, v, seg, dout = (np.asarray(x) for x in yard.inputs)
  want_out, want_grads = float64_oracle(q, k, v, seg, causal=causal, dout=dout)
  for name, got, want in zip(gpu_checks.TENSORS, yard.reference, (want_out, *want_grads)):
    rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert rel < 1e-5, (name, rel)


def test_cudnn_memory_at_32_segments():
  """cuDNN forward+backward temp bytes at N = 32 within 8.07 bytes per B*N*H*S*D element."""
  rec = gpu_memory.cudnn_memory_check()
  if rec["status"].startswith("unsupported"):
    pytest.skip(rec["status"])
  assert rec["status"] == "passed", rec
