"""segment_attention with `mesh=` on meshes of `Explicit` and `Auto` axes (`jax.make_mesh`).

`jax.make_mesh` makes `Explicit` axes by default; `shard_map` then accepts only inputs typed as
its specs, so `segment_attention` must reshard them first. Every backend that runs on the CPU
(XLA; Pallas in interpret mode; the context-parallel path of both) is run on explicit, auto and
mixed meshes (batch, batch x heads, batch x context, the trainer's four axes), eagerly and under
`jit`, with inputs unplaced or placed on the mesh other than the specs. The oracle is the XLA
backend without a mesh, run on one document at a time (a `[1, n]` row per document, put back in
place; zeros at padding), forward and, for some cases, dq/dk/dv.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from segpack.attention import AttentionInputError, PallasOptions, segment_attention
from segpack.mesh import CONTEXT_AXIS, MESH_AXES
from train import sharding as sharding_lib

B, S, H, K, D = 8, 32, 8, 4, 16
PALLAS = PallasOptions(interpret=True, block_q=16, block_k=16)
EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto

# name -> (mesh shape, axis names, segment_attention's axis arguments, slot order or None).
# "zigzag:cp": each of the cp context devices holds chunks i and 2 cp - 1 - i, ascending;
# "random": any permutation of each row (allowed without a context axis).
MESHES = {
    "batch": ((8,), ("data",), dict(batch_axis="data", head_axis=None), None),
    "batch_heads": ((2, 4), ("data", "tensor"), dict(batch_axis="data", head_axis="tensor"), None),
    "context": ((2, 4), ("data", CONTEXT_AXIS),
                dict(batch_axis="data", head_axis=None, context_axis=CONTEXT_AXIS), "zigzag:4"),
    "trainer": ((2, 1, 2, 2), MESH_AXES, dict(context_axis=CONTEXT_AXIS), "zigzag:2"),
    "whole_rows_any_order": ((2, 4), ("data", "tensor"),
                             dict(batch_axis="data", head_axis="tensor"), "random"),
}


def make_mesh(name: str, kind: AxisType | tuple[AxisType, ...]) -> jax.sharding.Mesh:
  shape, axes, _, _ = MESHES[name]
  kinds = kind if isinstance(kind, tuple) else (kind,) * len(axes)
  return jax.make_mesh(shape, axes, axis_types=kinds)


def rows() -> np.ndarray:
  """`[B, S]` segment ids: documents of random lengths (1 to 12) crossing every device boundary,
  then a padding tail; one row a single document, one all padding."""
  rng = np.random.default_rng(7)
  out = np.zeros((B, S), np.int32)
  for r in range(B - 2):
    pos, sid = 0, 1
    while pos < S - 3:
      n = int(rng.integers(1, 13))
      out[r, pos:pos + n] = sid
      pos, sid = pos + n, sid + 1
  out[B - 2] = 3
  return out


def inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  return mk(B, S, H, D), mk(B, S, K, D), mk(B, S, K, D), mk(B, S, H, D)


def per_document(q, k, v, seg: np.ndarray):
  """The oracle: the XLA backend without a mesh on every document alone, put back in place."""
  out = jnp.zeros_like(q)
  for b in range(seg.shape[0]):
    for doc in np.unique(seg[b][seg[b] != 0]):
      lo, hi = (int(i) for i in np.flatnonzero(seg[b] == doc)[[0, -1]])
      one = lambda x: x[b:b + 1, lo:hi + 1]
      part = segment_attention(one(q), one(k), one(v), jnp.ones((1, hi + 1 - lo), jnp.int32),
                               implementation="xla")
      out = out.at[b, lo:hi + 1].set(part[0])
  return out


def slot_order(kind: str) -> np.ndarray:
  """`[B, S]` slot indices: position i of a reordered row holds the natural slot `order[i]`."""
  if kind == "random":
    return np.stack([np.random.default_rng(r).permutation(S) for r in range(B)])
  cp = int(kind.split(":")[1])
  chunks = np.arange(S).reshape(2 * cp, S // (2 * cp))
  order = np.concatenate([chunks[[i, 2 * cp - 1 - i]].ravel() for i in range(cp)])
  return np.broadcast_to(order, (B, S)).copy()


def reorder(x, order: np.ndarray):
  return jnp.take_along_axis(x, jnp.asarray(order.reshape(order.shape + (1,) * (x.ndim - 2))),
                             axis=1)


@functools.lru_cache(maxsize=None)
def oracle(seed: int = 0):
  """`(inputs, out, dq, dk, dv)` in natural row order."""
  seg = rows()
  q, k, v, dout = inputs(seed)
  out, vjp = jax.vjp(jax.jit(lambda q, k, v: per_document(q, k, v, seg)), q, k, v)
  return (q, k, v, dout), out, *vjp(dout)


def call(name: str, mesh, impl: str, *, grads: bool = False, place=None, use_mesh=False):
  """Runs `segment_attention` on `mesh` under `jit`, inputs in the case's slot order; returns
  the output (and dq/dk/dv) put back in natural row order."""
  _, _, axes, kind = MESHES[name]
  (q, k, v, dout), *_ = oracle()
  order = None if kind is None else slot_order(kind)
  extra = {} if order is None else dict(slot_index=jnp.asarray(order, jnp.int32))
  seg = jnp.asarray(rows())
  args = (q, k, v, dout, seg) if order is None else tuple(reorder(x, order)
                                                         for x in (q, k, v, dout, seg))
  if place is not None:
    args = tuple(jax.device_put(x, NamedSharding(mesh, P(*tuple(place)[: x.ndim]))) for x in args)

  def f(q, k, v, dout, seg):
    fn = lambda q, k, v: segment_attention(
        q, k, v, seg, implementation=impl, pallas=PALLAS if impl == "pallas" else None,
        mesh=mesh, **axes, **extra)
    if not grads:
      return (fn(q, k, v),)
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(dout))

  if use_mesh:
    with jax.set_mesh(mesh):
      got = jax.jit(f)(*args)
  else:
    got = jax.jit(f)(*args)
  if order is None:
    return got
  back = np.argsort(order, axis=1)  # on the host: the outputs are typed with the mesh's axes
  return [np.take_along_axis(np.asarray(x), back[:, :, None, None], axis=1) for x in got]


def assert_matches(got, want):
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [EXPLICIT, AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("name", list(MESHES))
def test_every_backend_on_both_kinds_of_mesh_matches_the_oracle(name, impl, kind):
  _, out, *_ = oracle()
  assert_matches(call(name, make_mesh(name, kind), impl), [out])


@pytest.mark.parametrize("name,impl", [("trainer", "xla"), ("batch_heads", "pallas"),
                                       ("context", "pallas")])
def test_gradients_on_an_explicit_mesh_match_the_oracle(name, impl):
  _, *want = oracle()
  assert_matches(call(name, make_mesh(name, EXPLICIT), impl, grads=True), want)


def test_jax_make_mesh_is_explicit_and_so_is_the_trainers_mesh():
  """The premise of this file, and the trainer's mesh (docs/training.md, "What a run does")."""
  assert set(jax.make_mesh((8,), ("data",)).axis_types) == {EXPLICIT}
  assert set(sharding_lib.make_mesh(data=2, fsdp=2, tensor=2).axis_types) == {EXPLICIT}


