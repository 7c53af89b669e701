"""The cuDNN backend: packed layout, static bound, masking of unwritten slots, the cuda lowering.

No cuDNN runs on the CPU. The layout and bound are checked against plain-Python oracles; the
backend's handling of slots outside every cuDNN sequence is checked with a stand-in for JAX's cuDNN
call that implements the packed layout's semantics (attention within `[offset, offset + length)`)
and, as cuDNN does, leaves every other slot unwritten (NaN here), forward and backward; the
lowering for `cuda` is JAX's real one with its two host probes faked.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack.attention import AttentionInputError, round_segment_bound, segment_attention
from segpack.attention import cudnn
from support.attention_inputs import random_rows, layouts
from support.attention_oracle import reference


def _runs_oracle(row):
  """Plain-Python walk over the row: (start, length) of every non-zero run."""
  runs = []
  prev = 0
  for i, sid in enumerate(row):
    if sid != 0 and sid != prev:
      runs.append([i, 0])
    if sid != 0:
      runs[-1][1] += 1
    prev = sid
  return runs


def _layout_oracle(row, n):
  """Lengths and starts of the first n non-zero runs, padded with -1 to n and n + 1 entries."""
  runs = _runs_oracle(row)[:n]
  lengths, starts = [ln for _, ln in runs], [st for st, _ in runs]
  return (lengths + [-1] * (n - len(lengths)), starts + [-1] * (n + 1 - len(starts)))


def _covered_oracle(row, n):
  """Slots inside one of the first n non-zero runs."""
  out = [False] * len(row)
  for st, ln in _runs_oracle(row)[:n]:
    out[st:st + ln] = [True] * ln
  return out


# Hand-made rows, S = 12, N = 3: (name, row, runs cuDNN sees).
HAND_ROWS = [
    ("padding tail", [1, 1, 1, 2, 2, 3, 0, 0, 0, 0, 0, 0], 3),
    ("padding between documents", [1, 1, 0, 0, 2, 2, 2, 0, 3, 0, 0, 0], 3),
    ("leading padding", [0, 0, 0, 4, 4, 4, 4, 5, 5, 5, 5, 5], 2),
    ("all padding", [0] * 12, 0),
    ("N exactly reached, no padding", [7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9], 3),
    ("overflow", [1, 2, 0, 3, 3, 4, 4, 4, 0, 5, 6, 6], 6),
]
HAND_N = 3


def test_packed_layout_on_hand_made_rows():
  seg = np.array([row for _, row, _ in HAND_ROWS], np.int32)
  seqlen, offsets = cudnn.packed_layout(jnp.asarray(seg), cudnn_segment_bound=HAND_N)
  covered = cudnn.covered_slots(jnp.asarray(seg), cudnn_segment_bound=HAND_N)
  counts = cudnn.count_segments(jnp.asarray(seg))
  for r, (name, row, runs) in enumerate(HAND_ROWS):
    want_len, want_off = _layout_oracle(row, HAND_N)
    np.testing.assert_array_equal(seqlen[r], want_len, err_msg=name)
    np.testing.assert_array_equal(offsets[r], want_off, err_msg=name)
    np.testing.assert_array_equal(covered[r], _covered_oracle(row, HAND_N), err_msg=name)
    assert int(counts[r]) == runs == len(_runs_oracle(row)), name
  # Spelled out for two rows, so that the oracle is not the only witness.
  np.testing.assert_array_equal(seqlen[1], [2, 3, 1])
  np.testing.assert_array_equal(offsets[1], [0, 4, 8, -1])
  np.testing.assert_array_equal(seqlen[3], [-1, -1, -1])
  np.testing.assert_array_equal(offsets[5], [0, 1, 3, -1])  # runs 4, 5 and 6 dropped


def test_packed_layout_matches_python_oracle_on_random_rows():
  rng = np.random.default_rng(0)
  seg = np.concatenate([layouts(256), random_rows(rng, 10, 256)])
  n = 40
  seqlen, offsets = cudnn.packed_layout(jnp.asarray(seg), cudnn_segment_bound=n)
  covered = cudnn.covered_slots(jnp.asarray(seg), cudnn_segment_bound=n)
  for r in range(len(seg)):
    want_len, want_off = _layout_oracle(list(seg[r]), n)
    np.testing.assert_array_equal(seqlen[r], want_len, err_msg=f"row {r}")
    np.testing.assert_array_equal(offsets[r], want_off, err_msg=f"row {r}")
    np.testing.assert_array_equal(covered[r], _covered_oracle(list(seg[r]), n))
  counts = [len(_runs_oracle(list(r))) for r in seg]
  np.testing.assert_array_equal(cudnn.count_segments(jnp.asarray(seg)), counts)
  assert max(counts) > n  # some rows overflow N and are cut at N segments above


def test_packed_layout_docstring_example():
  ids = jnp.array([[0, 1, 1, 0, 2, 2, 2, 0]])
  seqlen, offsets = cudnn.packed_layout(ids, cudnn_segment_bound=3)
  np.testing.assert_array_equal(seqlen, [[2, 3, -1]])
  np.testing.assert_array_equal(offsets, [[1, 4, -1, -1]])
  np.testing.assert_array_equal(cudnn.covered_slots(ids, cudnn_segment_bound=3),
                                [[0, 1, 1, 0, 1, 1, 1, 0]])


def test_checked_mode_counts_the_runs_cudnn_sees():
  seg = jnp.asarray([row for _, row, _ in HAND_ROWS[:5]], jnp.int32)  # at most 3 runs each
  cudnn.check_segment_count(seg, cudnn_segment_bound=HAND_N)  # N exactly reached: fine
  over = jnp.asarray([row for _, row, _ in HAND_ROWS], jnp.int32)
  with pytest.raises(AttentionInputError, match=r"row 5 has 6 segments, more than .*=3"):
    cudnn.check_segment_count(over, cudnn_segment_bound=HAND_N)
  # Padding between documents is no run: 3 documents fit N = 3.
  cudnn.check_segment_count(jnp.array([[1, 0, 2, 0, 3, 0]]), cudnn_segment_bound=3)
  with pytest.raises(AttentionInputError, match="row 0 has 3 segments, more than .*=2"):
    cudnn.check_segment_count(jnp.array([[1, 0, 2, 0, 3, 0]]), cudnn_segment_bound=2)


def test_checked_mode_under_jit_raises_when_run():
  check = jax.jit(lambda seg: (cudnn.check_segment_count(seg, cudnn_segment_bound=2), seg)[1])
  jax.block_until_ready(check(jnp.array([[1, 1, 0, 2]])))
  with pytest.raises(Exception, match="row 1 has 3 segments, more than .*=2"):
    jax.block_until_ready(check(jnp.array([[1, 1, 0, 2], [1, 0, 2, 3]])))


def test_round_segment_bound():
  def naive(m):
    n = 2
    while n < m:
      n *= 2
    return n
  for m in range(0, 300):
    got = cudnn.round_segment_bound(m)
    assert got == naive(m) and got >= m, m
  assert cudnn.round_segment_bound(np.int64(9)) == 16
  assert round_segment_bound is cudnn.round_segment_bound  # exported by segpack.attention
  for bad in (-1, True, 2.5, None):
    with pytest.raises(AttentionInputError, match=f"`max_segments` must be an int >= 0, got "
                       f"{re.escape(repr(bad))}"):
      cudnn.round_segment_bound(bad)


def test_no_default_bound():
  """Without `cudnn_segment_bound` the call is refused, naming the memory law and the fix."""
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(AttentionInputError) as e:
    segment_attention(x, x, x, jnp.ones((1, 64), jnp.int32), implementation="cudnn")
  msg = str(e.value)
  for part in ("`cudnn_segment_bound`", "B*N*H*S*D", "516 GiB", "segment_bound",
               "round_segment_bound", "S=64"):
    assert part in msg, part


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU-only error")
def test_clear_error_without_cudnn():
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(cudnn.CudnnUnavailableError, match="needs a CUDA GPU with cuDNN"):
    segment_attention(x, x, x, jnp.ones((1, 64), jnp.int32), implementation="cudnn",
                      cudnn_segment_bound=4)


def test_bad_segment_bound():
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  for bad in (0, -3, 2.0):
    with pytest.raises(AttentionInputError, match="`cudnn_segment_bound` must be a positive int, "
                       f"got {bad!r}"):
      segment_attention(x, x, x, jnp.ones((1, 64), jnp.int32), implementation="cudnn",
                        cudnn_segment_bound=bad)


def _fake_cudnn_call(q, k, v, seqlen_BxN, offsets_BxN1, mask_type, scale):
  """cuDNN's packed layout on the CPU: sequence i of row b is slots `[offsets[b, i], offsets[b, i]
  + seqlen[b, i])`, attended alone; slots of no sequence are never written (NaN here), in the
  output and in dq, dk, dv."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  s, g = q.shape[1], q.shape[2] // k.shape[2]
  n = seqlen_BxN.shape[1]
  pos_S = jnp.arange(s)
  start_BxNx1, len_BxNx1 = offsets_BxN1[:, :n, None], seqlen_BxN[:, :, None]
  inside_BxNxS = (len_BxNx1 > 0) & (pos_S >= start_BxNx1) & (pos_S < start_BxNx1 + len_BxNx1)
  written_BxS = inside_BxNxS.any(axis=1)
  seq_BxS = jnp.where(written_BxS, jnp.argmax(inside_BxNxS, axis=1), -1)
  mask_BxSxS = (seq_BxS[:, :, None] == seq_BxS[:, None, :]) & written_BxS[:, :, None]
  if mask_type == fa.MaskType.PADDING_CAUSAL:
    mask_BxSxS &= pos_S[:, None] >= pos_S[None, :]
  mask_BxSxS |= jnp.eye(s, dtype=bool)  # unwritten queries: any finite value, replaced by NaN

  def dense(q, k, v, mask_BxSxS):
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = jax.nn.softmax(jnp.where(mask_BxSxS[:, None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)

  nan_where = lambda x, written_BxS: jnp.where(written_BxS[:, :, None, None], x, jnp.nan)

  @jax.custom_vjp
  def call(q, k, v, mask_BxSxS, written_BxS):
    return nan_where(dense(q, k, v, mask_BxSxS), written_BxS)

  def fwd(q, k, v, mask_BxSxS, written_BxS):
    out, vjp = jax.vjp(lambda q, k, v: dense(q, k, v, mask_BxSxS), q, k, v)
    return nan_where(out, written_BxS), (vjp, written_BxS)

  def bwd(res, dout):
    vjp, written_BxS = res
    return tuple(nan_where(grad, written_BxS) for grad in vjp(dout)) + (None, None)

  call.defvjp(fwd, bwd)
  return call(q, k, v, mask_BxSxS, written_BxS)


@pytest.fixture
def fake_cudnn(monkeypatch):
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn, "_cudnn_call", _fake_cudnn_call)
  jax.clear_caches()  # no trace of the real call is reused
  yield
  jax.clear_caches()


@pytest.mark.parametrize("causal", [True, False])
def test_unwritten_slots_are_zero_forward_and_backward(fake_cudnn, causal):
  """With a call that leaves slots outside every sequence as NaN (as cuDNN leaves them
  unwritten), output and dq, dk, dv equal the per-document oracle: zeros at padding and at the
  dropped segments of an overflowing row, finite everywhere."""
  seg = np.array([row for _, row, _ in HAND_ROWS], np.int32)
  b, s, h, kh, d = seg.shape[0], seg.shape[1], 4, 2, 8
  rng = np.random.default_rng(1)
  q, k, v, dout = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((b, s, h, d), (b, s, kh, d), (b, s, kh, d), (b, s, h, d)))
  f = lambda q, k, v: segment_attention(q, k, v, jnp.asarray(seg), causal=causal,
                                        implementation="cudnn", cudnn_segment_bound=HAND_N)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  grads = vjp(dout)
  kept = np.where([_covered_oracle(row, HAND_N) for row in seg.tolist()], seg, 0)
  want, grads_want = reference(q, k, v, kept, causal=causal, dout=dout)
  np.testing.assert_allclose(out, want, atol=2e-5)
  for name, got, ref in zip(("dq", "dk", "dv"), grads, grads_want):
    assert np.isfinite(np.asarray(got)).all(), name
    np.testing.assert_allclose(got, ref, atol=5e-5, err_msg=name)
    assert not np.asarray(got)[kept == 0].any(), name  # exact zeros where no sequence is


def test_forward_and_backward_lower_for_cuda(monkeypatch):
  """JAX refuses to build the cuDNN call without probing a GPU; the probes are faked here.

  The CPU jaxlib has no cuDNN to report a version, and the packed layout asks the local GPU's
  compute capability; with those two host probes answered (cuDNN 9.10, Hopper) the lowering
  itself is JAX's real one.
  """
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
  sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  args = (sd(2, 512, 8, 128), sd(2, 512, 2, 128), sd(2, 512, 2, 128), sd(2, 512, dt=jnp.int32))
  fwd = lambda q, k, v, seg: segment_attention(q, k, v, seg, implementation="cudnn",
                                               cudnn_segment_bound=16)

  def grad(q, k, v, seg):
    return jax.grad(lambda q, k, v: fwd(q, k, v, seg).astype(jnp.float32).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  fwd_text = lower(fwd)
  assert re.findall(r"custom_call @([\w$.]+)", fwd_text) == ["__cudnn$fmhaSoftmax"]
  grad_text = lower(grad)
  calls = re.findall(r"custom_call @([\w$.]+)", grad_text)
  assert "__cudnn$fmhaSoftmax" in calls and "__cudnn$fmhaSoftmaxBackward" in calls
  assert "tensor<2x16xi32>" in grad_text and "tensor<2x17xi32>" in grad_text  # [B, N], [B, N + 1]
