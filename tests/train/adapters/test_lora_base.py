"""The frozen base: a quantized kernel is read one device slice at a time (each slice reads only
the whole 64-row blocks it covers, never the tensor) and equals quantizing the whole tensor; the
fingerprint does not depend on the mesh and changes with one element."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from train.adapters import base as base_lib
from train.model import quantize as quantize_lib


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("spec", [P("a", "b"), P("b", None), P(None, "a")])
def test_a_quantized_kernel_is_read_a_slice_at_a_time(kind, spec):
  rng = np.random.default_rng(0)
  w_IxO = rng.normal(0, 0.05, (512, 16)).astype(np.float32)
  reads = []

  def read(index):  # the float tensor's slice reader (`train.hf.weights.slice_reader`)
    reads.append(index)
    return w_IxO[index]

  mesh = jax.make_mesh((2, 4), ("a", "b"))
  codes_want, scales_want = quantize_lib.quantize(kind=kind, w_IxO=w_IxO)
  for part, want in (("kernel", codes_want), ("kernel_scale", scales_want)):
    reads.clear()
    callback = base_lib._quantized_reader(  # pylint: disable=protected-access
        read, kind=kind, part=part, in_features=512, rows=want.shape[0])
    got = jax.make_array_from_callback(want.shape, NamedSharding(mesh, spec), callback)
    np.testing.assert_array_equal(np.asarray(got), want)
    split = spec[0] is not None
    for rows, _ in reads:  # whole blocks, and only a part of the tensor when rows are split
      assert rows.start % 64 == 0 and rows.stop % 64 == 0
      assert (rows.stop - rows.start) < 512 or not split


def test_the_fingerprint_ignores_the_mesh_and_sees_one_element():
  rng = np.random.default_rng(1)
  params = {"a": jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16),
            "b": jnp.asarray(rng.integers(0, 255, (32, 32)), jnp.uint8),
            "c": jnp.asarray(rng.normal(size=(64,)), jnp.float32)}
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  placed = {"a": jax.device_put(params["a"], NamedSharding(mesh, P("x", "y"))),
            "b": jax.device_put(params["b"], NamedSharding(mesh, P("y", None))),
            "c": jax.device_put(params["c"], NamedSharding(mesh, P("y")))}
  assert base_lib.fingerprint(params) == base_lib.fingerprint(placed)
  for name, x in params.items():  # negative controls: one element, a swap of two
    bumped = dict(params, **{name: x.at[(3,) * x.ndim].set(x[(3,) * x.ndim] + 1)})
    assert base_lib.fingerprint(bumped) != base_lib.fingerprint(params), name
  swapped = dict(params, a=params["a"].at[0, 0].set(params["a"][1, 1]).at[1, 1].set(
      params["a"][0, 0]))
  # An exchange of two values keeps every order-free sum: a limit the docstring states.
  assert base_lib.fingerprint(swapped) == base_lib.fingerprint(params)
  assert base_lib.fingerprint(dict(params, c=params["c"].astype(jnp.bfloat16))) != (
      base_lib.fingerprint(params))