@pytest.mark.parametrize("name,impl", [("trainer", "pallas"), ("whole_rows_any_order", "xla")])
def test_inputs_placed_otherwise_on_an_explicit_mesh_are_resharded(name, impl):
  """Inputs already sharded over the mesh, but not as the specs (rows over the sequence, or
  heads where the specs split none), under `jax.set_mesh`; the output carries the specs."""
  mesh = make_mesh(name, EXPLICIT)
  place = P(None, "data", "tensor") if name == "trainer" else P(None, "tensor")
  _, out, *_ = oracle()
  got = call(name, mesh, impl, place=place, use_mesh=True)
  assert_matches(got, [out])


def test_a_mesh_mixing_explicit_and_auto_axes():
  """`shard_map` checks no input on a mixed mesh, but `reshard` refuses a spec naming an `Auto`
  axis: the inputs are resharded over the explicit axes alone."""
  _, *want = oracle()
  mesh = make_mesh("trainer", (EXPLICIT, AUTO, AUTO, EXPLICIT))
  assert_matches(call("trainer", mesh, "xla", grads=True), want)
  mesh = make_mesh("batch_heads", (AUTO, EXPLICIT))
  assert_matches(call("batch_heads", mesh, "pallas"), want[:1])


def test_eager_call_on_the_default_mesh_with_checked_segments():
  """Outside `jit`, as the issue's example: `jax.make_mesh((2, 4), ("data", "tensor"))`."""
  (q, k, v, _), out, *_ = oracle()
  mesh = jax.make_mesh((2, 4), ("data", "tensor"))
  got = segment_attention(q, k, v, jnp.asarray(rows()), implementation="xla", mesh=mesh,
                          batch_axis="data", head_axis="tensor", check_segments=True)
  assert jax.typeof(got).sharding.spec == P("data", None, "tensor", None)
  assert_matches([got], [out])


