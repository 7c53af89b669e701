"""Tests for segpack.interop against naive per-row loops, in NumPy and in jnp under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import segpack
from segpack import interop


def random_rows(batch, seq_len, max_segments, seed):
  """Rows of contiguous segments 1..k (random lengths) followed by padding, built by hand."""
  rng = np.random.default_rng(seed)
  out = np.zeros((batch, seq_len), dtype=np.int32)
  for b in range(batch):
    k = int(rng.integers(0, max_segments + 1))
    i = 0
    for seg in range(1, k + 1):
      n = int(rng.integers(1, 6))
      out[b, i:i + n] = seg
      i += n
      if i >= seq_len:
        break
  return out


def naive_cu_seqlens(row, max_segments):
  offsets = [0]
  for seg in range(1, max_segments + 1):
    offsets.append(offsets[-1] + sum(1 for s in row if s == seg))
  return offsets


def naive_positions(row):
  out, prev, pos = [], None, 0
  for s in row:
    pos = pos + 1 if s == prev else 0
    prev = s
    out.append(pos if s else 0)
  return out


@pytest.mark.parametrize("max_segments", [1, 3, 8])
def test_cu_seqlens_numpy_and_jit(max_segments):
  ids = random_rows(6, 24, max_segments, seed=max_segments)
  want = np.array([naive_cu_seqlens(r, max_segments) for r in ids.tolist()])
  got = interop.cu_seqlens(ids, max_segments)
  assert isinstance(got, np.ndarray) and got.dtype == np.int32
  assert got.shape == (6, max_segments + 1)
  np.testing.assert_array_equal(got, want)
  jitted = jax.jit(interop.cu_seqlens, static_argnums=1)(jnp.asarray(ids), max_segments)
  assert jitted.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(jitted), want)
  np.testing.assert_array_equal(interop.cu_seqlens(ids[2], max_segments), want[2])  # [S]
  np.testing.assert_array_equal(
      np.asarray(jax.jit(interop.cu_seqlens, static_argnums=1)(jnp.asarray(ids[2]),
                                                               max_segments)), want[2])


def test_cu_seqlens_example_and_errors():
  np.testing.assert_array_equal(interop.cu_seqlens([1, 1, 2, 2, 2, 0], 3), [0, 2, 5, 5])
  np.testing.assert_array_equal(interop.cu_seqlens(np.zeros((2, 4), np.int32), 2), [[0, 0, 0]] * 2)
  with pytest.raises(ValueError, match="segment id 3 > max_segments=2"):
    interop.cu_seqlens([1, 2, 3], 2)
  with pytest.raises(ValueError, match="max_segments"):
    interop.cu_seqlens([1, 2], 0)
  with pytest.raises(ValueError, match="shape"):
    interop.cu_seqlens(np.zeros((1, 2, 3), np.int32), 2)
  with pytest.raises(ValueError, match="dtype"):
    interop.cu_seqlens(np.zeros(3, np.float32), 2)


def test_position_ids_numpy_and_jit():
  ids = random_rows(7, 30, 6, seed=1)
  ids[3] = 0  # an all-padding row
  ids[4] = 1  # one segment filling the row
  want = np.array([naive_positions(r) for r in ids.tolist()])
  got = interop.position_ids(ids)
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(jax.jit(interop.position_ids)(jnp.asarray(ids))), want)
  np.testing.assert_array_equal(interop.position_ids(ids[0]), want[0])
  np.testing.assert_array_equal(interop.position_ids([1, 1, 1, 2, 2, 0, 0]),
                                [0, 1, 2, 0, 1, 0, 0])


def test_agrees_with_pipeline_rows():
  rng = np.random.default_rng(0)
  docs = [rng.integers(3, 100, size=int(rng.integers(1, 30))).astype(np.uint16)
          for _ in range(40)]
  ds = segpack.pack_dataset(docs, plan=segpack.PlanOptions(seq_len=32, max_segments_per_row=4),
                            num_epochs=1, special_tokens=segpack.SpecialTokens(bos_id=1, eos_id=2))
  batch = ds.batch(len(ds))[0]
  np.testing.assert_array_equal(segpack.position_ids(batch["segment_ids"]),
                                batch["segment_positions"])
  cu = segpack.cu_seqlens(batch["segment_ids"], 4)
  np.testing.assert_array_equal(cu[:, -1], (batch["segment_ids"] > 0).sum(axis=1))
  for row, offsets in zip(batch["segment_ids"], cu):
    for k in range(4):
      assert (row[offsets[k]:offsets[k + 1]] == k + 1).all()
