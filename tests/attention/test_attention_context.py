"""Context parallelism in segment_attention: a row's slots split over a mesh axis (all-gather).

On the 8 forced CPU devices (tests/conftest.py): rows reordered by the project's orders
(`segpack.data.context_order.context_order`: "none", "zigzag", and "documents" computed per row from
the segment ids) and by a random valid chunk order, the sequence split over a "context" axis of 2, 4
or 8 devices (with and without a batch axis, and with a head axis), XLA and Pallas (interpret mode):
every (cp, batch axis, order) combination for both. The oracle is the float64 per-document NumPy
attention of `test_attention_oracle` on the rows in natural order; the sharded outputs and dq/dk/dv
are put back in natural order before comparing.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from segpack.attention import (AttentionInputError, NonContiguousSegmentsError, PallasOptions,
                               segment_attention)
from segpack.attention import blocks
from segpack.attention.context_parallel import context_comm_bytes
from segpack.attention.pallas import segment_attention_pallas_slots
from segpack.data.context_order import CONTEXT_BALANCES, context_order
from segpack.mesh import CONTEXT_AXIS
from support.attention_inputs import random_rows, layouts, random_inputs
from support.attention_oracle import reference

S = 128
AXES = ("data", CONTEXT_AXIS, "tensor")


def make_mesh(batch: int, context: int, tensor: int = 1) -> Mesh:
  devices = np.asarray(jax.devices()[:batch * context * tensor]).reshape(batch, context, tensor)
  return Mesh(devices, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def rows(s: int = S) -> np.ndarray:
  """Natural-order rows: documents crossing device boundaries, length-1 segments and a
  padding tail; one document spanning the whole row; short documents with padding gaps; ids not
  ordered, padding at the head."""
  out = np.zeros((4, s), np.int32)
  pos = 0
  for i, n in enumerate([37, 1, 1, 45, 2, 29]):  # 115 slots, then a padding tail
    out[0, pos:pos + n] = i + 1
    pos += n
  out[1] = 7
  pos, sid = 0, 1
  for n in [1, 5, 3, 20, 1, 1, 40, 9, 30]:
    out[2, pos:pos + n] = sid
    pos, sid = pos + n + 2, sid + 1
  out[3, 5:60], out[3, 60:61], out[3, 61:] = 9, 3, 4
  return out


ORDERS = CONTEXT_BALANCES + ("random",)


def chunk_order(s: int, cp: int, kind: str, seed: int = 0) -> np.ndarray:
  """`slot_index` of one row built by hand: `2 cp` chunks, two per device, ascending per device.

  "zigzag": device i gets chunks i and 2 cp - 1 - i; "random": chunks dealt at random (any valid
  assignment, beyond the project's orders).
  """
  n = 2 * cp
  chunks = np.arange(s).reshape(n, s // n)
  if kind == "zigzag":
    owned = [[i, n - 1 - i] for i in range(cp)]
  else:
    owned = np.random.default_rng(seed).permutation(n).reshape(cp, 2)
  return np.concatenate([chunks[sorted(pair)].ravel() for pair in owned])


def zigzag(s: int, cp: int) -> np.ndarray:
  """The project's zigzag `slot_index` of one row of `s` slots."""
  ones = np.ones((1, s), np.int32)
  return context_order(segment_ids_BxS=ones, context_size=cp, balance="zigzag")[0]


def slots_for(seg: np.ndarray, cp: int, kind: str) -> np.ndarray:
  """The `slot_index` of every row of `seg`: `context_order`'s (per row, from the segment ids,
  for "documents") for the project's balances, or a random chunk assignment per row."""
  if kind == "random":
    return np.stack([chunk_order(seg.shape[1], cp, kind, seed=r) for r in range(len(seg))])
  return context_order(segment_ids_BxS=seg, context_size=cp, balance=kind)


def permute(x, slot_BxS):
  """The rows of `x` in the reordered order (`x` in natural order)."""
  idx = slot_BxS.reshape(slot_BxS.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(jnp.asarray(x), jnp.asarray(idx), axis=1)


def unpermute(x, slot_BxS):
  return permute(x, np.argsort(slot_BxS, axis=1))


@functools.lru_cache(maxsize=None)
def _cp_program(impl, mesh, head_axis, causal, pallas):
  """The jitted forward and backward, one per configuration (the orders are inputs). A mesh
  whose "data" axis has one device is called without a batch axis (`batch_axis=None`)."""
  batch_axis = "data" if mesh.shape["data"] > 1 else None

  def f(q, k, v, dout, seg, slot):
    fn = lambda q, k, v: segment_attention(
        q, k, v, seg, slot_index=slot, causal=causal, implementation=impl, pallas=pallas,
        mesh=mesh, batch_axis=batch_axis, head_axis=head_axis, context_axis=CONTEXT_AXIS)
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(dout)

  return jax.jit(f)


def cp_fwd_bwd(impl, mesh, slot_BxS, seg, q, k, v, dout, *, head_axis=None, causal=True,
               pallas=None):
  """Output and dq/dk/dv of a context-parallel call, in natural order."""
  args = [permute(x, slot_BxS) for x in (q, k, v, dout, seg)] + [jnp.asarray(slot_BxS, jnp.int32)]
  heads = NamedSharding(mesh, P("data", CONTEXT_AXIS, head_axis, None))
  row_sh = NamedSharding(mesh, P("data", CONTEXT_AXIS))
  args = [jax.device_put(x, heads if x.ndim == 4 else row_sh) for x in args]

  out, grads = _cp_program(impl, mesh, head_axis, causal, pallas)(*args)
  assert out.sharding.is_equivalent_to(heads, 4)
  return [np.asarray(unpermute(x, slot_BxS)) for x in (out, *grads)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bq,bk", [(16, 32), (64, 32)])
def test_slot_block_ranges_are_sound(causal, bq, bk):
  """One device's queries (zigzag, cp = 4, chunks of 32) over the row's keys, against brute
  force: every needed tile is visited and the mask-free tiles need no mask. With the queries
  being the whole row in order, the ranges are the single-device ones."""
  rng = np.random.default_rng(bq + bk + causal)
  seg = np.concatenate([layouts(256), random_rows(rng, 4, 256)]).astype(np.int32)
  b, s = seg.shape
  kw = dict(block_q=bq, block_k=bk, causal=causal)
  natural = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  np.testing.assert_array_equal(blocks.slot_q_block_ranges(jnp.asarray(seg), natural, seg, **kw),
                                blocks.q_block_ranges(jnp.asarray(seg), **kw))
  np.testing.assert_array_equal(blocks.slot_kv_block_ranges(jnp.asarray(seg), natural, seg, **kw),
                                blocks.kv_block_ranges(jnp.asarray(seg), **kw))
  for device in range(4):
    q_pos = np.broadcast_to(zigzag(s, 4)[device * 64:(device + 1) * 64], (b, 64))
    seg_q = np.take_along_axis(seg, q_pos, axis=1)
    args = (jnp.asarray(seg_q), jnp.asarray(q_pos, jnp.int32), jnp.asarray(seg))
    qr = np.asarray(blocks.slot_q_block_ranges(*args, **kw))
    kr = np.asarray(blocks.slot_kv_block_ranges(*args, **kw))
    for r in range(b):
      mask = (seg_q[r][:, None] == seg[r][None, :]) & (seg_q[r][:, None] != 0)
      if causal:
        mask &= np.arange(s)[None, :] <= q_pos[r][:, None]
      tiles = mask.reshape(64 // bq, bq, s // bk, bk)
      needed, unmasked = tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))
      for ranges, need, full in ((qr[r], needed, unmasked), (kr[r], needed.T, unmasked.T)):
        for i, (lo, hi, flo, fhi) in enumerate(ranges):
          cols = np.flatnonzero(need[i])
          assert lo <= flo <= fhi <= hi
          assert np.all(full[i, flo:fhi]), (device, r, i, flo, fhi)
          if len(cols):
            assert lo <= cols[0] and cols[-1] < hi, (device, r, i, lo, hi, cols)


def test_pallas_slots_skip_blocks_of_other_documents():
  """One device's zigzag share (cp = 2) against the whole row: a NaN block of a document none of
  its queries belongs to is never loaded (a dense visit would spread it through 0 * NaN)."""
  seg = np.repeat([[1, 2, 3, 4]], 32, axis=1).astype(np.int32)  # four documents of 32 slots
  q, k, v, _ = random_inputs(4, 1, S, 1, 1, 16)
  v = v.at[0, 64:96].set(jnp.nan)  # document 3, held by the other device (chunks 1 and 2)
  slot = zigzag(S, 2)[None]
  mine = slot[:, :64]  # chunks 0 and 3: documents 1 and 4
  out = segment_attention_pallas_slots(
      permute(q, mine), permute(k, slot), permute(v, slot), permute(seg, mine), permute(seg, slot),
      jnp.asarray(mine, jnp.int32), jnp.asarray(slot, jnp.int32), causal=True, scale=0.25,
      pallas=PallasOptions(interpret=True, block_q=16, block_k=16))  # keys in device order
  want, _ = reference(q, k, jnp.nan_to_num(v), seg, causal=True, scale=0.25)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, permute(want, mine), atol=2e-5)


def _case(seed, heads, kv_heads):
  """`(seg, (q, k, v, dout), [out, dq, dk, dv] of the causal oracle)` on the rows of `rows()`."""
  seg = rows()
  q, k, v, dout = random_inputs(seed, 4, S, heads, kv_heads, 16)
  want, grads = reference(q, k, v, seg, causal=True, dout=dout)
  return seg, (q, k, v, dout), [want, *grads]


@pytest.fixture(scope="module")
def case():
  return _case(21, 4, 2)


@pytest.fixture(scope="module")
def small_case():
  """Fewer heads (H = 2, K = 1) for the slow Pallas interpret mode."""
  return _case(22, 2, 1)


def assert_matches(got, want):
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_orders_are_the_projects(cp):
  """The orders of the grids below: "none" and "zigzag" from `context_order` are the hand-made
  chunk assignments; "documents" (per row, from `rows()`) is a valid two-chunks-per-device order
  that differs from zigzag on the packed rows (so it is a case of its own) and equals it on the
  row one document fills."""
  seg = rows()
  chunk = S // (2 * cp)
  np.testing.assert_array_equal(slots_for(seg, cp, "none"), np.tile(np.arange(S), (4, 1)))
  np.testing.assert_array_equal(slots_for(seg, cp, "zigzag"),
                                np.tile(chunk_order(S, cp, "zigzag"), (4, 1)))
  docs, zig = slots_for(seg, cp, "documents"), slots_for(seg, cp, "zigzag")
  for row in docs:
    per_device = row.reshape(cp, 2, chunk)
    assert np.all(per_device[:, :, 0] % chunk == 0) and np.all(np.diff(per_device, axis=2) == 1)
    assert np.all(np.diff(row.reshape(cp, 2 * chunk), axis=1) > 0)  # ascending per device
  np.testing.assert_array_equal(np.sort(docs, axis=1), np.tile(np.arange(S), (4, 1)))
  assert np.any(docs[0] != zig[0]) and np.any(docs[2] != zig[2])
  np.testing.assert_array_equal(docs[1], zig[1])


@pytest.mark.parametrize("kind", ORDERS)
@pytest.mark.parametrize("batch,cp", [(1, 2), (1, 4), (1, 8), (2, 4), (4, 2)])
def test_xla_context_parallel_matches_oracle(case, batch, cp, kind):
  seg, inputs, want = case
  got = cp_fwd_bwd("xla", make_mesh(batch, cp), slots_for(seg, cp, kind), seg, *inputs)
  assert_matches(got, want)
  assert np.all(got[0][0, 115:] == 0) and np.all(got[1][0, 115:] == 0)  # padding tail


PALLAS = PallasOptions(interpret=True, block_q=16, block_k=16)


@pytest.mark.parametrize("kind", CONTEXT_BALANCES)
@pytest.mark.parametrize("batch,cp", [(1, 2), (4, 2), (1, 4), (2, 4), (1, 8)])
def test_pallas_context_parallel_matches_oracle(small_case, batch, cp, kind):
  """Every cp in {2, 4, 8}, without (batch 1) and with a batch axis (cp = 8 uses all eight
  devices, so only without), every project order: 15 cases. One compiled program per mesh, the
  orders being inputs."""
  seg, inputs, want = small_case
  got = cp_fwd_bwd("pallas", make_mesh(batch, cp), slots_for(seg, cp, kind), seg, *inputs,
                   pallas=PALLAS)
  assert_matches(got, want)
  assert np.all(got[0][0, 115:] == 0) and np.all(got[1][0, 115:] == 0)  # padding tail


def test_pallas_context_parallel_with_a_head_axis(case):
  """Batch, context and head axes together (K = 2 over two devices), a random chunk order."""
  seg, inputs, want = case
  got = cp_fwd_bwd("pallas", make_mesh(2, 2, 2), slots_for(seg, 2, "random"), seg, *inputs,
                   head_axis="tensor", pallas=PALLAS)
  assert_matches(got, want)


def test_not_causal_xla_and_pallas(small_case):
  seg, inputs, _ = small_case
  want = reference(*inputs[:3], seg, causal=False, dout=inputs[3])
  slot = slots_for(seg, 4, "zigzag")
  for impl, pallas in (("xla", None), ("pallas", PALLAS)):
    got = cp_fwd_bwd(impl, make_mesh(2, 4), slot, seg, *inputs, causal=False, pallas=pallas)
    assert_matches(got, [want[0], *want[1]])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_changing_one_document_changes_no_other(impl):
  """Row 0's document 4 (slots 39..83, on several devices) gets new q/k/v; nothing else moves."""
  seg = rows()
  q, k, v, dout = random_inputs(5, 4, S, 2, 1, 16)
  doc = np.zeros((4, S), bool)
  doc[0] = seg[0] == 4
  m = jnp.asarray(doc)[:, :, None, None]
  q2, k2, v2 = (jnp.where(m, 30.0 * x[::-1], x) for x in (q, k, v))
  slot = slots_for(seg, 8, "random")
  pallas = PALLAS if impl == "pallas" else None
  a = cp_fwd_bwd(impl, make_mesh(1, 8), slot, seg, q, k, v, dout, pallas=pallas)
  b = cp_fwd_bwd(impl, make_mesh(1, 8), slot, seg, q2, k2, v2, dout, pallas=pallas)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x[~doc], y[~doc])
    assert not np.allclose(x[doc], y[doc])