@pytest.mark.parametrize("on_mesh", [False, True])
def test_pallas_on_the_cpu_without_interpret_mode_is_one_line(on_mesh):
  """Not Pallas's "Only interpret mode is supported on CPU backend", eagerly and under `jit`; a
  CPU host still lowers the same call for a GPU."""
  q, k, v, _ = inputs()
  seg = jnp.asarray(rows())
  axes = dict(mesh=jax.make_mesh((8,), ("data",)), batch_axis="data", head_axis=None) \
      if on_mesh else {}
  fn = lambda q: segment_attention(q, k, v, seg, implementation="pallas",
                                   pallas=PallasOptions(block_q=16, block_k=16), **axes)
  for run in (fn, jax.jit(fn), jax.jit(jax.grad(lambda q: fn(q).sum()))):
    with pytest.raises(AttentionInputError) as error:
      run(q)
    message = str(error.value)
    assert "\n" not in message and "PallasOptions(interpret=True)" in message, message
    assert "implementation='pallas'" in message and "Only interpret mode" not in message
  text = jax.jit(fn).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"custom_call @([\w$.]+)", text)) == {"__gpu$xla.gpu.triton"}


def test_the_decoder_and_the_pair_count_run_on_an_explicit_data_parallel_mesh():
  """`jax.make_mesh`'s default (explicit) axes with rows over `data` and slots over `context`:
  the decoder's embedding lookup names its output sharding, XLA attention gathers the key side,
  the causal-pair count gathers the slots; logits and the count equal those without a mesh."""
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec
  from support.packing_oracles import naive_rows
  from train.model import flops as flops_lib
  from train.model import config as model_config
  from train.model import decoder as model_lib
  cfg = model_config.DecoderConfig(vocab_size=50, num_layers=1, d_model=16, num_heads=2,
                                num_kv_heads=1, head_dim=8, d_ff=32, init_std=0.3,
                                attention_implementation="xla")
  model = model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0))
  rng = np.random.default_rng(0)
  rows = [[rng.integers(1, 50, n) for n in (5, 9, 2)] for _ in range(8)]
  batch = naive_rows(rows, 16)
  mesh = jax.make_mesh((4, 2), ("data", "context"))
  assert jax.sharding.AxisType.Explicit in mesh.axis_types
  sharding = NamedSharding(mesh, PartitionSpec("data", "context"))
  placed = {k: jax.device_put(np.asarray(v), sharding) for k, v in batch.items()}

  @jax.jit
  def run(ids, seg, pos):
    return (model(ids, segment_ids=seg, segment_positions=pos),
            flops_lib.attention_pairs(seg))

  want, want_pairs = run(*(jnp.asarray(batch[k]) for k in
                           ("input_ids", "segment_ids", "segment_positions")))
  got, got_pairs = run(placed["input_ids"], placed["segment_ids"], placed["segment_positions"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  assert float(got_pairs) == float(want_pairs) == 8 * (15 + 45 + 3)
