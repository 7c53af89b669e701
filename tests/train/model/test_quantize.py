"""train.model.quantize: NF4 and int8 kernels, blockwise along I, and their dequantization.

Oracles: the NF4 table derived again from the paper's quantiles of N(0, 1); a naive per-element
loop for the nibble layout; brute force for the nearest value; the quantization of the whole
tensor for `source_rows`; the unsharded result for `dequantize` on a mesh of explicit axes.
"""

import statistics

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from segpack.errors import UserError
from train.model import quantize as q

OFFSET = 0.9677083  # QLoRA's appendix: the outermost quantile, (1 - 1/(2*15) + 1 - 1/(2*16)) / 2
NF4_HALF_GAP = float(np.max(np.diff(q.NF4_CODE.astype(np.float64)))) / 2
SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True)


def _kernel(shape, seed=0, dtype=np.float32):
  """A random kernel whose blocks have very different magnitudes (64-row blocks)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape).astype(np.float32)
  w *= np.repeat(10.0 ** rng.uniform(-3, 2, (shape[0] // q.BLOCK, 1)), q.BLOCK, axis=0)
  return w.astype(dtype)


def _dequantized(kind, w_IxO):
  codes, scales = q.quantize(kind=kind, w_IxO=w_IxO)
  return np.asarray(q.dequantize(kind=kind, codes=codes, scales=scales, dtype=jnp.float32))


def _block_absmax_IxO(w_IxO):
  """Each element's block absmax (its 64-row block, its column), `[I, O]`."""
  blocks = np.abs(w_IxO.astype(np.float32)).reshape(-1, q.BLOCK, w_IxO.shape[1]).max(axis=1)
  return np.repeat(blocks, q.BLOCK, axis=0)


def _within_block_bound(kind, w_IxO, got_IxO):
  """Whether every element is within the per-block error bound of `kind` (plus float32 rounding:
  a few ulps of the block's absmax)."""
  per_unit = NF4_HALF_GAP if kind == "nf4" else 1 / 254
  bound = _block_absmax_IxO(w_IxO) * (per_unit + 1e-6)
  return bool(np.all(np.abs(got_IxO - w_IxO.astype(np.float32)) <= bound))


def test_nf4_code_is_the_papers_construction():
  """8 positive quantiles over [0.5, offset], 7 negative, an exact 0, normalized to [-1, 1]."""
  inv = statistics.NormalDist().inv_cdf
  positive = [inv(p) for p in np.linspace(OFFSET, 0.5, 9)[:-1]]
  negative = [-inv(p) for p in np.linspace(OFFSET, 0.5, 8)[:-1]]
  values = np.sort(np.array(positive + [0.0] + negative))
  values /= values.max()
  assert q.NF4_CODE.dtype == np.float32 and q.NF4_CODE.shape == (16,)
  np.testing.assert_allclose(q.NF4_CODE, values, rtol=0, atol=1e-6)
  assert q.NF4_CODE[0] == -1.0 and q.NF4_CODE[7] == 0.0 and q.NF4_CODE[-1] == 1.0
  assert np.all(np.diff(q.NF4_CODE) > 0)