@pytest.mark.parametrize("impl,on_mesh", [("xla", False), ("xla", True), ("pallas", False)])
def test_whole_rows_in_any_slot_order_match_oracle(small_case, impl, on_mesh):
  """Without a context axis `slot_index` may be any permutation (rows attended in row order)."""
  seg, (q, k, v, dout), want = small_case
  slot = np.stack([np.random.default_rng(r).permutation(S) for r in range(4)])
  mesh = make_mesh(2, 1) if on_mesh else None
  # Documents stay contiguous in slot order: the permutation is applied to natural rows.
  fn = lambda q, k, v: segment_attention(
      q, k, v, permute(seg, slot), slot_index=jnp.asarray(slot), implementation=impl,
      pallas=PALLAS if impl == "pallas" else None, mesh=mesh, batch_axis="data", head_axis=None,
      check_segments=True)

  def fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, *vjp(dout)

  got = [unpermute(x, slot) for x in jax.jit(fwd_bwd)(*(permute(x, slot) for x in (q, k, v, dout)))]
  assert_matches(got, want)


def test_default_slot_index_is_the_natural_order(case):
  seg, (q, k, v, _), want = case
  mesh = make_mesh(2, 4)
  out = segment_attention(q, k, v, jnp.asarray(seg), implementation="xla", mesh=mesh,
                          batch_axis="data", head_axis=None, context_axis=CONTEXT_AXIS)
  np.testing.assert_allclose(out, want[0], atol=5e-5)


