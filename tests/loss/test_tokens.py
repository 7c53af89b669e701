"""Tests for segpack.loss.tokens: a naive per-token oracle, exact accumulation and sharding;
the package's exports and its one ignored label."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from segpack import loss as loss_lib
from segpack.data import rows
from segpack.errors import ArgumentError
from segpack.loss import tokens


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


def test_the_loss_is_the_summed_token_losses_over_their_count():
  """`cross_entropy_loss` is `token_loss_sum` of `token_cross_entropy` over the count, to the
  bit, for both weightings."""
  logits, labels = (jnp.asarray(x) for x in _random_batch(6))
  seg = jnp.asarray(np.repeat(np.arange(1, 5), 4)[None].repeat(labels.shape[0], 0), jnp.int32)
  token_loss = loss_lib.token_cross_entropy(logits, labels)
  for weighting in loss_lib.WEIGHTINGS:
    loss_sum, count = loss_lib.token_loss_sum(token_loss, labels, weighting=weighting,
                                              segment_ids_BxS=seg)
    got, got_count = loss_lib.cross_entropy_loss(logits, labels, weighting=weighting,
                                                 segment_ids_BxS=seg)
    assert float(got) == float(loss_sum / jnp.maximum(count, 1.0))
    assert float(got_count) == float(count)


def test_an_unknown_weighting_is_an_argument_error_naming_it():
  logits, labels = (jnp.asarray(x) for x in _random_batch(7))
  with pytest.raises(ArgumentError, match="weighting must be one of .*got 'document'"):
    loss_lib.cross_entropy_loss(logits, labels, weighting="document")
  with pytest.raises(ValueError, match="token_loss_sum: weighting='sequence' needs"):
    loss_lib.token_loss_sum(jnp.zeros(labels.shape), labels, weighting="sequence")


def test_the_package_exports_every_name_and_one_ignored_label():
  for name in loss_lib.__all__:
    assert getattr(loss_lib, name) is not None, name
  assert loss_lib.cross_entropy_loss is tokens.cross_entropy_loss
  assert loss_lib.IGNORE_INDEX == tokens.IGNORE_INDEX == rows.IGNORE_INDEX == -100
  with pytest.raises(AttributeError, match="cross_entropy_sum"):
    loss_lib.cross_entropy_sum  # pylint: disable=pointless-statement


def test_the_ignored_label_is_read_without_jax():
  """The row builder (NumPy only) reads `IGNORE_INDEX` from the package without importing JAX."""
  code = ("import sys\nfrom segpack.data import rows\n"
          "assert rows.IGNORE_INDEX == -100 and 'jax' not in sys.modules, sorted(sys.modules)")
  subprocess.run([sys.executable, "-c", code], check=True)
