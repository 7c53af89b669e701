"""The cuDNN backend: packed-layout derivation, the error without cuDNN, and the cuda lowering."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack.attention import AttentionInputError, segment_attention
from segpack.attention import cudnn
from test_attention import _random_rows, layouts


def _layout_oracle(row, n):
  """Plain-Python walk over the row: lengths and starts of the non-zero runs."""
  lengths, starts = [], []
  prev = 0
  for i, sid in enumerate(row):
    if sid != 0 and sid != prev:
      starts.append(i)
      lengths.append(0)
    if sid != 0:
      lengths[-1] += 1
    prev = sid
  lengths, starts = lengths[:n], starts[:n]
  return (lengths + [-1] * (n - len(lengths)), starts + [-1] * (n + 1 - len(starts)))


def test_packed_layout_matches_python_oracle():
  rng = np.random.default_rng(0)
  seg = np.concatenate([layouts(256), _random_rows(rng, 10, 256)])
  n = 40
  seqlen, offsets = cudnn.packed_layout(jnp.asarray(seg), max_segments_per_row=n)
  for r in range(len(seg)):
    want_len, want_off = _layout_oracle(list(seg[r]), n)
    np.testing.assert_array_equal(seqlen[r], want_len, err_msg=f"row {r}")
    np.testing.assert_array_equal(offsets[r], want_off, err_msg=f"row {r}")
  counts = [sum(1 for x in _layout_oracle(list(r), 256)[0] if x >= 0) for r in seg]
  np.testing.assert_array_equal(cudnn.count_segments(jnp.asarray(seg)), counts)
  assert max(counts) > n  # some rows overflow N and are cut at N segments above


def test_packed_layout_docstring_example():
  seqlen, offsets = cudnn.packed_layout(jnp.array([[1, 1, 1, 2, 2, 0]]), max_segments_per_row=3)
  np.testing.assert_array_equal(seqlen, [[3, 2, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, -1, -1]])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU-only error")
def test_clear_error_without_cudnn():
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(cudnn.CudnnUnavailableError, match="needs a CUDA GPU with cuDNN"):
    segment_attention(x, x, x, jnp.ones((1, 64), jnp.int32), implementation="cudnn")


def test_bad_max_segments():
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(AttentionInputError, match="`max_segments_per_row` must be a positive int, "
                     "got 0"):
    segment_attention(x, x, x, jnp.ones((1, 64), jnp.int32), implementation="cudnn",
                      max_segments_per_row=0)


def test_cudnn_lowers_for_cuda_forward_and_backward(monkeypatch):
  """JAX refuses to build the cuDNN call without probing a GPU; the probes are faked here.

  The CPU jaxlib has no cuDNN to report a version, and the packed layout asks the local GPU's
  compute capability; with those two host probes answered (cuDNN 9.10, Hopper) the lowering
  itself is JAX's real one.
  """
  from jax._src.cudnn import fused_attention_stablehlo as fa
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
  sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  args = (sd(2, 512, 8, 128), sd(2, 512, 2, 128), sd(2, 512, 2, 128), sd(2, 512, dt=jnp.int32))
  fwd = lambda q, k, v, seg: segment_attention(q, k, v, seg, implementation="cudnn",
                                               max_segments_per_row=16)

  def grad(q, k, v, seg):
    return jax.grad(lambda q, k, v: fwd(q, k, v, seg).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert re.findall(r"custom_call @([\w$.]+)", lower(fwd)) == ["__cudnn$fmhaSoftmax"]
  calls = re.findall(r"custom_call @([\w$.]+)", lower(grad))
  assert "__cudnn$fmhaSoftmax" in calls and "__cudnn$fmhaSoftmaxBackward" in calls


def test_checked_mode_counts_segments():
  seg = jnp.array([[1, 2, 3, 0], [1, 1, 1, 1]])
  with pytest.raises(AttentionInputError, match="row 0 has 3 segments, more than .*=2"):
    cudnn.check_segment_count(seg, max_segments_per_row=2)
  cudnn.check_segment_count(seg, max_segments_per_row=3)
