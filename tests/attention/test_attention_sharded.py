"""segment_attention under jit with NamedSharding on the 8 forced CPU devices (shard_map).

The mesh is the trainer's (`train.sharding.make_mesh`, axes `segpack.mesh.MESH_AXES`), and the
calls leave `batch_axis`/`head_axis` at their defaults unless a test is about them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from segpack.attention import AttentionInputError, PallasOptions, segment_attention
from segpack.mesh import BATCH_AXES, MESH_AXES, TENSOR_AXIS
from support.attention_inputs import layouts, random_inputs
from train import sharding as sharding_lib


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 8, "tests/conftest.py forces 8 CPU devices"
  return sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)


def test_the_trainer_mesh_uses_the_shared_axis_names(mesh):
  assert mesh.axis_names == MESH_AXES == ("data", "fsdp", "context", "tensor")
  assert BATCH_AXES == ("data", "fsdp") and TENSOR_AXIS == "tensor"


def test_sharded_pallas_matches_unsharded_xla_forward_and_grads(mesh):
  s = 128
  seg = jnp.asarray(np.concatenate([layouts(s), layouts(s)[::-1]]))  # B = 8
  q, k, v, dout = random_inputs(11, 8, s, 4, 2, 64)
  heads = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
  rows = NamedSharding(mesh, P(("data", "fsdp"), None))
  qs, ks, vs, dos = (jax.device_put(x, heads) for x in (q, k, v, dout))
  segs = jax.device_put(seg, rows)

  def fwd_bwd(impl, mesh_arg):
    pallas = PallasOptions(interpret=True, block_q=64, block_k=64) if impl == "pallas" else None

    def f(q, k, v, seg, dout):
      fn = lambda q, k, v: segment_attention(
          q, k, v, seg, implementation=impl, pallas=pallas, mesh=mesh_arg)
      out, vjp = jax.vjp(fn, q, k, v)
      return out, vjp(dout)
    return jax.jit(f)

  out, grads = fwd_bwd("pallas", mesh)(qs, ks, vs, segs, dos)
  # The default axes split the batch over data x fsdp and the heads over tensor.
  assert out.sharding.is_equivalent_to(heads, 4)
  out_x, grads_x = fwd_bwd("xla", None)(q, k, v, seg, dout)
  np.testing.assert_allclose(out, out_x, atol=2e-5)
  for got, want in zip(grads, grads_x):
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_sharded_rejects_indivisible_heads(mesh):
  q, k, v, _ = random_inputs(0, 4, 32, 2, 1, 16)
  with pytest.raises(AttentionInputError, match="key/value heads K=1 is not divisible by mesh "
                     "axis 'tensor' of size 2"):
    segment_attention(q, k, v, jnp.ones((4, 32), jnp.int32), mesh=mesh)


def test_sharded_rejects_unknown_axis(mesh):
  q, k, v, _ = random_inputs(0, 4, 32, 2, 2, 16)
  with pytest.raises(AttentionInputError, match="'model', not an axis of the mesh"):
    segment_attention(q, k, v, jnp.ones((4, 32), jnp.int32), mesh=mesh, head_axis="model")


def test_default_axes_name_the_mesh_axes_they_need():
  """A mesh without the default batch axes gets an error naming the missing axis."""
  q, k, v, _ = random_inputs(0, 4, 32, 2, 2, 16)
  other = jax.make_mesh((4, 2), ("batch", "heads"))
  with pytest.raises(AttentionInputError, match="names 'data', not an axis of the mesh"):
    segment_attention(q, k, v, jnp.ones((4, 32), jnp.int32), mesh=other)


def test_batch_over_a_tuple_of_axes_and_replicated_heads(mesh):
  """Batch split over every mesh axis (8 ways), heads not split; XLA backend under shard_map."""
  seg = jnp.asarray(np.concatenate([layouts(32), layouts(32)]))
  q, k, v, _ = random_inputs(2, 8, 32, 2, 1, 16)
  f = jax.jit(lambda q, k, v, s: segment_attention(
      q, k, v, s, mesh=mesh, batch_axis=MESH_AXES, head_axis=None))
  rows = NamedSharding(mesh, P(MESH_AXES))
  out = f(*(jax.device_put(x, rows) for x in (q, k, v, seg)))
  np.testing.assert_allclose(out, segment_attention(q, k, v, seg), atol=1e-6)