def test_the_gradient_of_the_all_gather_is_a_reduce_scatter():
  mesh = make_mesh(2, 4)
  q = jnp.ones((2, 64, 2, 16))
  seg = jnp.ones((2, 64), jnp.int32)
  loss = lambda q, k, v: segment_attention(
      q, k, v, seg, implementation="xla", mesh=mesh, batch_axis="data", head_axis=None,
      context_axis=CONTEXT_AXIS).sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(1, 2)))(q, q, q))
  assert "all_gather" in jaxpr and "reduce_scatter" in jaxpr
  # No all-reduce over the context axis (the unused size-1 "tensor" axis gets a trivial psum).
  assert not re.search(r"psum\[axes=\([^)]*'context'", jaxpr)


def test_communicated_bytes_match_the_collectives_of_the_program():
  """context_comm_bytes against the all-gathers and reduce-scatters of the compiled program."""
  b, s, kh, d, cp = 2, 64, 2, 16, 4
  mesh = make_mesh(1, cp)
  q, k, v, _ = random_inputs(0, b, s, 2, kh, d)
  seg = jnp.asarray(rows(s)[:b])
  slot = jnp.asarray(slots_for(np.asarray(seg), cp, "zigzag"))
  loss = lambda q, k, v, seg, slot: segment_attention(
      q, k, v, seg, slot_index=slot, implementation="xla", mesh=mesh, batch_axis=None,
      head_axis=None, context_axis=CONTEXT_AXIS).sum()
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, seg, slot).compile().as_text()
  moved = {"all-gather": 0, "reduce-scatter": 0}
  itemsize = {"f32": 4, "s32": 4}
  for dtype, dims, op in re.findall(
      r"= (\w+)\[([\d,]*)\]\{[^}]*\} (all-gather|reduce-scatter)\(", text):
    n = itemsize[dtype] * int(np.prod([int(x) for x in dims.split(",")]))
    # Every device receives the (cp - 1) / cp of the whole array it does not hold.
    moved[op] += n * (cp - 1) // cp if op == "all-gather" else n * (cp - 1)
  want = context_comm_bytes(seq_len=s, kv_heads=kh, head_dim=d, dtype_bytes=4, context_size=cp,
                            batch=b)
  assert moved["all-gather"] == want["forward"] > 0
  assert moved["reduce-scatter"] == want["backward"] > 0
  assert want["total"] == want["forward"] + want["backward"]
  # By hand: K and V of 8192 slots, 8 kv heads, D = 128, bf16, over 4 devices.
  bf16 = context_comm_bytes(seq_len=8192, kv_heads=8, head_dim=128, dtype_bytes=2,
                            context_size=4)
  assert bf16["all_gather_kv"] == bf16["reduce_scatter_dkv"] == 2 * 6144 * 8 * 128 * 2
  assert bf16["all_gather_ids"] == 2 * 6144 * 4
  assert context_comm_bytes(seq_len=64, kv_heads=1, head_dim=8, dtype_bytes=2,
                            context_size=1)["total"] == 0


