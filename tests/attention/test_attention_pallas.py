"""The Pallas segment flash kernel (interpret mode) against XLA and the per-document oracle."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack.attention import PallasOptions, segment_attention
from segpack.attention.pallas import segment_attention_pallas
from support.attention_inputs import layouts, random_inputs
from support.attention_oracle import reference

S, BLOCK = 256, 64


def _pallas(causal, **kw):
  options = PallasOptions(**dict(dict(block_q=BLOCK, block_k=BLOCK, interpret=True), **kw))
  return lambda q, k, v, seg: segment_attention(
      q, k, v, seg, causal=causal, implementation="pallas", pallas=options)


def _xla(causal):
  return lambda q, k, v, seg: segment_attention(q, k, v, seg, causal=causal, implementation="xla")


def _fwd_bwd(fn, q, k, v, seg, dout):
  out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
  return out, vjp(dout)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_pallas_matches_oracle_and_xla_forward_and_grads(causal, dtype):
  """Rows: one segment; length-1 segments; block-crossing + padding tail; all padding. GQA 4/2."""
  seg = jnp.asarray(layouts(S))
  q, k, v, dout = random_inputs(int(causal), 4, S, 4, 2, 64, dtype)
  out, grads = jax.jit(lambda *a: _fwd_bwd(_pallas(causal), *a))(q, k, v, seg, dout)
  out_x, grads_x = jax.jit(lambda *a: _fwd_bwd(_xla(causal), *a))(q, k, v, seg, dout)
  want, grads_want = reference(q.astype(jnp.float32), k.astype(jnp.float32),
                               v.astype(jnp.float32), seg, causal=causal,
                               dout=dout.astype(jnp.float32))
  f32 = lambda x: np.asarray(x, np.float32)
  atol = 2e-5 if dtype == jnp.float32 else 3e-2
  gtol = 1e-4 if dtype == jnp.float32 else 1e-1
  np.testing.assert_allclose(f32(out), want, atol=atol)
  np.testing.assert_allclose(f32(out), f32(out_x), atol=atol)
  assert np.all(f32(out)[3] == 0) and np.all(f32(out)[2, 191:] == 0)
  for name, got, ref, xla in zip("qkv", grads, grads_want, grads_x):
    np.testing.assert_allclose(f32(got), ref, atol=gtol, err_msg=f"d{name}")
    np.testing.assert_allclose(f32(got), f32(xla), atol=gtol, err_msg=f"d{name} vs xla")
    assert np.all(f32(got)[3] == 0), f"d{name} not zero on the all-padding row"


def test_default_pallas_options_interpreted_match_xla():
  """`pallas=PallasOptions(interpret=True)` (every other setting "auto") on a small packed batch:
  forward and gradients equal the XLA backend's."""
  seg = jnp.asarray(layouts(64))
  q, k, v, dout = random_inputs(3, 4, 64, 2, 1, 16)
  pallas = lambda q, k, v, seg: segment_attention(q, k, v, seg, implementation="pallas",
                                                  pallas=PallasOptions(interpret=True))
  out, grads = jax.jit(lambda *a: _fwd_bwd(pallas, *a))(q, k, v, seg, dout)
  out_x, grads_x = jax.jit(lambda *a: _fwd_bwd(_xla(True), *a))(q, k, v, seg, dout)
  np.testing.assert_allclose(out, out_x, atol=2e-5)
  for name, got, want in zip("qkv", grads, grads_x):
    np.testing.assert_allclose(got, want, atol=1e-4, err_msg=f"d{name}")


def test_pallas_grouped_query_g4_uneven_blocks_and_padded_shapes():
  """G = 4, block_q != block_k, own backward blocks, S = 200 (padded to 256), D = 48 (to 64)."""
  seg = jnp.asarray(layouts(200)[:3])
  q, k, v, dout = random_inputs(7, 3, 200, 4, 1, 48)
  fn = _pallas(True, block_q=32, block_k=64, block_q_bwd=64, block_k_bwd=16)
  out, grads = jax.jit(lambda *a: _fwd_bwd(fn, *a))(q, k, v, seg, dout)
  want, grads_want = reference(q, k, v, seg, causal=True, dout=dout)
  np.testing.assert_allclose(out, want, atol=2e-5)
  for got, ref in zip(grads, grads_want):
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_pallas_random_layouts_small_blocks():
  """Random packings (padding between documents, short and long runs), blocks of 16 and 32."""
  from support.attention_inputs import random_rows
  seg = jnp.asarray(random_rows(np.random.default_rng(4), 3, 128))
  q, k, v, dout = random_inputs(4, 3, 128, 2, 1, 32)
  for causal in (True, False):
    fn = _pallas(causal, block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
    out, grads = jax.jit(lambda *a, fn=fn: _fwd_bwd(fn, *a))(q, k, v, seg, dout)
    want, grads_want = reference(q, k, v, seg, causal=causal, dout=dout)
    np.testing.assert_allclose(out, want, atol=2e-5)
    for got, ref in zip(grads, grads_want):
      np.testing.assert_allclose(got, ref, atol=1e-4)


def test_pallas_float16_forward():
  seg = jnp.asarray(layouts(S))
  q, k, v, _ = random_inputs(9, 4, S, 2, 1, 64, jnp.float16)
  out = jax.jit(_pallas(True))(q, k, v, seg)
  assert out.dtype == jnp.float16
  want, _ = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), seg,
                      causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=5e-3)