@pytest.mark.parametrize("kind", q.KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_round_trip_is_within_the_per_block_bound(kind, dtype):
  w = _kernel((256, 48), seed=1, dtype=dtype)
  got = _dequantized(kind, w)
  assert _within_block_bound(kind, w, got)
  shapes = q.quantized_shapes(kind=kind, shape_IxO=w.shape)
  codes, scales = q.quantize(kind=kind, w_IxO=w)
  assert (codes.shape, scales.shape) == (shapes["kernel"], shapes["kernel_scale"])
  assert codes.dtype == (np.uint8 if kind == "nf4" else np.int8) and scales.dtype == np.float32
  np.testing.assert_array_equal(scales, _block_absmax_IxO(w)[::q.BLOCK])


@pytest.mark.parametrize("kind", q.KINDS)
def test_one_scale_per_column_fails_the_bound_on_one_huge_block(kind):
  """The negative control: ignoring the blocks (the column's absmax for all its rows) loses the
  small blocks beside a huge one, and the bound check sees it; the blockwise codes pass."""
  w = _kernel((192, 8), seed=2)
  w[64:128] *= 1e4
  assert _within_block_bound(kind, w, _dequantized(kind, w))
  # per column: every row's block absmax replaced by the column's absmax
  column_max = np.abs(w).max(axis=0, keepdims=True)
  unit = w / column_max
  if kind == "nf4":
    nearest = np.abs(unit[..., None] - q.NF4_CODE).argmin(axis=-1)
    per_column = q.NF4_CODE[nearest] * column_max
  else:
    per_column = np.rint(unit * 127) / 127 * column_max
  assert not _within_block_bound(kind, w, per_column)


def test_nf4_nibbles_match_a_per_element_loop():
  w = _kernel((64, 3), seed=3)
  codes, scales = q.quantize(kind="nf4", w_IxO=w)
  for i in range(0, 64, 2):
    for o in range(3):
      pair = []
      for row in (i, i + 1):
        unit = float(w[row, o]) / float(scales[row // 64, o])
        pair.append(min(range(16), key=lambda k, u=unit: abs(float(q.NF4_CODE[k]) - u)))
      assert int(codes[i // 2, o]) == pair[0] | (pair[1] << 4), (i, o)


def test_int8_codes_match_a_per_element_loop():
  w = _kernel((128, 3), seed=4)
  codes, scales = q.quantize(kind="int8", w_IxO=w)
  for i in range(128):
    for o in range(3):
      assert int(codes[i, o]) == round(float(w[i, o]) / float(scales[i // 64, o]) * 127)


def test_nf4_picks_the_nearest_value_by_brute_force():
  rng = np.random.default_rng(5)
  w = rng.uniform(-1, 1, (64 * 40, 16)).astype(np.float32)
  w[::64] = 1.0  # absmax 1 in every block: the normalized weights are the weights
  w[1:20] = np.repeat(q.NF4_CODE, 2)[:19, None]  # the table's own values, exactly
  codes, _ = q.quantize(kind="nf4", w_IxO=w)
  got = np.stack([codes & 15, codes >> 4], axis=1).reshape(w.shape)
  distances = np.abs(w.astype(np.float64)[..., None] - q.NF4_CODE.astype(np.float64))
  chosen = np.take_along_axis(distances, got[..., None].astype(np.int64), axis=-1)[..., 0]
  assert np.all(chosen <= distances.min(axis=-1) + 1e-7)
  np.testing.assert_array_equal(q.NF4_CODE[got[1:20]], w[1:20])


def test_nf4_bytes_are_under_a_third_of_bfloat16():
  shapes = q.quantized_shapes(kind="nf4", shape_IxO=(4096, 4096))
  nf4_bytes = np.prod(shapes["kernel"]) * 1 + np.prod(shapes["kernel_scale"]) * 4
  assert nf4_bytes / (4096 * 4096 * 2) <= 0.30
  assert q.quantized_shapes(kind="int8", shape_IxO=(128, 5)) == {"kernel": (128, 5),
                                                                  "kernel_scale": (2, 5)}


@pytest.mark.parametrize("kind", q.KINDS)
def test_an_all_zero_block_decodes_to_zero(kind):
  w = _kernel((128, 4), seed=6)
  w[64:, 1] = 0.0
  codes, scales = q.quantize(kind=kind, w_IxO=w)
  assert scales[1, 1] == 0.0
  got = np.asarray(q.dequantize(kind=kind, codes=codes, scales=scales, dtype=jnp.bfloat16))
  assert np.all(np.isfinite(got.astype(np.float32)))
  assert np.all(got[64:, 1] == 0)


def test_a_bad_shape_or_kind_is_refused_in_one_line():
  with pytest.raises(q.QuantizeError) as info:
    q.check_quantizable(kind="nf4", shape_IxO=(100, 32), name="layers/0/attn/q/kernel")
  message = str(info.value)
  assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
  assert "\n" not in message
  assert "layers/0/attn/q/kernel" in message and "(100, 32)" in message and "64" in message
  with pytest.raises(q.QuantizeError, match=r"model\.lora\.base_dtype='nf3'.*'nf4', 'int8'"):
    q.check_quantizable(kind="nf3", shape_IxO=(64, 32), name="x")
  with pytest.raises(q.QuantizeError, match=r"w_IxO has shape \(96, 2\)"):
    q.quantize(kind="int8", w_IxO=np.ones((96, 2), np.float32))


@pytest.mark.parametrize("kind", q.KINDS)
@pytest.mark.parametrize("codes_spec,scales_spec", [
    (P("a", "b"), P("b", None)), (P("a", "b"), P("a", "b")), (P("b", None), P(None, "a"))])
def test_dequantize_on_a_mesh_of_explicit_axes_equals_unsharded(kind, codes_spec, scales_spec):
  assert len(jax.devices()) >= 8, "tests/conftest.py forces 8 CPU devices"
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  codes, scales = q.quantize(kind=kind, w_IxO=_kernel((512, 64), seed=7))
  run = jax.jit(lambda c, s: q.dequantize(kind=kind, codes=c, scales=s, dtype=jnp.bfloat16))
  expected = np.asarray(run(codes, scales))
  got = run(jax.device_put(codes, NamedSharding(mesh, codes_spec)),
            jax.device_put(scales, NamedSharding(mesh, scales_spec)))
  assert got.shape == (512, 64) and got.dtype == jnp.bfloat16
  assert jax.typeof(got).sharding.spec == codes_spec  # laid out as the codes
  np.testing.assert_array_equal(np.asarray(got), expected)


@SETTINGS
@given(kind=st.sampled_from(q.KINDS), part=st.sampled_from(["kernel", "kernel_scale"]),
       blocks=st.integers(1, 6), data=st.data())
def test_source_rows_read_whole_blocks_and_keep_the_devices_rows(kind, part, blocks, data):
  in_features = blocks * q.BLOCK
  w = _kernel((in_features, 3), seed=blocks)
  full = dict(zip(["kernel", "kernel_scale"], q.quantize(kind=kind, w_IxO=w)))[part]
  start = data.draw(st.integers(0, full.shape[0]), label="start")
  stop = data.draw(st.integers(start, full.shape[0]), label="stop")
  read, keep = q.source_rows(kind=kind, rows=slice(start, stop), in_features=in_features,
                             part=part)
  assert read.start % q.BLOCK == 0 and (read.stop % q.BLOCK == 0 or read.stop == in_features)
  assert 0 <= read.start <= read.stop <= in_features
  if stop > start:
    assert read.stop - read.start <= (stop - start) * (in_features // full.shape[0]) + 2 * q.BLOCK
    local = dict(zip(["kernel", "kernel_scale"], q.quantize(kind=kind, w_IxO=w[read])))[part]
    np.testing.assert_array_equal(local[keep], full[start:stop])
  else:
    assert keep.stop == keep.start


def test_source_rows_example_and_open_slices():
  assert q.source_rows(kind="nf4", rows=slice(40, 50), in_features=256, part="kernel") == (
      slice(64, 128), slice(8, 18))
  assert q.source_rows(kind="int8", rows=slice(None, None), in_features=128,
                       part="kernel_scale") == (slice(0, 128), slice(0, 2))