def test_pallas_context_parallel_lowers_for_cuda():
  mesh = make_mesh(2, 4)
  sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  args = (sd(2, 1024, 4, 64), sd(2, 1024, 2, 64), sd(2, 1024, 2, 64), sd(2, 1024, dt=jnp.int32),
          sd(2, 1024, dt=jnp.int32))

  def grad(q, k, v, seg, slot):
    loss = lambda q, k, v: segment_attention(
        q, k, v, seg, slot_index=slot, implementation="pallas", mesh=mesh, batch_axis="data",
        head_axis=None, context_axis=CONTEXT_AXIS).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"custom_call @([\w$.]+)", text)
  assert calls and set(calls) == {"__gpu$xla.gpu.triton"}
  for kernel in ("segment_flash_fwd", "segment_flash_bwd_dq", "segment_flash_bwd_dkv"):
    assert kernel in text, kernel
  assert "all_gather" in text and "reduce_scatter" in text


def test_checked_mode_refuses_broken_slot_invariants():
  mesh = make_mesh(1, 4)
  q, k, v, _ = random_inputs(0, 1, 32, 2, 2, 16)
  seg = jnp.asarray(np.repeat([[1, 2, 3, 4]], 8, axis=1))
  call = lambda seg, slot: segment_attention(
      q, k, v, seg, slot_index=jnp.asarray(slot), implementation="xla", mesh=mesh,
      batch_axis=None, head_axis=None, context_axis=CONTEXT_AXIS, check_segments=True)
  zig = zigzag(32, 4)[None]
  call(permute(seg, zig), zig)  # valid
  not_perm = zig.copy()
  not_perm[0, 0] = 1
  with pytest.raises(NonContiguousSegmentsError, match="not a permutation of 0..31"):
    call(permute(seg, zig), not_perm)
  swapped = zig.copy()
  swapped[0, [0, 1]] = swapped[0, [1, 0]]
  with pytest.raises(NonContiguousSegmentsError, match="context device 0 are not ascending"):
    call(seg, swapped)
  # Segment 1 in two runs in slot order: the last slot of the row joins it.
  split = np.asarray(seg).copy()
  split[0, -1] = 1
  with pytest.raises(NonContiguousSegmentsError, match="reopens segment 1 at slot index 31"):
    call(jnp.asarray(split), np.arange(32)[None])


