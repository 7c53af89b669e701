"""segment_attention: the XLA reference against the per-document oracle, block ranges, bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from segpack import attention as attention_lib
from segpack.attention import (AttentionInputError, AttentionTypeError,
                               NonContiguousSegmentsError, PallasOptions, segment_attention)
from segpack.attention import blocks
from support.attention_oracle import reference
from support.attention_inputs import layouts, random_inputs, random_rows


@pytest.mark.parametrize("causal", [True, False])
def test_xla_matches_per_document_oracle_forward_and_grads(causal):
  seg = layouts(64)
  q, k, v, dout = random_inputs(0, 4, 64, 4, 2, 16)
  f = lambda q, k, v: segment_attention(q, k, v, jnp.asarray(seg), causal=causal,
                                        implementation="xla")
  out, vjp = jax.vjp(f, q, k, v)
  want, grads_want = reference(q, k, v, seg, causal=causal, dout=dout)
  np.testing.assert_allclose(out, want, atol=2e-5)
  for got, ref in zip(vjp(dout), grads_want):
    np.testing.assert_allclose(got, ref, atol=5e-5)
  assert np.all(np.asarray(out)[3] == 0)


def test_default_implementation_on_cpu_is_xla():
  seg = layouts(32)
  q, k, v, _ = random_inputs(1, 4, 32, 2, 2, 16)
  np.testing.assert_array_equal(
      segment_attention(q, k, v, jnp.asarray(seg)),
      segment_attention(q, k, v, jnp.asarray(seg), implementation="xla"))


def _needed_tiles(seg_row, bq, bk, causal):
  s = len(seg_row)
  mask = (seg_row[:, None] == seg_row[None, :]) & (seg_row[:, None] != 0)
  if causal:
    mask &= np.tril(np.ones((s, s), bool))
  tiles = mask.reshape(s // bq, bq, s // bk, bk)
  return tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bq,bk", [(64, 64), (32, 64), (64, 16)])
def test_block_ranges_are_sound_and_tight(causal, bq, bk):
  """Every needed tile is visited, the range ends are needed, mask-free tiles need no mask."""
  rng = np.random.default_rng(bq + bk + causal)
  seg = np.concatenate([layouts(256), random_rows(rng, 12, 256)])
  qr = np.asarray(blocks.q_block_ranges(jnp.asarray(seg), block_q=bq, block_k=bk, causal=causal))
  kr = np.asarray(blocks.kv_block_ranges(jnp.asarray(seg), block_q=bq, block_k=bk, causal=causal))
  for r in range(len(seg)):
    needed, unmasked = _needed_tiles(seg[r], bq, bk, causal)
    for ranges, need, full in ((qr[r], needed, unmasked), (kr[r], needed.T, unmasked.T)):
      for i, (lo, hi, flo, fhi) in enumerate(ranges):
        cols = np.flatnonzero(need[i])
        if len(cols) == 0:
          assert lo == hi
          continue
        assert lo == cols[0] and hi == cols[-1] + 1, (r, i, lo, hi, cols)
        assert lo <= flo <= fhi <= hi
        assert np.all(full[i, flo:fhi]), (r, i, flo, fhi)
        if fhi == flo:
          assert flo == hi


def test_block_ranges_use_mask_free_blocks_inside_one_segment():
  seg = jnp.ones((1, 512), jnp.int32)
  qr = np.asarray(blocks.q_block_ranges(seg, block_q=64, block_k=64, causal=True))[0]
  # Query block i visits key blocks 0..i; all but the diagonal one are mask-free.
  np.testing.assert_array_equal(qr[:, 0], 0)
  np.testing.assert_array_equal(qr[:, 1], np.arange(1, 9))
  np.testing.assert_array_equal(qr[:, 3] - qr[:, 2], np.arange(8))
  np.testing.assert_array_equal(qr[1:, 2], 0)


def test_tiles_computed_follow_segments():
  seg = np.zeros((1, 1024), np.int32)
  for i in range(8):
    seg[0, i * 128:(i + 1) * 128] = i + 1
  got = blocks.tiles_computed(jnp.asarray(seg), block_q=128, block_k=128, causal=True)
  assert int(got[0]) == 8  # one diagonal tile per document, versus 36 for a dense causal mask


class TestBadInput:
  q, k, v, _ = random_inputs(0, 2, 32, 4, 2, 16)
  seg = jnp.ones((2, 32), jnp.int32)

  def test_rank(self):
    with pytest.raises(AttentionInputError, match=r"`q` must have rank 4.*\(2, 32, 64\)"):
      segment_attention(self.q.reshape(2, 32, 64), self.k, self.v, self.seg)

  def test_kv_shape_mismatch(self):
    with pytest.raises(AttentionInputError, match=r"`k` shape \(2, 32, 2, 16\) != `v` shape"):
      segment_attention(self.q, self.k, self.v[:, :16], self.seg)

  def test_seq_mismatch(self):
    with pytest.raises(AttentionInputError, match=r"`k` shape \(2, 16, 2, 16\)"):
      segment_attention(self.q, self.k[:, :16], self.v[:, :16], self.seg)

  def test_heads_not_multiple(self):
    k3 = jnp.zeros((2, 32, 3, 16))
    with pytest.raises(AttentionInputError, match="H=4 must be a multiple of .* K=3"):
      segment_attention(self.q, k3, k3, self.seg)

  def test_segment_ids_shape(self):
    with pytest.raises(AttentionInputError, match=r"`segment_ids` shape \(2, 31\)"):
      segment_attention(self.q, self.k, self.v, self.seg[:, :31])

  def test_dtype_mismatch(self):
    with pytest.raises(AttentionTypeError, match="float32, bfloat16, float32"):
      segment_attention(self.q, self.k.astype(jnp.bfloat16), self.v, self.seg)

  def test_unsupported_dtype(self):
    with pytest.raises(AttentionTypeError, match="`q` dtype .* got int32"):
      segment_attention(self.q.astype(jnp.int32), self.k, self.v, self.seg)

  def test_float_segment_ids(self):
    with pytest.raises(AttentionTypeError, match="`segment_ids` must be an integer array"):
      segment_attention(self.q, self.k, self.v, self.seg.astype(jnp.float32))

  def test_unknown_implementation(self):
    with pytest.raises(AttentionInputError, match="got 'flash'"):
      segment_attention(self.q, self.k, self.v, self.seg, implementation="flash")

  def test_bad_block(self):
    with pytest.raises(AttentionInputError, match="`block_q` must be a power of two >= 16, got 48"):
      segment_attention(self.q, self.k, self.v, self.seg, implementation="pallas",
                        pallas=PallasOptions(block_q=48, interpret=True))

  def test_bad_backward_block(self):
    with pytest.raises(AttentionInputError, match="`block_k_bwd` must be a power of two >= 16, "
                       "got 8"):
      segment_attention(self.q, self.k, self.v, self.seg, implementation="pallas",
                        pallas=PallasOptions(block_k_bwd=8, interpret=True))

  def test_head_dim_too_large(self):
    q = jnp.zeros((1, 16, 1, 320))
    with pytest.raises(AttentionInputError, match="D=320 is above 256"):
      segment_attention(q, q, q, jnp.ones((1, 16), jnp.int32), implementation="pallas",
                        pallas=PallasOptions(interpret=True))

  @pytest.mark.skipif(jax.default_backend() == "gpu", reason="None means XLA only off a GPU")
  def test_pallas_options_are_refused_by_other_backends(self):
    for impl, named in (("xla", "implementation='xla'"), ("cudnn", "implementation='cudnn'"),
                        (None, r"implementation=None \(here 'xla'\)")):
      with pytest.raises(AttentionInputError, match=r"`pallas`=PallasOptions\(.*interpret=True\) "
                         f"is a Pallas setting, but {named} does not use it"):
        segment_attention(self.q, self.k, self.v, self.seg, implementation=impl,
                          pallas=PallasOptions(interpret=True))

  def test_cudnn_segment_bound_is_refused_by_other_backends(self):
    for impl in ("xla", "pallas"):
      with pytest.raises(AttentionInputError, match=f"`cudnn_segment_bound`=8 is a cuDNN "
                         f"setting, but implementation='{impl}' does not use it"):
        segment_attention(self.q, self.k, self.v, self.seg, implementation=impl,
                          cudnn_segment_bound=8)

  def test_noncontiguous_segments_concrete(self):
    seg = jnp.array([[1] * 8 + [2] * 8 + [1] * 16, [1] * 32])
    with pytest.raises(NonContiguousSegmentsError, match="row 0 reopens segment 1 at position 16"):
      segment_attention(self.q, self.k, self.v, seg, check_segments=True)
    segment_attention(self.q, self.k, self.v, self.seg, check_segments=True)  # contiguous: fine

  def test_noncontiguous_segments_under_jit(self):
    seg = jnp.array([[1] * 32, [3] * 4 + [0] * 4 + [3] * 24])
    f = jax.jit(lambda s: segment_attention(self.q, self.k, self.v, s, check_segments=True))
    with pytest.raises(Exception, match="row 1 reopens segment 3 at position 8"):
      jax.block_until_ready(f(seg))
    jax.block_until_ready(f(self.seg))


def test_pallas_options_are_frozen_keyword_only_with_auto_defaults():
  opts = PallasOptions()
  assert (opts.block_q, opts.block_k, opts.block_q_bwd, opts.block_k_bwd, opts.num_warps,
          opts.num_stages, opts.smem_bytes, opts.interpret) == ("auto",) * 6 + (None, False)
  with pytest.raises(TypeError):
    PallasOptions(64)  # pylint: disable=too-many-function-args
  with pytest.raises(AttributeError):
    opts.interpret = True
  assert hash(PallasOptions(block_q=32)) == hash(PallasOptions(block_q=32))  # a static argument


def test_resolve_implementation_rules():
  """None by platform; settings only for their backend; Pallas on the CPU only interpreted."""
  resolve = attention_lib.resolve_implementation
  assert resolve(implementation=None, platform="gpu") == "pallas"
  assert resolve(implementation=None, platform="cpu") == "xla"
  assert resolve(implementation=None, platform="gpu", pallas=PallasOptions()) == "pallas"
  assert resolve(implementation="cudnn", platform="cpu", cudnn_segment_bound=4) == "cudnn"
  interpret = PallasOptions(interpret=True)
  assert resolve(implementation="pallas", platform="cpu", pallas=interpret) == "pallas"
  assert resolve(implementation="pallas") == "pallas"  # no platform: a CPU may lower for cuda
  for pallas in (None, PallasOptions(block_q=32)):
    with pytest.raises(AttentionInputError, match=r"implementation='pallas' on the CPU needs "
                       rf"`pallas.interpret=True`.*got pallas={re.escape(repr(pallas))}"):
      resolve(implementation="pallas", platform="cpu", pallas=pallas)
  with pytest.raises(AttentionInputError,
                     match=r"implementation=None \(here 'xla'\) does not use it"):
    resolve(implementation=None, platform="cpu", pallas=interpret)
  with pytest.raises(AttentionInputError, match=r"`pallas` must be a PallasOptions or None, got "
                     r"\{'interpret': True\}"):
    resolve(implementation="pallas", pallas={"interpret": True})
  with pytest.raises(AttentionInputError, match="got 'flash'"):
    resolve(implementation="flash", platform="cpu")


def test_backend_mesh_runs_kernels_under_the_mesh_and_leaves_xla_to_the_partitioner():
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  assert attention_lib.backend_mesh(implementation="xla", mesh=mesh) is None
  for impl in ("pallas", "cudnn"):
    assert attention_lib.backend_mesh(implementation=impl, mesh=mesh) is mesh
    assert attention_lib.backend_mesh(implementation=impl, mesh=None) is None
  default = attention_lib.default_implementation()
  assert attention_lib.backend_mesh(implementation=None, mesh=mesh) is (
      None if default == "xla" else mesh)