def test_pallas_skips_blocks_of_other_documents():
  """NaN values in a block no query block of another document needs stay out of its output.

  A kernel visiting every block (the same kernel with `skip_blocks=False`) multiplies the NaN by
  a zero probability and spreads it; the segment kernel never loads the block.
  """
  seg = jnp.asarray(np.repeat([[1, 2]], 128, axis=1))  # two documents of 128 slots
  q, k, v, _ = random_inputs(3, 1, 256, 2, 2, 64)
  v = v.at[0, 128:192].set(jnp.nan)  # a block of document 2
  common = dict(causal=False, scale=0.125,
                pallas=PallasOptions(block_q=64, block_k=64, interpret=True))
  out = segment_attention_pallas(q, k, v, seg, **common)
  dense = segment_attention_pallas(q, k, v, seg, skip_blocks=False, **common)
  assert np.all(np.isfinite(out[0, :128]))
  assert np.all(np.isnan(dense[0, :128]))
  want, _ = reference(q, k, jnp.nan_to_num(v), seg, causal=False, scale=0.125)
  np.testing.assert_allclose(out[0, :128], want[0, :128], atol=2e-5)


def test_dense_kernel_of_same_family_is_correct():
  seg = jnp.asarray(layouts(S))
  q, k, v, dout = random_inputs(5, 4, S, 2, 2, 64)
  fn = lambda q, k, v, seg: segment_attention_pallas(
      q, k, v, seg, causal=True, scale=0.125,
      pallas=PallasOptions(block_q=BLOCK, block_k=BLOCK, interpret=True), skip_blocks=False)
  out, grads = jax.jit(lambda *a: _fwd_bwd(fn, *a))(q, k, v, seg, dout)
  want, grads_want = reference(q, k, v, seg, causal=True, scale=0.125, dout=dout)
  np.testing.assert_allclose(out, want, atol=2e-5)
  for got, ref in zip(grads, grads_want):
    np.testing.assert_allclose(got, ref, atol=1e-4)


def _cuda_text(fn, *shapes):
  return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_pallas_lowers_to_triton_for_cuda_forward_and_backward(head_dim):
  b, s, h, kh = 2, 1024, 8, 2
  sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  args = (sd(b, s, h, head_dim), sd(b, s, kh, head_dim), sd(b, s, kh, head_dim),
          sd(b, s, dt=jnp.int32))
  fwd = lambda q, k, v, seg: segment_attention(q, k, v, seg, implementation="pallas")
  text = _cuda_text(fwd, *args)
  assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton"]
  assert "segment_flash_fwd" in text

  def grad(q, k, v, seg):
    loss = lambda q, k, v: fwd(q, k, v, seg).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = _cuda_text(grad, *args)
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls and set(calls) == {"__gpu$xla.gpu.triton"}
  for kernel in ("segment_flash_fwd", "segment_flash_bwd_dq", "segment_flash_bwd_dkv"):
    assert kernel in text, kernel


def test_pallas_head_dim_128_forward_and_grads():
  """D = 128 (the other head dim the issue names), GQA 4/2, against the per-document oracle."""
  seg = jnp.asarray(layouts(128)[:3])
  q, k, v, dout = random_inputs(13, 3, 128, 4, 2, 128)
  out, grads = jax.jit(lambda *a: _fwd_bwd(_pallas(True), *a))(q, k, v, seg, dout)
  want, grads_want = reference(q, k, v, seg, causal=True, dout=dout)
  np.testing.assert_allclose(out, want, atol=2e-5)
  for name, got, ref in zip("qkv", grads, grads_want):
    np.testing.assert_allclose(got, ref, atol=1e-4, err_msg=f"d{name}")