def test_bad_context_arguments_are_refused():
  q, k, v, _ = random_inputs(0, 2, 36, 2, 2, 16)
  seg = jnp.ones((2, 36), jnp.int32)
  with pytest.raises(AttentionInputError, match="`context_axis`='context' needs `mesh`"):
    segment_attention(q, k, v, seg, context_axis=CONTEXT_AXIS)
  with pytest.raises(AttentionInputError, match="sequence S=36 is not divisible by mesh axis "
                     "'context' of size 8"):
    segment_attention(q, k, v, seg, implementation="xla", mesh=make_mesh(1, 8), batch_axis=None,
                      head_axis=None, context_axis=CONTEXT_AXIS)
  with pytest.raises(AttentionInputError, match="`slot_index` shape"):
    segment_attention(q, k, v, seg, slot_index=jnp.zeros((2, 35), jnp.int32))
  for extra in (dict(slot_index=jnp.zeros((2, 36), jnp.int32)),
                dict(mesh=make_mesh(1, 4), context_axis=CONTEXT_AXIS)):
    with pytest.raises(AttentionInputError, match="cudnn' supports neither `slot_index` nor "
                       "`context_axis`"):
      segment_attention(q, k, v, seg, implementation="cudnn", cudnn_segment_bound=4, **extra)

