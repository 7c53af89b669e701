"""One adapted projection against NumPy: `x @ W + alpha / r * (x @ A) @ B`, with a float or a
quantized (dequantized by NumPy's own unpacking) kernel; dropout only inside a training step's
`dropout_key`, unbiased, at its rate, and the same for the same key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.architecture import Lora
from train.model import lora as lora_lib
from train.model import quantize as quantize_lib


def _layer(*, rank=4, alpha=8.0, base_dtype="param", dropout=0.0, d_in=128, d_out=32, seed=0):
  lora = Lora(rank=rank, alpha=alpha, base_dtype=base_dtype, dropout=dropout)
  layer = lora_lib.linear(d_in, d_out, name="q", lora=lora, bias=False, dtype=jnp.float32,
                          param_dtype=jnp.float32, std=0.2, rngs=nnx.Rngs(params=seed))
  rng = np.random.default_rng(seed)
  layer.lora.lora_b[...] = jnp.asarray(rng.normal(0, 0.3, (rank, d_out)), jnp.float32)
  return layer, rng


def test_forward_equals_numpy_with_a_float_base():
  layer, rng = _layer()
  x = rng.normal(size=(2, 5, 128)).astype(np.float32)
  w, a, b = (np.asarray(v[...]) for v in (layer.kernel, layer.lora.lora_a, layer.lora.lora_b))
  np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), x @ w + 2.0 * (x @ a) @ b,
                             rtol=1e-5, atol=1e-5)
  # Negative control: Flax's own LoRA layer, unscaled, is another function.
  assert np.abs(np.asarray(layer.lora(jnp.asarray(x))) - 2.0 * (x @ a) @ b).max() > 1e-3


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_forward_of_a_quantized_base_equals_numpy_unpacking(kind):
  layer, rng = _layer(base_dtype=kind)
  w = rng.normal(0, 0.2, (128, 32)).astype(np.float32)
  codes, scales = quantize_lib.quantize(kind=kind, w_IxO=w)
  layer.kernel[...], layer.kernel_scale[...] = jnp.asarray(codes), jnp.asarray(scales)
  if kind == "nf4":  # low nibble: row 2i, high nibble: row 2i + 1
    rows = np.stack([codes & 15, codes >> 4], axis=1).reshape(128, 32)
    w_hat = quantize_lib.NF4_CODE[rows] * np.repeat(scales, 64, axis=0)
  else:
    w_hat = codes.astype(np.float32) / 127.0 * np.repeat(scales, 64, axis=0)
  assert np.abs(w_hat - w).max() < 0.15 * np.abs(w).max()  # half the widest NF4 gap
  x = rng.normal(size=(3, 128)).astype(np.float32)
  a, b = np.asarray(layer.lora.lora_a[...]), np.asarray(layer.lora.lora_b[...])
  np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), x @ w_hat + 2.0 * (x @ a) @ b,
                             rtol=1e-4, atol=1e-4)


def test_dropout_is_unbiased_at_its_rate_and_only_inside_a_training_step():
  layer, rng = _layer(dropout=0.25)
  x = jnp.asarray(rng.normal(size=(1, 64, 128)).astype(np.float32))
  plain = np.asarray(layer(x))  # no key: evaluation, scoring and sampling never drop
  w = np.asarray(layer.kernel[...])
  delta = plain - np.asarray(x) @ w

  @jax.jit
  def dropped(key):
    with lora_lib.dropout_key(key):
      return layer(x) - x @ w

  outs = np.stack([np.asarray(dropped(jax.random.key(i))) for i in range(300)])
  assert np.abs(outs.mean(0) - delta).max() < 0.15 * np.abs(delta).max()  # unbiased
  assert np.abs(outs[0] - delta).max() > 0.1 * np.abs(delta).max()  # it does drop
  np.testing.assert_array_equal(np.asarray(dropped(jax.random.key(7))),
                                np.asarray(dropped(jax.random.key(7))))
  # The rate: the adapter's input x' = mask * x / 0.75, so A's input has 25% zeros.
  with lora_lib.dropout_key(jax.random.key(3)):
    kept = np.asarray(lora_lib._dropped(x, 0.25, None, None))  # pylint: disable=protected-access
  assert abs(float(np.mean(kept == 0)) - 0.25) < 0.02
  np.testing.assert_allclose(kept[kept != 0], np.asarray(x)[kept != 0] / 0.75, rtol=1e-6)
