"""Tests for segpack.loss: a naive per-token oracle, exact accumulation and sharding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from segpack import loss as loss_lib


def _naive_loss(logits, labels):
  """Per-token python loop: -log softmax(logits)[label], averaged over trained tokens."""
  total, count = 0.0, 0
  for b in range(labels.shape[0]):
    for s in range(labels.shape[1]):
      y = int(labels[b, s])
      if y == -100:
        continue
      row = logits[b, s].astype(np.float64)
      log_z = math.log(sum(math.exp(v) for v in row))
      total += log_z - row[y]
      count += 1
  return total / count, count


def _random_batch(seed, b=4, s=16, v=11, pad_frac=0.4):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, s, v)).astype(np.float32) * 3
  labels = rng.integers(0, v, size=(b, s)).astype(np.int32)
  labels[rng.random((b, s)) < pad_frac] = -100
  labels[0, :] = -100  # one row without any trained token
  labels[1, :] = rng.integers(0, v, size=s)  # one row fully trained
  return logits, labels


def test_matches_naive_oracle():
  logits, labels = _random_batch(0)
  want, count = _naive_loss(logits, labels)
  got, num = loss_lib.cross_entropy_loss(jnp.asarray(logits), jnp.asarray(labels))
  assert float(num) == count
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_is_token_weighted_not_mean_of_row_means():
  logits, labels = _random_batch(1)
  got, _ = loss_lib.cross_entropy_loss(jnp.asarray(logits), jnp.asarray(labels))
  row_means = [_naive_loss(logits[i:i + 1], labels[i:i + 1])[0]
               for i in range(1, labels.shape[0])]
  assert abs(float(got) - np.mean(row_means)) > 1e-3  # the batch is built so they differ
  np.testing.assert_allclose(float(got), _naive_loss(logits, labels)[0], rtol=1e-5)


def test_accumulation_with_global_normalizer_is_exact():
  logits, labels = _random_batch(2, b=8)
  logits, labels = jnp.asarray(logits), jnp.asarray(labels)

  def full(lo):
    return loss_lib.cross_entropy_loss(lo, labels)[0]

  def accumulated(lo):
    total = loss_lib.count_trained_tokens(labels)
    return sum(loss_lib.cross_entropy_loss(lo[i:i + 2], labels[i:i + 2], normalizer=total)[0]
               for i in range(0, 8, 2))

  np.testing.assert_allclose(float(accumulated(logits)), float(full(logits)), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(accumulated)(logits), jax.grad(full)(logits), atol=1e-7)


def test_sharded_over_devices_equals_single_device():
  logits, labels = _random_batch(3, b=8)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  sharded = NamedSharding(mesh, P("data"))
  fn = jax.jit(lambda lo, la: loss_lib.cross_entropy_loss(lo, la)[0])
  got = fn(jax.device_put(logits, sharded), jax.device_put(labels, sharded))
  np.testing.assert_allclose(float(got), _naive_loss(logits, labels)[0], rtol=1e-5)


def test_ignored_tokens_get_no_gradient_and_empty_batch_is_zero():
  logits, labels = _random_batch(4)
  grad = jax.grad(lambda lo: loss_lib.cross_entropy_loss(lo, jnp.asarray(labels))[0])(
      jnp.asarray(logits))
  assert np.all(np.asarray(grad)[labels == -100] == 0)
  empty = jnp.full(labels.shape, -100)
  loss, num = loss_lib.cross_entropy_loss(jnp.asarray(logits), empty)
  assert float(loss) == 0.0 and float(num) == 0.0


def test_bfloat16_logits_are_upcast():
  logits, labels = _random_batch(5)
  got, _ = loss_lib.cross_entropy_loss(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(labels))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), _naive_loss(logits, labels)[0], rtol=2e-2)


def test_shape_mismatch_names_both_shapes():
  with pytest.raises(ValueError, match=r"\(2, 3, 5\).*\(2, 4\)"):
    loss_lib.cross_entropy_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
